"""File helpers the bundle modules share: JSON read as a user error, and a file's sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megagrpo.errors import MegagrpoError


def read_json(path: Path, missing: str) -> dict:
    """The JSON object at `path`; `missing` is the message (after the path) when the file does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise MegagrpoError(f"{path}: {missing}") from None
    except json.JSONDecodeError as e:
        raise MegagrpoError(f"{path}: not valid JSON ({e}); write it again") from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
