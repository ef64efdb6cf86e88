"""`RowPlan`: every row trained exactly once per epoch, mini-batches as contiguous local slices, the
training step's own micro-batches for every pass, and clear errors for batches too small to split."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.learner import layout
from megagrpo.learner.row_plan import RowPlan


def lens(B: int) -> torch.Tensor:
    return torch.tensor([5 + (i * 37) % 29 for i in range(B)])


@pytest.mark.parametrize("B,dp,mini,mbs", [(16, 1, 1, 4), (16, 2, 2, 2), (24, 4, 3, 1), (13, 2, 2, 3)])
def test_every_row_once_and_mini_batches_are_the_global_chunks(B, dp, mini, mbs):
    plan = RowPlan.build(lens(B), dp=dp, num_mini_batches=mini, micro_batch_size=mbs)
    every = torch.cat([plan.local_rows(d) for d in range(dp)])
    assert sorted(every.tolist()) == list(range(B))
    for d in range(dp):
        local = plan.local_rows(d)
        for sl, chunk, m in zip(
            plan.mini_batch_slices(d), torch.chunk(torch.arange(B), mini), plan.mini_batches
        ):
            assert set(local[sl].tolist()) <= set(chunk.tolist())  # a mini-batch draws from its chunk only
            assert torch.equal(local[sl], m[d])


def test_micro_batches_are_the_training_steps_own_split():
    B, dp, mini, mbs = 20, 2, 2, 2
    plan = RowPlan.build(lens(B), dp=dp, num_mini_batches=mini, micro_batch_size=mbs)
    for d in range(dp):
        parts = plan.micro_batch_rows(d)
        local = plan.local_rows(d)
        assert sorted(torch.cat(parts).tolist()) == list(range(local.numel()))
        want = []
        for sl, n in zip(plan.mini_batch_slices(d), plan.micro_batches):
            # what Learner.train_step does with the mini-batch's local rows
            want += [p + sl.start for p in layout.split_micro_batches(lens(B)[local[sl]], n, balance=True)]
        assert [p.tolist() for p in parts] == [p.tolist() for p in want]
    assert plan.micro_batches == [3, 3]  # ceil(ceil(10 / 2) / 2)


def test_too_few_rows_name_the_fields_to_change():
    with pytest.raises(MegagrpoError, match="algo.ppo_mini_batches"):
        RowPlan.build(lens(3), dp=2, num_mini_batches=2, micro_batch_size=1)
    # one very long row takes a whole DP shard: the other rank has 3 rows for 2 micro-batches, this one 1
    skewed = torch.tensor([1000, 1, 1, 1])
    with pytest.raises(MegagrpoError, match="schedule.micro_batch_size"):
        RowPlan.build(skewed, dp=2, num_mini_batches=1, micro_batch_size=1)
