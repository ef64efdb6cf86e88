"""Aggregation: the global-normaliser contract (micro-batch / DP invariance), SFT NLL, metric merging."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.algo.aggregation import AGG_MODES, aggregate, loss_normaliser, masked_mean, nll_loss
from megagrpo.algo.importance import train_inference_weights
from megagrpo.algo.losses import VARIANTS, policy_loss
from megagrpo.algo.metrics import REDUCTIONS, merge_metrics
from tests.unit.algo._algo_batches import F64, all_reduce_worker, make_batch, run_loss


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(2, 7),
    t=st.integers(1, 6),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    token_adv=st.booleans(),
)
def test_micro_batches_with_global_normaliser_sum_to_the_full_batch(seed, b, t, cuts, token_adv):
    logp0, old, adv, m, ref, ent, iw = make_batch(seed, b, t)
    if token_adv:  # per-token advantages [B, T]
        adv = adv.unsqueeze(-1) * torch.linspace(0.5, 1.5, t, dtype=F64)
    bounds = sorted({c for c in cuts if c < b} | {0, b})
    for variant in VARIANTS:
        if variant == "gmpo" and token_adv:
            continue
        for agg in AGG_MODES:
            full_lp = logp0.clone().requires_grad_()
            full, full_met = run_loss(variant, agg, full_lp, old, adv, m, ref, ent, iw)
            (full_grad,) = torch.autograd.grad(full, full_lp)
            norm = loss_normaliser(m, agg, agg_constant=37.0)
            lp = logp0.clone().requires_grad_()
            total, parts = 0.0, []
            for s, e in zip(bounds[:-1], bounds[1:]):
                part, met = run_loss(
                    variant, agg, lp[s:e], old[s:e], adv[s:e], m[s:e], ref[s:e], ent[s:e], iw[s:e], norm
                )
                total = total + part
                parts.append(met)
            (grad,) = torch.autograd.grad(total, lp)
            torch.testing.assert_close(total, full, msg=f"{variant} {agg}")
            torch.testing.assert_close(grad, full_grad, msg=f"{variant} {agg}")
            merged = merge_metrics(parts)
            for k, v in full_met.items():
                torch.testing.assert_close(merged[k], v.to(F64), msg=f"{variant} {agg} {k}")


def test_loss_normaliser_by_hand():
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert loss_normaliser(m, "token-mean") == 4.0
    assert loss_normaliser(m, "seq-mean-token-mean") == 2.0  # the empty row is not a sequence
    assert loss_normaliser(m, "seq-mean-token-sum") == 2.0
    assert loss_normaliser(m, "seq-mean-token-sum-norm", agg_constant=4096) == 2.0 * 4096
    assert loss_normaliser(torch.zeros(2, 3), "token-mean") == 0.0
    with pytest.raises(ValueError, match="agg_constant"):
        loss_normaliser(m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="agg"):
        loss_normaliser(m, "sum")
    with pytest.raises(ValueError, match="loss_mask"):
        loss_normaliser(torch.ones(3), "token-mean")


def test_aggregate_and_masked_mean_ignore_padding():
    v = torch.tensor([[1.0, 3.0, float("nan")], [2.0, float("inf"), 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert float(masked_mean(v, m)) == pytest.approx(2.0)
    assert float(aggregate(v, m, "seq-mean-token-mean")) == pytest.approx((2.0 + 2.0) / 2)
    assert float(aggregate(v, m, "seq-mean-token-sum")) == pytest.approx((4.0 + 2.0) / 2)
    assert float(aggregate(v, m, "seq-mean-token-sum-norm", agg_constant=3.0)) == pytest.approx(6.0 / 6)
    assert float(masked_mean(v, torch.zeros_like(m))) == 0.0
    with pytest.raises(ValueError, match="values"):
        aggregate(v[0], m, "token-mean")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_sft_nll_equals_reinforce_with_unit_advantages(agg):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 7, 11, generator=g, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7), generator=g)
    m = torch.arange(7).unsqueeze(0) < torch.tensor([[7], [3], [5]])
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    nll = nll_loss(logp, m, agg=agg, agg_constant=7.0)
    rl, _ = policy_loss(
        logp, logp.detach(), torch.ones(3, dtype=F64), m, variant="reinforce", agg=agg, agg_constant=7.0
    )
    torch.testing.assert_close(nll, rl)
    (g1,) = torch.autograd.grad(nll, logits, retain_graph=True)
    (g2,) = torch.autograd.grad(rl, logits)
    torch.testing.assert_close(g1, g2)
    if agg == "token-mean":  # and it is the ordinary masked cross-entropy
        ce = torch.nn.functional.cross_entropy(logits[m], targets[m])
        torch.testing.assert_close(nll, ce)


def test_every_produced_metric_has_a_registered_reduction():
    logp, old, adv, m, ref, ent, iw = make_batch(0, 3, 4)
    for variant in VARIANTS:
        _, met = run_loss(variant, "token-mean", logp, old, adv, m, ref, ent, iw)
        assert set(met) <= set(REDUCTIONS)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in met.values())
    _, imet = train_inference_weights(logp, old, m, level="token", mode="mask", cap_high=1.5, cap_low=0.7)
    assert set(imet) <= set(REDUCTIONS)
    with pytest.raises(ValueError, match="no registered reduction"):
        merge_metrics([{"loss/unknown": torch.tensor(1.0)}])


def test_merge_ignores_empty_parts_for_min_max():
    full = {
        "loss/tokens": torch.tensor(3.0),
        "loss/ratio_min": torch.tensor(0.9),
        "loss/ratio_max": torch.tensor(1.1),
    }
    empty = {
        "loss/tokens": torch.tensor(0.0),
        "loss/ratio_min": torch.tensor(0.0),
        "loss/ratio_max": torch.tensor(0.0),
    }
    out = merge_metrics([empty, full, empty])
    assert float(out["loss/ratio_min"]) == pytest.approx(0.9) and float(
        out["loss/ratio_max"]
    ) == pytest.approx(1.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_reduce_metrics_across_two_gloo_ranks_equals_full_batch():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=all_reduce_worker, args=(r, 2, _free_port_cached(), queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs)
    logp, old, adv, m, ref, ent, iw = make_batch(11, 6, 5)
    m[4:6] = False
    _, full = run_loss("grpo", "seq-mean-token-mean", logp, old, adv, m, ref, ent, iw)
    _, ifull = train_inference_weights(logp, old, m, level="token", mode="icepop", cap_high=1.3, cap_low=0.8)
    for rank in (0, 1):
        for k, v in (full | ifull).items():
            assert results[rank][k] == pytest.approx(float(v), rel=1e-9, abs=1e-12), (rank, k)


_PORT: list[int] = []


def _free_port_cached() -> int:
    if not _PORT:
        _PORT.append(_free_port())
    return _PORT[0]
