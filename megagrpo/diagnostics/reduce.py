"""Cross-rank reduction for diagnostics: exact global sums, maxima and gathered samples.

A diagnostic computes local partial results (sums, counts, maxima, the masked values it needs quantiles of)
and asks a `Reducer` to combine them over the data-parallel ranks that each hold part of the batch. With
`LocalReducer` (the default) the "global" batch is the local one. Every rank must call the same reducer
methods in the same order with tensors of the same shape (gather: any length), as with any collective.

Tensors crossing this boundary:
- `sum(x)`, `max(x)`: `x` any shape, returns the element-wise sum / max over ranks, same shape and dtype.
- `gather(x)`: `x` 1-D of any local length, returns the 1-D concatenation over ranks, in rank order.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Reducer(Protocol):
    def sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def max(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """Single-process reducer: the local batch is the whole batch."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 1:
            raise ValueError(f"gather: x must be 1-D, got shape {tuple(x.shape)}")
        return x


class DistReducer:
    """`torch.distributed` reducer over `group` (None: the default group), e.g. the data-parallel group.

    Uses all_reduce for sums and maxima and a size exchange plus padded all_gather for variable-length
    samples. Tensors stay on their device (CUDA tensors for NCCL, CPU tensors for gloo).
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "DistReducer: torch.distributed is not initialised; call init_process_group first"
            )
        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        self._dist.all_reduce(y, op=self._dist.ReduceOp.SUM, group=self.group)
        return y

    def max(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        self._dist.all_reduce(y, op=self._dist.ReduceOp.MAX, group=self.group)
        return y

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 1:
            raise ValueError(f"gather: x must be 1-D, got shape {tuple(x.shape)}")
        n = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
        sizes = [torch.empty_like(n) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, n, group=self.group)
        sizes_i = [int(s.item()) for s in sizes]
        width = max(sizes_i)
        if width == 0:
            return x.new_empty(0)
        padded = x.new_zeros(width)
        padded[: x.numel()] = x
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes_i)])


def quantile_sorted(sorted_x: torch.Tensor, q: float) -> float:
    """Quantile of an ascending 1-D tensor by linear interpolation between order statistics.

    h = (n-1)·q; value = x[floor h] + (h - floor h)·(x[ceil h] - x[floor h]) (numpy's "linear", Hyndman-Fan
    type 7). Works for any length (torch.quantile refuses inputs above 2^24 elements).
    """
    n = sorted_x.numel()
    if n == 0:
        raise ValueError("quantile_sorted: empty input")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile_sorted: q must be in [0, 1], got {q}")
    h = (n - 1) * q
    lo = int(h // 1)
    hi = min(lo + 1, n - 1)
    a = float(sorted_x[lo])
    b = float(sorted_x[hi])
    frac = h - lo
    # Written so equal neighbours (incl. infinities) return that value instead of inf - inf.
    return a if a == b or frac == 0.0 else a + frac * (b - a)
