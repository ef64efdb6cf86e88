"""Router statistics against hand computations: agreement, RSPO gamma, load entropy and drift, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megagrpo.moe.stats import (
    LoadDriftTracker,
    expert_counts,
    load_distribution,
    load_entropy,
    load_metrics,
    router_shift,
    topk_agreement,
)
from tests.unit.algo._quantile_ranks import assert_outward

A = math.log(2.0)


def _routes(x):
    return torch.tensor(x, dtype=torch.int64)


# ---------------------------------------------------------------- agreement


def test_agreement_hand_values():
    # 3 tokens, L=2, K=2, E=4; token 2 is padding with garbage ids.
    a = _routes([[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[-1, -1], [9, 9]]])
    b = _routes([[[1, 0], [2, 0]], [[2, 3], [1, 0]], [[-1, -1], [-1, -1]]])
    mask = torch.tensor([True, True, False])
    st = topk_agreement(a, b, mask, n_experts=4, n_layers=2)
    # token 0: layer0 2/2, layer1 1/2 -> .75; token 1: layer0 0, layer1 1 -> .5
    assert st.per_token.tolist() == [0.75, 0.5, 1.0]
    assert st.per_layer == pytest.approx([0.5, 0.75])
    assert st.mean == pytest.approx(0.625)
    m = st.metrics("rollout_old")
    assert m["moe/agreement_rollout_old"] == pytest.approx(0.625)
    assert m["moe/agreement_rollout_old/layer_1"] == pytest.approx(0.75)


def test_identical_routes_agree_fully_in_bt_layout():
    g = torch.Generator().manual_seed(0)
    r = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * 5 * 3)]).view(2, 5, 3, 2)
    st = topk_agreement(r, r.flip(-1), torch.ones(2, 5, dtype=torch.bool), n_experts=8)
    assert st.mean == 1.0 and st.per_token.shape == (2, 5) and (st.per_token == 1).all()


def test_agreement_with_no_valid_token_is_defined():
    r = _routes([[[0, 1]]])
    st = topk_agreement(r, r, torch.zeros(1, dtype=torch.bool), n_experts=2)
    assert st.mean == 1.0 and st.n_tokens == 0


# ---------------------------------------------------------------- RSPO router shift


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_identical_routers_give_gamma_one():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)  # [B, T, L, E]
    routes = logits.topk(2, -1).indices
    rs = router_shift(logits, logits.clone(), routes, torch.ones(2, 3, dtype=torch.bool))
    assert rs.gamma.shape == (2, 3) and (rs.gamma == 1).all()
    assert rs.gamma_mean == 1.0 and rs.gamma_p1 == 1.0 and rs.floor_frac == 0.0
    assert rs.per_layer_dlogr == [0.0] * 4


def test_gamma_hand_value_probs_and_logits():
    # one token, L=2, E=4; old top-2 = {0, 1} in both layers
    old = _probs([[[0.5, 0.25, 0.125, 0.125], [0.4, 0.3, 0.2, 0.1]]])
    new = _probs([[[0.25, 0.5, 0.125, 0.125], [0.4, 0.3, 0.2, 0.1]]])
    routes = _routes([[[0, 1], [0, 1]]])
    mask = torch.ones(1, dtype=torch.bool)
    # layer 0: |log .25 - log .5| = |log .5 - log .25| = a; layer 1: 0 -> gamma = exp(-(a + 0)/2)
    want = math.exp(-A / 2)
    for scores, x_new, x_old in (("probs", new, old), ("logits", new.log() + 3.0, old.log() - 1.0)):
        rs = router_shift(x_new, x_old, routes, mask, scores=scores, gamma_min=0.1)
        assert float(rs.gamma_raw[0]) == pytest.approx(want, rel=1e-12), scores
        assert float(rs.gamma[0]) == pytest.approx(want, rel=1e-12)
        assert rs.per_layer_dlogr == pytest.approx([A, 0.0])
    floored = router_shift(new, old, routes, mask, scores="probs", gamma_min=0.8)
    assert float(floored.gamma[0]) == 0.8 and floored.floor_frac == 1.0
    assert floored.gamma_mean == pytest.approx(want)  # statistics are of the raw ratio


def test_softmax_all_vs_topk_normalisation():
    # new moves mass uniformly off the old top-2 {0,1}: relative weights inside the set unchanged.
    old = _probs([[[0.5, 0.25, 0.125, 0.125]]])
    new = _probs([[[0.4, 0.2, 0.2, 0.2]]])
    routes = _routes([[[0, 1]]])
    mask = torch.ones(1, dtype=torch.bool)
    all_ = router_shift(new.log(), old.log(), routes, mask, normalize="all", gamma_min=0.0)
    topk = router_shift(new.log(), old.log(), routes, mask, normalize="topk", gamma_min=0.0)
    assert float(all_.gamma_raw[0]) == pytest.approx(1 / 1.25, rel=1e-12)  # exp(-log 1.25)
    assert float(topk.gamma_raw[0]) == pytest.approx(1.0, rel=1e-12)


def test_gamma_statistics_p1_and_masking():
    # 3 valid tokens with d log r = 0, a, 2a (L=1, K=1), one masked token.
    old = _probs([[[0.5, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]]])
    new = _probs([[[0.5, 0.5]], [[0.25, 0.75]], [[0.125, 0.875]], [[0.01, 0.99]]])
    routes = _routes([[[0]], [[0]], [[0]], [[-1]]])
    mask = torch.tensor([1, 1, 1, 0])
    rs = router_shift(new, old, routes, mask, scores="probs", gamma_min=0.3)
    g = [1.0, 0.5, 0.25]
    assert rs.gamma_raw.tolist() == pytest.approx([*g, 1.0])
    assert rs.gamma.tolist() == pytest.approx([1.0, 0.5, 0.3, 1.0])
    assert rs.gamma_mean == pytest.approx(sum(g) / 3)
    # h = .01·2 = .02: the exact p1 is .25 + .02·(.5 - .25); the histogram's is x_(0) = .25 (the exact min)
    assert rs.gamma_p1 == float(rs.gamma_raw[2])
    assert_outward(rs.gamma_p1, torch.tensor(g), 0.01)
    assert rs.floor_frac == pytest.approx(1 / 3)
    m = rs.metrics()
    assert m["moe/router_shift_gamma_p1"] == rs.gamma_p1 and "moe/router_shift_dlogr/layer_0" in m


def test_gamma_is_detached():
    logits_old = torch.randn(4, 2, 6, dtype=torch.float64)
    logits_new = (logits_old + 0.1 * torch.randn(4, 2, 6, dtype=torch.float64)).requires_grad_()
    rs = router_shift(logits_new, logits_old, logits_old.topk(2, -1).indices, torch.ones(4, dtype=torch.bool))
    assert not rs.gamma.requires_grad and 0 < float(rs.gamma.min()) < 1


# ---------------------------------------------------------------- expert load


def test_load_entropy_and_drift_hand_values():
    # L=2, K=1, E=4; layer 0 gets experts [0,0,1,2], layer 1 [0,1,2,3]; token 4 is padding.
    routes = _routes([[[0], [0]], [[0], [1]], [[1], [2]], [[2], [3]], [[7], [7]]])
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    counts = expert_counts(routes, mask, n_experts=4)
    assert counts.tolist() == [[2, 1, 1, 0], [1, 1, 1, 1]]
    load = load_distribution(counts)
    ent = load_entropy(load)
    # layer 0: H = .5 ln 2 + 2·.25 ln 4 = 1.5 ln 2, normalised by ln 4 -> .75
    assert ent.tolist() == pytest.approx([0.75, 1.0])
    assert load_metrics(load)["moe/load_entropy"] == pytest.approx(0.875)

    tr = LoadDriftTracker()
    assert tr.update(load) == {}
    nxt = load_distribution(torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float64))
    d = tr.update(nxt)
    # layer 0: |.5-.25| + 0 + 0 + |0-.25| = .5; layer 1: 0
    assert d["moe/load_drift/layer_0"] == pytest.approx(0.5)
    assert d["moe/load_drift/layer_1"] == 0.0
    assert d["moe/load_drift"] == pytest.approx(0.25)

    resumed = LoadDriftTracker()
    resumed.load_state_dict(json.loads(json.dumps(tr.state_dict())))
    assert resumed.update(load) == tr.update(load)
    with pytest.raises(ValueError, match="layer or expert count changed"):
        tr.update(torch.ones(3, 4) / 4)


def test_empty_layer_load_is_skipped_by_drift():
    tr = LoadDriftTracker()
    tr.update(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    assert tr.update(torch.zeros(1, 2, dtype=torch.float64)) == {}
    assert load_entropy(torch.zeros(1, 2)).tolist() == [0.0]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case, match",
    [
        ("out_of_range", "expert id 4 outside"),
        ("negative", "expert id -2 outside"),
        ("duplicate", "repeats an expert"),
        ("layer_count", "3 MoE layers, expected 2"),
        ("topk_mismatch", "routes_b has top-k 1, expected 2"),
        ("lead_shape", r"must have shape \[\*lead, L, K\]"),
        ("float_routes", "integer tensor"),
        ("mask_shape", "mask shape"),
    ],
)
def test_bad_routes_raise(case, match):
    a = _routes([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    b = a.clone()
    mask = torch.ones(2, dtype=torch.bool)
    n_layers = 2
    if case == "out_of_range":
        b[1, 0, 0] = 4
    elif case == "negative":
        b[0, 1, 1] = -2
    elif case == "duplicate":
        b[0, 0] = torch.tensor([1, 1])
    elif case == "layer_count":
        a = torch.cat([a, a[:, :1]], 1)
    elif case == "topk_mismatch":
        b = b[..., :1]
    elif case == "lead_shape":
        b = b[:1]
    elif case == "float_routes":
        b = b.double()
    elif case == "mask_shape":
        mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match=match):
        topk_agreement(a, b, mask, n_experts=4, n_layers=n_layers)


def test_router_shift_bad_input():
    logits = torch.randn(3, 2, 4)
    routes = logits.topk(2, -1).indices
    mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="router_old shape"):
        router_shift(logits, logits[:, :1], routes, mask)
    with pytest.raises(ValueError, match="2 MoE layers, expected 4"):
        router_shift(logits, logits, routes, mask, n_layers=4)
    with pytest.raises(ValueError, match="old_routes has 1 MoE layers"):
        router_shift(logits, logits, routes[:, :1], mask)
    bad = routes.clone()
    bad[0, 0, 0] = 4
    with pytest.raises(ValueError, match="expert id 4"):
        router_shift(logits, logits, bad, mask)
    with pytest.raises(ValueError, match="probabilities in"):
        router_shift(logits, logits, routes, mask, scores="probs")
    nan = logits.clone()
    nan[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="router_new is not finite"):
        router_shift(nan, logits, routes, mask)
    with pytest.raises(ValueError, match="gamma_min"):
        router_shift(logits, logits, routes, mask, gamma_min=1.5)
