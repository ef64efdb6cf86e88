"""Which rows of a step's global batch each data-parallel rank trains on, decided once per step from the
global sequence lengths alone, identically on every rank.

The global batch of B rows is cut into k contiguous mini-batches of floor(B / k) or one more rows (one
optimizer step each); each mini-batch is split over the DP ranks, token-balanced when `balance`
(contiguous runs otherwise), with at least as many rows on every rank as the mini-batch has
micro-batches: expert-parallel all-to-alls need every DP rank to run the same number of micro-batches,
and the micro-batch count comes from the row count alone, so a rank that holds the long rows must still
get enough rows (issue 25: a plain token balance left it too few on ordinary length skew).
`schedule.micro_batch_size` sets the count; a rank holding short rows gets more of them per
micro-batch, with about the same tokens. A rank's LOCAL batch is its rows of every mini-batch,
mini-batch after mini-batch, so mini-batch m is a contiguous slice of it. Inside a mini-batch the rank's
rows are cut into the same micro-batches for the old-policy pass, the reference pass and the training
step, so a row meets the same neighbours in every pass (on-policy ratios are exactly 1 where the
kernels are deterministic).

Cost: the plan holds B int64 row ids; building it reads B lengths. No row moves here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megagrpo.errors import MegagrpoError
from megagrpo.learner import layout


@dataclass(frozen=True)
class RowPlan:
    """`mini_batches[m][d]`: int64 global row ids (ascending) of mini-batch m on DP rank d;
    `micro_batches[m]`: micro-batches per DP rank in mini-batch m (the same on every DP rank, which
    expert-parallel all-to-alls need)."""

    seq_lens: Tensor  # [B] int64, global
    mini_batches: list[list[Tensor]]
    micro_batches: list[int]
    balance: bool

    @classmethod
    def build(
        cls,
        seq_lens: Tensor,
        *,
        dp: int,
        num_mini_batches: int,
        micro_batch_size: int,
        balance: bool = True,
    ) -> RowPlan:
        """`seq_lens [B]`: every row's token count. Each mini-batch of b rows runs `micro_batch_count(b,
        dp, micro_batch_size)` micro-batches on every DP rank, and every rank gets at least that many rows,
        whatever the lengths (a partial dynamic-sampling batch included)."""
        lens = seq_lens.to(torch.int64).cpu()
        B = int(lens.numel())
        if dp * num_mini_batches > B:
            raise MegagrpoError(
                f"the step kept {B} rows, fewer than {dp} data-parallel ranks x {num_mini_batches} mini-batches "
                "(algo.ppo_mini_batches): lower algo.ppo_mini_batches or sample more prompts per step"
            )
        minis, micros = [], []
        # Mini-batches of floor(B / k) or one more rows: torch.chunk's ceil-sized pieces could leave the
        # last one fewer rows than DP ranks (or make fewer than k pieces) on a partial batch.
        for rows in layout.split_micro_batches(lens, num_mini_batches, balance=False):
            n_micro = micro_batch_count(rows.numel(), dp, micro_batch_size)
            if balance:
                parts = balanced_split(lens[rows], dp, min_rows=n_micro)
            else:  # contiguous runs of floor(b / dp) or one more rows, >= n_micro each
                parts = layout.split_micro_batches(lens[rows], dp, balance=False)
            minis.append([rows[p] for p in parts])
            micros.append(n_micro)
        return cls(lens, minis, micros, balance)

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.numel())

    def local_rows(self, dp_rank: int) -> Tensor:
        """int64 global ids of DP rank `dp_rank`'s rows, in local-batch order."""
        return torch.cat([m[dp_rank] for m in self.mini_batches])

    def mini_batch_slices(self, dp_rank: int) -> list[slice]:
        """Mini-batch m's rows in DP rank `dp_rank`'s local batch."""
        out, lo = [], 0
        for m in self.mini_batches:
            n = int(m[dp_rank].numel())
            out.append(slice(lo, lo + n))
            lo += n
        return out

    def micro_batch_rows(self, dp_rank: int) -> list[Tensor]:
        """The local batch cut into micro-batches (local row indices), mini-batch after mini-batch: the
        partition that the training step of each mini-batch makes itself (`layout.split_micro_batches`)."""
        out = []
        for sl, n_micro, m in zip(self.mini_batch_slices(dp_rank), self.micro_batches, self.mini_batches):
            lens = self.seq_lens[m[dp_rank]]
            out += [p + sl.start for p in layout.split_micro_batches(lens, n_micro, balance=self.balance)]
        return out


def micro_batch_count(rows: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches per DP rank for a mini-batch of `rows` rows: ceil(ceil(rows / dp) / micro_batch_size),
    at most floor(rows / dp) so that every rank can hold one row per micro-batch (a partial batch that
    does not divide by dp), and at least 1. The count depends on the row count alone, never the lengths."""
    if not 1 <= dp <= rows:
        raise ValueError(f"dp={dp} must be in [1, {rows} rows]")
    per_rank = -(-rows // dp)
    return max(1, min(-(-per_rank // micro_batch_size), rows // dp))


def balanced_split(seq_lens: Tensor, n_groups: int, *, min_rows: int) -> list[Tensor]:
    """Token-balanced split of `seq_lens [b]` into `n_groups` groups of at least `min_rows` rows each:
    int64 indices per group, ascending.

    Longest-first greedy onto the lightest group (`layout.split_micro_batches(balance=True)`'s rule),
    except that once the rows left are only just enough to bring every group to `min_rows`, each goes to
    the lightest group still short of it. Only the shortest rows are ever forced, so the balance is
    nearly the unconstrained greedy's (B 256 over 4 ranks, 64 rows each, 5-15% of rows at 1084 tokens and
    the rest 60-459: the heaviest rank holds at most 1.0042x the mean tokens, against 1.0030x
    unconstrained). With `min_rows` <= 1 this is exactly the unconstrained greedy. Cost: O(b log b + b x
    n_groups) on the host."""
    b = int(seq_lens.numel())
    if n_groups < 1 or n_groups * min_rows > b:
        raise ValueError(f"{b} rows cannot give {n_groups} groups {min_rows} rows each")
    lengths = [int(x) for x in seq_lens.tolist()]
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    loads = [0] * n_groups
    need = max(min_rows, 1)  # no group may stay empty
    short = n_groups * need  # rows still owed to groups below `need`
    for left, i in enumerate(sorted(range(b), key=lambda j: (-lengths[j], j))):
        pool = range(n_groups)
        if b - left == short:  # no row to spare: only a group still short may take this one
            pool = [g for g in pool if len(groups[g]) < need]
        g = min(pool, key=lambda g: (loads[g], len(groups[g]), g))
        if len(groups[g]) < need:
            short -= 1
        groups[g].append(i)
        loads[g] += lengths[i]
    return [torch.tensor(sorted(g), dtype=torch.int64) for g in groups]
