"""DAPO data shaping: dynamic-sampling group filter and overlong filtering / soft punishment.

Shapes: rewards `[n_prompts, G]`; lengths `[B]` (response tokens); finish reasons one string per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megagrpo.algo import _checks

FINISH_REASONS = ("stop", "length", "abort")


def keep_groups(rewards: Tensor) -> Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal (DAPO 2503.14476 Eq. 8 constraint).

    Returns bool `[n_prompts]`; a zero-variance group has all advantages 0 and only dilutes the batch.
    """
    rewards = _checks.floating("rewards", rewards)
    _checks.ndim("rewards", rewards, 2, "[n_prompts, G]")
    if rewards.shape[1] < 2:
        raise ValueError(f"rewards has group size G={rewards.shape[1]}; dynamic sampling needs G >= 2")
    _checks.finite_where("rewards", rewards, None)
    return rewards.amax(dim=1) > rewards.amin(dim=1)


def overlong_mask(finish_reasons: Sequence[str]) -> Tensor:
    """DAPO overlong filtering: bool `[B]`, False for truncated (`"length"`) sequences (DAPO 2503.14476 Sec. 3.4).

    Multiply it into `loss_mask` (`loss_mask & keep[:, None]`) so truncated samples carry no gradient.
    Accepted reasons: `FINISH_REASONS`.
    """
    if isinstance(finish_reasons, str) or not isinstance(finish_reasons, Sequence):
        raise ValueError("finish_reasons must be a sequence of strings, one per sequence")
    for i, r in enumerate(finish_reasons):
        if r not in FINISH_REASONS:
            raise ValueError(
                f"finish_reasons[{i}]={r!r} is not one of {', '.join(map(repr, FINISH_REASONS))}"
            )
    return torch.tensor([r != "length" for r in finish_reasons], dtype=torch.bool)


def soft_overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment added to the reward (DAPO 2503.14476 Eq. 13), float32 `[B]`, all <= 0.

    0 up to max_len - cache_len, then linear down to -factor at max_len, and -factor beyond it.
    """
    lengths = _checks.tensor("lengths", lengths)
    _checks.ndim("lengths", lengths, 1, "[B]")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths holds negative values")
    if int(max_len) <= 0:
        raise ValueError(f"max_len={max_len} must be > 0")
    if not 0 < int(cache_len) <= int(max_len):
        raise ValueError(f"cache_len={cache_len} must be in (0, max_len={max_len}]")
    _checks.positive("factor", factor, strict=False)
    expected = max_len - cache_len
    ln = lengths.to(torch.float32)
    ramp = (expected - ln) / cache_len
    pen = torch.where(
        ln <= expected, torch.zeros_like(ln), torch.where(ln <= max_len, ramp, torch.full_like(ln, -1.0))
    )
    return pen * factor
