"""Cross-rank reduction for diagnostics: exact global sums and maxima of fixed-size summaries.

A diagnostic computes local partial results (sums, counts, maxima, quantile histograms: see
`megagrpo.algo.quantiles`) and asks a `Reducer` to combine them over the data-parallel ranks that each hold
part of the batch. With `LocalReducer` (the default) the "global" batch is the local one. Every rank must
call the same reducer methods in the same order with tensors of the same shape, as with any collective.
A statistic never gathers every token's value: its per-rank bytes must not grow with the batch.

Tensors crossing this boundary:
- `sum(x)`, `max(x)`: `x` any shape, returns the element-wise sum / max over ranks, same shape and dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Reducer(Protocol):
    def sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def max(self, x: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """Single-process reducer: the local batch is the whole batch."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DistReducer:
    """`torch.distributed` reducer over `group` (None: the default group), e.g. the data-parallel group.

    `sum` and `max` are one all_reduce of `x` each: per rank, the bytes of `x` (about twice that on the
    wire in a ring), whatever the group size. Tensors stay on their device (CUDA tensors for NCCL, CPU
    tensors for gloo).
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
        """Every rank's 1-D `x` (any local length), concatenated in rank order. Not for statistics (not in
        `Reducer`): each rank receives every rank's values, group size × the longest `x`, padded. Kept for
        moving rows between the ranks that need them (`moe.replay`)."""
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
