"""Which rows of a step's global batch each data-parallel rank trains on, decided once per step from the
global sequence lengths alone, identically on every rank.

The global batch of B rows is cut into contiguous mini-batches (one optimizer step each); each
mini-batch is split over the DP ranks by `layout.split_micro_batches` (token-balanced when `balance`).
A rank's LOCAL batch is its rows of every mini-batch, mini-batch after mini-batch, so mini-batch m is a
contiguous slice of it. Inside a mini-batch the rank's rows are cut into the same micro-batches for the
old-policy pass, the reference pass and the training step, so a row meets the same neighbours in every
pass (on-policy ratios are exactly 1 where the kernels are deterministic).

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
        """`seq_lens [B]`: every row's token count. Each mini-batch of b rows runs ceil(ceil(b / dp) /
        micro_batch_size) micro-batches per DP rank."""
        lens = seq_lens.to(torch.int64).cpu()
        B = int(lens.numel())
        if dp * num_mini_batches > B:
            raise MegagrpoError(
                f"the step kept {B} rows, fewer than {dp} data-parallel ranks x {num_mini_batches} mini-batches "
                "(algo.ppo_mini_batches): lower algo.ppo_mini_batches or sample more prompts per step"
            )
        minis, micros = [], []
        for rows in torch.chunk(torch.arange(B), num_mini_batches):
            parts = layout.split_micro_batches(lens[rows], dp, balance=balance)
            per_rank = -(-rows.numel() // dp)
            n_micro = max(1, -(-per_rank // micro_batch_size))
            smallest = min(p.numel() for p in parts)
            if n_micro > smallest:
                raise MegagrpoError(
                    f"a mini-batch of {rows.numel()} rows gives one data-parallel rank only {smallest} rows "
                    f"for {n_micro} micro-batches (token balancing); raise schedule.micro_batch_size"
                )
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
