"""What an engine's model fixes for its lifetime (its checkpoint's shapes, its parameter names, the fused
groups, the full-sync packing plan, its held shapes), computed on its first sync rather than on every one."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def _sglang_engine(engine: Any) -> Any:
    return getattr(engine, "engine", engine)  # a RolloutEngine or a bare sglang.Engine


# What an engine's model fixes for its lifetime (its checkpoint's shapes, its parameter names, the full-sync
# packing plan), computed on its first sync rather than on every one.
_PER_ENGINE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _per_engine(eng: Any, key: str, compute: Callable[[], Any]) -> Any:
    known = _PER_ENGINE.setdefault(eng, {})
    if key not in known:
        known[key] = compute()
    return known[key]
