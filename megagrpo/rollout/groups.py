"""Rollout groups: which ranks own a sampler, which prompts each one samples, and the collectives that
turn the engines' shares back into one step.

Placement. On GPUs every `rollout.engine_tp` consecutive ranks form a colocation group whose first rank
owns one SGLang engine on the group's GPUs (`base_gpu_id` = that rank's local rank), so world / engine_tp
engines run. On the CPU `rollout.num_engines` engines run on evenly spaced ranks (rank e * world // n), one
process each, through the same code. Ranks are node-major under torchrun and Slurm, so a group never
spans nodes when engine_tp divides the ranks per node (`megagrpo submit` checks it).

Shares. A list of n prompts (one dynamic-sampling round, or the held-out set) is split into contiguous,
nearly equal runs, engine e taking `share(n, e)`. The rule depends only on n and the engine count, and
request seeds come from each request's GLOBAL index (`RolloutEngine.generate(index_offset=...)`), so the
same prompt gets the same seed whichever engine samples it: the number of engines changes no completion.

Costs. The collectives here carry scalars per prompt group (rewards, counts) over WORLD; nothing here
moves a token. The groups themselves travel once per step, in `gather_kept`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def _dist() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class EngineGroups:
    """The engines of one run: `num_engines` owners among `world` ranks, and this rank's place."""

    world: int
    rank: int
    num_engines: int

    @classmethod
    def current(cls, num_engines: int) -> EngineGroups:
        rank, world = _dist()
        return cls(world=world, rank=rank, num_engines=num_engines)

    def owner(self, engine: int) -> int:
        """Global rank that owns engine `engine`: the first rank of its group."""
        return engine * self.world // self.num_engines

    @property
    def owners(self) -> list[int]:
        return [self.owner(e) for e in range(self.num_engines)]

    @property
    def engine(self) -> int | None:
        """The engine this rank owns, or None."""
        owners = self.owners
        return owners.index(self.rank) if self.rank in owners else None

    def share(self, n: int, engine: int | None = None) -> range:
        """Positions of `n` prompts that `engine` (default: this rank's) samples; empty for a non-owner."""
        e = self.engine if engine is None else engine
        if e is None:
            return range(0)
        return range(e * n // self.num_engines, (e + 1) * n // self.num_engines)

    def base_gpu_id(self) -> int:
        """The first GPU of this owner's engine on its node: its local rank (torchrun's LOCAL_RANK, Slurm's
        SLURM_LOCALID)."""
        for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
            if var in os.environ:
                return int(os.environ[var])
        return 0

    # -- collectives (every rank calls them, owners or not) -----------------------------------------

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by global rank, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_from_engines(self, obj: Any) -> list[Any]:
        """Each engine owner's `obj`, indexed by engine, on every rank."""
        every = self.gather(obj)
        return [every[r] for r in self.owners]

    def join_shares(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """`[n, ...]` on every rank from each owner's rows `[len(share), ...]` of its own share."""
        parts = self.gather_from_engines(local)
        out = torch.cat([p for p in parts if p is not None and p.shape[0] > 0]) if n else local[:0]
        if out.shape[0] != n:
            raise RuntimeError(f"engine shares hold {out.shape[0]} rows, expected {n}")
        return out

    def sum_counts(self, counts: dict[str, float]) -> dict[str, float]:
        """Per-key sums of the owners' counters (keys missing on an owner count as 0)."""
        total: dict[str, float] = {}
        for part in self.gather_from_engines(counts):
            for k, v in (part or {}).items():
                total[k] = total.get(k, 0.0) + float(v)
        return total

    def gather_kept(self, prompts: list[Any], positions: list[int], n: int) -> list[Any]:
        """The step's `n` kept prompt groups in batch order, on every rank, from the owners that sampled
        them (`DynamicBatch.prompts` / `.positions`). Every rank then holds the whole batch: B x T tokens
        (and routes) per rank, the cost of today's data plane that a sharded one removes (issue 14)."""
        out: list[Any] = [None] * n
        for part in self.gather_from_engines(list(zip(positions, prompts, strict=True))):
            for pos, p in part or []:
                out[pos] = p
        missing = [i for i, p in enumerate(out) if p is None]
        if missing:
            raise RuntimeError(f"no engine returned kept group(s) {missing[:5]} of {n}")
        return out
