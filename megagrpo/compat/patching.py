"""The mechanism every CPU patch goes through: replace one upstream attribute, record why, count hits.

Counting hits lets a test prove that the patched code paths are the ones actually exercised.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

HITS: Counter[str] = Counter()


@dataclass(frozen=True)
class Patch:
    name: str  # "module.attr" of the upstream thing replaced
    reason: str


APPLIED: dict[str, Patch] = {}


def replace(owner: Any, attr: str, new: Any, *, reason: str, count_hits: bool = True) -> None:
    """Set `owner.attr = new`, recording the patch; callables are wrapped to count their calls."""
    qual = f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"
    if qual in APPLIED:
        return
    if count_hits and callable(new) and not isinstance(new, type):

        @functools.wraps(new)
        def counted(*args: Any, **kwargs: Any) -> Any:
            HITS[qual] += 1
            return new(*args, **kwargs)

        setattr(owner, attr, counted)
    else:
        setattr(owner, attr, new)
    APPLIED[qual] = Patch(qual, reason)


def hit(name: str) -> None:
    """Count a hit for a patch that is not a plain callable replacement (e.g. a class method)."""
    HITS[name] += 1
