"""Reading a Hugging Face `config.json`: the two errors every family's parser raises, so that a missing or
unsupported field reads the same whatever the family."""

from __future__ import annotations

from typing import Any

from megagrpo.errors import MegagrpoError


def require(cfg: dict[str, Any], key: str, where: str) -> Any:
    """`cfg[key]`; MegagrpoError naming `where` (the config.json) when it is missing or null."""
    if cfg.get(key) is None:
        raise MegagrpoError(f"{where}: required field {key!r} is missing")
    return cfg[key]


def unsupported(where: str, field: str, value: Any, why: str) -> MegagrpoError:
    """The error for a field whose value megagrpo cannot reproduce exactly, and why."""
    return MegagrpoError(f"{where}: {field}={value!r} is not supported ({why})")
