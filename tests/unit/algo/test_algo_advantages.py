"""Advantages, KL estimators and DAPO filters: hand-worked numbers and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.algo.advantages import METHODS, advantage_metrics, gdpo, group_advantages
from megagrpo.algo.filters import keep_groups, overlong_mask, soft_overlong_penalty
from megagrpo.algo.kl import token_kl

F64 = torch.float64


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(
        group_advantages(r, "grpo", eps=0.0), torch.tensor([[0.5, -0.5, -0.5, 0.5]], dtype=F64) / s
    )
    torch.testing.assert_close(
        group_advantages(r, "dr_grpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5]], dtype=F64)
    )
    # rloo: 1 - mean(0, 0, 1) = 2/3, 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(group_advantages(r, "rloo"), torch.tensor([[2, -2, -2, 2]], dtype=F64) / 3)
    # rank: tied pairs share ranks 0.5 and 2.5 of 0..3 -> 2 * 0.5 / 3 - 1 = -2/3, +2/3
    torch.testing.assert_close(group_advantages(r, "rank"), torch.tensor([[2, -2, -2, 2]], dtype=F64) / 3)
    torch.testing.assert_close(
        group_advantages(torch.tensor([[3.0, 1.0, 2.0], [5.0, 5.0, 5.0]]), "rank"),
        torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]),
    )
    # batch_std: group means 0.5 and 3, batch std of [1, 0, 3, 3] = sqrt(6.75 / 3) = 1.5
    torch.testing.assert_close(
        group_advantages(torch.tensor([[1.0, 0.0], [3.0, 3.0]], dtype=F64), "batch_std", eps=0.0),
        torch.tensor([[1 / 3, -1 / 3], [0.0, 0.0]], dtype=F64),
    )


def test_dr_grpo_stays_bounded_where_the_z_score_explodes():
    r = torch.tensor([[1.0, 1.0, 1.0, 0.999]], dtype=F64)
    dr = group_advantages(r, "dr_grpo")
    z = group_advantages(r, "grpo")
    spread = float(r.max() - r.min())
    torch.testing.assert_close(dr, torch.tensor([[0.00025, 0.00025, 0.00025, -0.00075]], dtype=F64))
    assert float(dr.abs().max()) <= spread  # bounded by the reward spread
    # the z-score blows a 0.001 reward difference up to ~1.5 (std 5e-4 by hand): 1500x amplification
    assert float(z.abs().max()) == pytest.approx(0.00075 / (5e-4 + 1e-6))
    assert float(z.abs().max()) / spread > 1000


@settings(max_examples=30, deadline=None)
@given(
    r=st.lists(st.lists(st.floats(-5, 5), min_size=2, max_size=8), min_size=1, max_size=5).filter(
        lambda rows: len({len(x) for x in rows}) == 1
    )
)
def test_advantage_properties(r):
    rewards = torch.tensor(r, dtype=F64)
    g = rewards.shape[1]
    for method in ("grpo", "dr_grpo", "rloo", "rank"):
        a = group_advantages(rewards, method)
        assert a.shape == rewards.shape and bool(torch.isfinite(a).all())
        # group-relative: zero mean per group, up to the round-off of the mean (|r| eps64 per reward),
        # which the z-score divides by std + 1e-6: equal rewards of 3.14 leave 4.4e-10 each
        assert float(a.sum(dim=1).abs().max()) < g * 5.0 * 2.3e-16 / 1e-6
    torch.testing.assert_close(
        group_advantages(rewards, "rloo"), group_advantages(rewards, "dr_grpo") * g / (g - 1)
    )
    rank = group_advantages(rewards, "rank")
    assert float(rank.abs().max()) <= 1 + 1e-12
    # order-preserving: a higher reward never gets a lower advantage
    for method in METHODS:
        a = group_advantages(rewards, method)
        hi = rewards.unsqueeze(2) > rewards.unsqueeze(1)
        assert bool((a.unsqueeze(2) >= a.unsqueeze(1) - 1e-9)[hi].all())


def test_gdpo_by_hand():
    # correctness [1, 0, 0, 1], format [1, 1, 0, 0], weights [1, 0.5]; each z-score is +-a with a = sqrt(3)/2
    r = torch.tensor([[[1, 1], [0, 1], [0, 0], [1, 0]]], dtype=F64)
    w = torch.tensor([1.0, 0.5], dtype=F64)
    a = math.sqrt(3) / 2
    summed = gdpo(r, w, eps=0.0, batch_normalise=False)
    torch.testing.assert_close(summed, a * torch.tensor([[1.5, -0.5, -1.5, 0.5]], dtype=F64))
    # then batch z-score: std of [1.5, -0.5, -1.5, 0.5] is sqrt(5/3)
    torch.testing.assert_close(
        gdpo(r, w, eps=0.0), torch.tensor([[1.5, -0.5, -1.5, 0.5]], dtype=F64) / math.sqrt(5 / 3)
    )
    # The collapse GDPO fixes: group 1 = (0,0) vs (1,0), group 2 = (0,0) vs (1,1). GRPO on the summed
    # reward gives both groups +-0.707; GDPO gives +-0.707 and +-1.414 (one reward vs two rewards won).
    two = torch.tensor([[[0, 0], [1, 0]], [[0, 0], [1, 1]]], dtype=F64)
    grpo_sum = group_advantages(two.sum(-1), "grpo", eps=0.0)
    torch.testing.assert_close(grpo_sum[0], grpo_sum[1])
    dec = gdpo(two, torch.ones(2, dtype=F64), eps=1e-6, batch_normalise=False)
    torch.testing.assert_close(
        dec, torch.tensor([[-1, 1], [-2, 2]], dtype=F64) / math.sqrt(2), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="weights"):
        gdpo(r, torch.ones(3, dtype=F64))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((torch.ones(4, 1), "grpo"), "G=1"),
        ((torch.ones(4), "grpo"), "rewards"),
        ((torch.ones(2, 3), "z-score"), "method"),
        ((torch.tensor([[1.0, float("nan")]]), "grpo"), "rewards"),
        ((torch.ones(2, 3, dtype=torch.int64), "grpo"), "rewards"),
    ],
)
def test_advantage_bad_input(args, needle):
    with pytest.raises(ValueError, match=needle):
        group_advantages(*args)


def test_advantage_metrics():
    met = advantage_metrics(torch.tensor([[1.0, -1.0, 0.0, 2.0]]))
    assert float(met["adv/mean"]) == pytest.approx(0.5)
    assert float(met["adv/abs_max"]) == 2.0 and float(met["adv/zero_frac"]) == 0.25
    assert float(met["adv/std"]) == pytest.approx(torch.tensor([1.0, -1.0, 0.0, 2.0]).std().item())


# ---- KL estimators --------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -2.0]], dtype=F64)  # log r = -0.5, 0
    torch.testing.assert_close(token_kl(logp, ref, "k1"), torch.tensor([[0.5, 0.0]], dtype=F64))
    torch.testing.assert_close(token_kl(logp, ref, "k2"), torch.tensor([[0.125, 0.0]], dtype=F64))
    torch.testing.assert_close(
        token_kl(logp, ref, "k3"), torch.tensor([[math.exp(-0.5) - 0.5, 0.0]], dtype=F64)
    )
    wild = token_kl(torch.tensor([[-40.0]]), torch.tensor([[-1.0]]), "low_var_kl")  # k3 would be e^39
    assert float(wild) == 10.0
    masked = token_kl(
        logp, torch.tensor([[float("nan"), -2.0]], dtype=F64), "k3", loss_mask=torch.tensor([[0, 1]])
    )
    torch.testing.assert_close(masked, torch.zeros(1, 2, dtype=F64))
    with pytest.raises(ValueError, match="estimator"):
        token_kl(logp, ref, "k5")
    with pytest.raises(ValueError, match="ref_logp"):
        token_kl(logp, ref[:, :1], "k1")


def test_k1_and_k3_are_unbiased_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=F64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=F64), 0)
    true_kl = float((p * (p / q).log()).sum())
    y = torch.multinomial(p, 200_000, replacement=True, generator=g)
    logp, ref = p.log()[y].unsqueeze(0), q.log()[y].unsqueeze(0)
    for est in ("k1", "k3"):
        assert float(token_kl(logp, ref, est).mean()) == pytest.approx(true_kl, rel=0.03)
    assert bool((token_kl(logp, ref, "k3") >= 0).all())


# ---- DAPO filters ---------------------------------------------------------------------------------------


def test_keep_groups_drops_zero_variance_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1e-9]])
    assert keep_groups(r).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="G=1"):
        keep_groups(torch.ones(3, 1))


def test_overlong_mask():
    assert overlong_mask(["stop", "length", "abort", "stop"]).tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match=r"finish_reasons\[1\]"):
        overlong_mask(["stop", "eos"])
    with pytest.raises(ValueError, match="finish_reasons"):
        overlong_mask("stop")


def test_soft_overlong_penalty_by_hand():
    lengths = torch.tensor([50, 80, 90, 100, 120])
    # max 100, cache 20: free up to 80, then (80 - L) / 20, then -1
    pen = soft_overlong_penalty(lengths, max_len=100, cache_len=20)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(soft_overlong_penalty(lengths, 100, 20, factor=2.0), 2 * pen)
    with pytest.raises(ValueError, match="cache_len"):
        soft_overlong_penalty(lengths, 100, 200)
    with pytest.raises(ValueError, match="lengths"):
        soft_overlong_penalty(lengths.float(), 100, 20)
