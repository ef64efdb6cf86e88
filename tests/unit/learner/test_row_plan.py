"""`RowPlan`: every row trained exactly once per epoch, mini-batches as contiguous local slices, the
training step's own micro-batches for every pass, clear errors for batches too small to split, and
(issue 25) no crash on length skew or partial batches: every DP rank runs the same number of
micro-batches, which expert-parallel all-to-alls need."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.errors import MegagrpoError
from megagrpo.learner import layout
from megagrpo.learner.row_plan import RowPlan, balanced_split


def minis(B: int, k: int) -> list[torch.Tensor]:
    """k contiguous mini-batches of floor(B / k) or one more rows, the longer ones first."""
    sizes = [B // k + (i < B % k) for i in range(k)]
    return list(torch.arange(B).split(sizes))


def lens(B: int) -> torch.Tensor:
    return torch.tensor([5 + (i * 37) % 29 for i in range(B)])


@pytest.mark.parametrize("B,dp,mini,mbs", [(16, 1, 1, 4), (16, 2, 2, 2), (24, 4, 3, 1), (13, 2, 2, 3)])
def test_every_row_once_and_mini_batches_are_the_global_chunks(B, dp, mini, mbs):
    plan = RowPlan.build(lens(B), dp=dp, num_mini_batches=mini, micro_batch_size=mbs)
    every = torch.cat([plan.local_rows(d) for d in range(dp)])
    assert sorted(every.tolist()) == list(range(B))
    for d in range(dp):
        local = plan.local_rows(d)
        for sl, chunk, m in zip(plan.mini_batch_slices(d), minis(B, mini), plan.mini_batches):
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


def test_a_very_long_row_no_longer_leaves_its_rank_short_of_rows():
    # A token balance alone gives the 1000-token row a DP shard of its own: 1 row for 2 micro-batches.
    plan = RowPlan.build(torch.tensor([1000, 1, 1, 1]), dp=2, num_mini_batches=1, micro_batch_size=1)
    assert plan.micro_batches == [2]
    assert [m.tolist() for m in plan.mini_batches[0]] == [[0, 3], [1, 2]]


def check_plan(plan: RowPlan, lens: torch.Tensor, dp: int, mini: int, mbs: int) -> None:
    """Every row once, every DP rank the same number of non-empty micro-batches per mini-batch, and that
    number is the row count's alone (ceil(ceil(b / dp) / mbs) whenever b divides by dp)."""
    B = lens.numel()
    assert sorted(torch.cat([plan.local_rows(d) for d in range(dp)]).tolist()) == list(range(B))
    assert len(plan.micro_batches) == len(plan.mini_batches) == mini
    for m, chunk in enumerate(minis(B, mini)):
        b = chunk.numel()
        want = min(math.ceil(math.ceil(b / dp) / mbs), b // dp)  # b // dp binds only if dp does not divide b
        assert plan.micro_batches[m] == want
        assert 1 <= want <= b // dp
    for d in range(dp):
        parts = plan.micro_batch_rows(d)
        per_mini, lo = [], 0
        for sl, n in zip(plan.mini_batch_slices(d), plan.micro_batches):
            mine = [p for p in parts[lo : lo + n] if p.numel()]
            assert len(mine) == n and all(sl.start <= int(p.min()) and int(p.max()) < sl.stop for p in mine)
            per_mini.append(len(mine))
            lo += n
        assert lo == len(parts) and per_mini == plan.micro_batches


@settings(max_examples=150, deadline=None)
@given(
    dp=st.integers(1, 8),
    mini=st.integers(1, 3),
    mbs=st.integers(1, 4),
    extra=st.integers(0, 40),
    long_frac=st.floats(0.0, 0.5),
    balance=st.booleans(),
    data=st.data(),
)
def test_skewed_and_partial_batches_plan_equal_micro_batch_counts(
    dp, mini, mbs, extra, long_frac, balance, data
):
    """Rows of 1-300 tokens, some at a 2000-token max_new_tokens; B any count >= dp x mini (a partial
    dynamic-sampling batch need not divide by dp)."""
    B = dp * mini + extra
    lens = torch.tensor(data.draw(st.lists(st.integers(1, 300), min_size=B, max_size=B)))
    u = torch.tensor(data.draw(st.lists(st.floats(0.0, 1.0), min_size=B, max_size=B)))
    lens = torch.where(u < long_frac, 2000, lens)
    plan = RowPlan.build(lens, dp=dp, num_mini_batches=mini, micro_batch_size=mbs, balance=balance)
    check_plan(plan, lens, dp, mini, mbs)


@pytest.mark.parametrize("seed", range(8))
def test_the_countdown_config_survives_truncated_responses(seed):
    """configs/countdown_qwen3_moe_gdpo.yaml: B 256 on DP 4 at micro-batch 1, 5-15% of responses at
    max_new_tokens 1024; a full batch and a partial one (dynamic sampling kept 31 of 32 prompts)."""
    g = torch.Generator().manual_seed(seed)
    for B in (256, 248):
        lens = 60 + torch.randint(0, 400, (B,), generator=g)
        frac = 0.05 + 0.10 * torch.rand((), generator=g)
        lens = torch.where(torch.rand(B, generator=g) < frac, 60 + 1024, lens)
        plan = RowPlan.build(lens, dp=4, num_mini_batches=1, micro_batch_size=1)
        check_plan(plan, lens, 4, 1, 1)
        tokens = [int(lens[m].sum()) for m in plan.mini_batches[0]]
        assert max(tokens) <= 1.01 * sum(tokens) / 4  # still token-balanced


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 500), min_size=2, max_size=24), data=st.data())
def test_balanced_split_is_the_plain_greedy_whenever_that_gives_enough_rows(lens, data):
    t = torch.tensor(lens)
    k = data.draw(st.integers(1, len(lens)))
    min_rows = data.draw(st.integers(0, len(lens) // k))
    parts = balanced_split(t, k, min_rows=min_rows)
    assert all(p.numel() >= max(min_rows, 1) for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(lens)))
    plain = layout.split_micro_batches(t, k, balance=True)
    if min(p.numel() for p in plain) >= min_rows:
        assert [p.tolist() for p in parts] == [p.tolist() for p in plain]
    with pytest.raises(ValueError, match="rows cannot give"):
        balanced_split(t, k, min_rows=len(lens) // k + 1)
