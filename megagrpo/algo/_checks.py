"""Argument checks shared by the algo modules.

Pure-math APIs raise `ValueError` naming the argument; nothing here ever broadcasts silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def choice(name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, allowed))}")
    return value


def tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def floating(name: str, x: object) -> Tensor:
    x = tensor(name, x)
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def shape(name: str, x: Tensor, expected: tuple[int, ...], expected_desc: str) -> Tensor:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {expected_desc} = {tuple(expected)}")
    return x


def ndim(name: str, x: Tensor, n: int, desc: str) -> Tensor:
    if x.dim() != n:
        raise ValueError(f"{name} must be {desc} ({n}-D), got shape {tuple(x.shape)}")
    return x


def mask(name: str, loss_mask: object, like: Tensor) -> Tensor:
    """Returns the mask as bool `[B, T]`. Float masks must hold only 0 and 1."""
    loss_mask = tensor(name, loss_mask)
    shape(name, loss_mask, tuple(like.shape), "[B, T] like logp")
    if loss_mask.dtype == torch.bool:
        return loss_mask
    m = loss_mask != 0
    if loss_mask.is_floating_point() and not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool); use token_weights for soft weights")
    return m


def finite_where(name: str, x: Tensor, m: Tensor | None) -> None:
    """Raises if `x` is non-finite anywhere `m` (bool, broadcastable) is true, or anywhere if `m` is None."""
    ok = torch.isfinite(x)
    if m is not None:
        ok = ok | ~m
    if not bool(ok.all()):
        where = "under loss_mask" if m is not None else "anywhere"
        raise ValueError(
            f"{name} holds NaN or inf {where}; fix the producer (masked positions may hold any value)"
        )


def positive(name: str, value: float | None, *, allow_none: bool = False, strict: bool = True) -> None:
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{name} is required here")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")) or (v <= 0 if strict else v < 0):
        raise ValueError(f"{name}={value!r} must be a finite number {'>' if strict else '>='} 0")
