"""mismatch_metrics against hand computations on small constructed inputs (fp64)."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

from megagrpo.algo.importance import importance_masks, importance_metrics
from megagrpo.diagnostics.mismatch import mismatch_metrics
from tests.unit.algo._quantile_ranks import assert_outward

A = math.log(2.0)
NAN = float("nan")

# Two sequences; sequence 1 has one padded position. Token ratios w = p_l / p_s are [1, 2, 1/2 | 4, 1/2].
P_S = [[0.5, 0.25, 0.8], [0.1, 0.2, 0.3]]
P_L = [[0.5, 0.5, 0.4], [0.4, 0.1, 0.3]]
MASK = [[1, 1, 1], [1, 1, 0]]
W = [1.0, 2.0, 0.5, 4.0, 0.5]
DELTA = [0.0, A, -A, 2 * A, -A]


def _inputs(pad_value=NAN):
    s = torch.tensor(P_S, dtype=torch.float64).log()
    ll = torch.tensor(P_L, dtype=torch.float64).log()
    s[1, 2] = pad_value  # padding must never be read
    ll[1, 2] = pad_value
    return s, ll, torch.tensor(MASK, dtype=torch.bool)


def test_token_metrics_equal_hand_computation():
    s, ll, m = _inputs()
    r = mismatch_metrics(s, ll, m)
    g = r.metrics
    n = 5
    assert g["mismatch/n_tokens"] == 5 and g["mismatch/n_seqs"] == 2
    # |dp| = [0, .25, .4 | .3, .1]
    assert g["mismatch/abs_dp_mean"] == pytest.approx(1.05 / n, rel=1e-12)
    assert g["mismatch/abs_dp_max"] == pytest.approx(0.4, rel=1e-12)
    assert g["mismatch/abs_dlogp_mean"] == pytest.approx(5 * A / n, rel=1e-12)
    # KL(mu||pi): k1 = -delta, k3 = w - 1 - delta
    assert g["mismatch/kl_sampler_learner_k1"] == pytest.approx(-A / n, rel=1e-12)
    assert g["mismatch/kl_sampler_learner_k3"] == pytest.approx((3 - A) / n, rel=1e-12)
    # KL(pi||mu): k1 = w·delta, k3 = 1 - w + w·delta
    assert g["mismatch/kl_learner_sampler_k1"] == pytest.approx(9 * A / n, rel=1e-12)
    assert g["mismatch/kl_learner_sampler_k3"] == pytest.approx((9 * A - 3) / n, rel=1e-12)
    assert g["mismatch/chi2"] == pytest.approx(10.5 / n, rel=1e-12)  # (w-1)^2 = [0,1,.25,9,.25]
    # ESS/N = (sum w)^2 / (N sum w^2) = 64 / (5 * 21.5)
    assert g["mismatch/ess_ratio"] == pytest.approx(64 / (5 * 21.5), rel=1e-12)
    assert statistics.correlation([0.5, 0.25, 0.8, 0.1, 0.2], [0.5, 0.5, 0.4, 0.4, 0.1]) == pytest.approx(
        g["mismatch/prob_corr"], rel=1e-10
    )


def test_quantiles_bracket_the_hand_computation():
    """Histogram quantiles (megagrpo.algo.quantiles): upper ones at the upper edge of the bin of x_(ceil h),
    clamped to the exact maximum, lower ones at the lower edge of x_(floor h)'s bin."""
    s, ll, m = _inputs()
    g = mismatch_metrics(s, ll, m).metrics
    # sorted log-ratios [-a, -a, 0, a, 2a]; h = 4q
    assert 1.0 < g["mismatch/token_ratio_p50"] <= math.exp(2.0**-23)  # x_(2) = 0: the zero bin's edge
    assert g["mismatch/token_ratio_p99"] == pytest.approx(4.0, rel=1e-12)  # x_(4) = 2a: the exact max
    assert g["mismatch/token_ratio_p999"] == pytest.approx(4.0, rel=1e-12)
    assert 0.5 * (1 - 0.011 * A) <= g["mismatch/token_ratio_p001"] <= 0.5  # x_(0) = -a, one bin lower
    # sequence log-ratios: product [0, a], geometric [0, a/2]; h = q, so x_(1) (the exact max) above p0
    assert g["mismatch/seq_log_ratio_prod_p50"] == pytest.approx(A, rel=1e-12)
    assert g["mismatch/seq_ratio_prod_p50"] == pytest.approx(2.0, rel=1e-12)
    assert g["mismatch/seq_ratio_prod_p99"] == pytest.approx(2.0, rel=1e-12)
    assert g["mismatch/seq_ratio_geo_p50"] == pytest.approx(2.0**0.5, rel=1e-12)
    assert g["mismatch/seq_ratio_geo_p99"] == pytest.approx(2.0**0.5, rel=1e-12)
    assert g["mismatch/seq_ess_ratio"] == pytest.approx(9 / 10, rel=1e-12)  # weights [1, 2]


def test_per_sequence_values():
    s, ll, m = _inputs()
    r = mismatch_metrics(s, ll, m)
    ps = r.per_sequence
    assert r.seq_valid.tolist() == [True, True]
    assert ps["n_tokens"].tolist() == [3.0, 2.0]
    assert ps["abs_dp_mean"].tolist() == pytest.approx([0.65 / 3, 0.4 / 2], rel=1e-12)
    assert ps["abs_dp_max"].tolist() == pytest.approx([0.4, 0.3], rel=1e-12)
    assert ps["seq_log_ratio_prod"].tolist() == pytest.approx([0.0, A], rel=1e-12)
    assert ps["seq_log_ratio_geo"].tolist() == pytest.approx([0.0, A / 2], rel=1e-12)
    assert ps["chi2"].tolist() == pytest.approx([1.25 / 3, 9.25 / 2], rel=1e-12)
    ess = [3.5**2 / (3 * 5.25), 4.5**2 / (2 * 16.25)]
    assert ps["ess_ratio"].tolist() == pytest.approx(ess, rel=1e-12)


@pytest.mark.parametrize(
    "rule, want",
    [
        # token ratios [1, 2, .5 | 4, .5]
        (dict(level="token", mode="truncate", cap_high=1.5), {"token_above_cap": 2 / 5}),
        (
            dict(level="token", mode="icepop", cap_high=3.0, cap_low=0.6),
            {"token_above_cap": 1 / 5, "token_below_floor": 2 / 5, "zero_weight": 3 / 5},
        ),
        # sequence ratios [1, 2]: the second sequence is masked (vetoed) entirely
        (
            dict(level="sequence", mode="mask", cap_high=1.5),
            {"seq_above_cap": 1 / 2, "seq_veto": 1 / 2, "zero_weight": 2 / 5},
        ),
    ],
)
def test_fractions_by_cause_from_the_importance_rule(rule, want):
    s, ll, m = _inputs(pad_value=0.0)
    masks = importance_masks(ll, s, m, **rule)
    g = mismatch_metrics(s, ll, m, importance=masks).metrics
    keys = (
        "token_above_cap",
        "token_below_floor",
        "zero_weight",
        "seq_above_cap",
        "seq_below_floor",
        "seq_veto",
    )
    for k in keys:
        assert g[f"mismatch/is_frac_{k}"] == pytest.approx(want.get(k, 0.0), abs=1e-15), k
    # Same definitions as algo.importance.importance_metrics on one rank.
    ref = importance_metrics(masks, m)
    for k in keys:
        assert g[f"mismatch/is_frac_{k}"] == pytest.approx(float(ref[f"mismatch/is_frac_{k}"]), abs=1e-15)


def test_identical_passes_give_zero_mismatch():
    torch.manual_seed(0)
    lp = -torch.rand(3, 7, dtype=torch.float64) * 3
    g = mismatch_metrics(lp, lp.clone(), torch.ones(3, 7)).metrics
    for k in (
        "abs_dp_mean",
        "abs_dp_max",
        "abs_dlogp_mean",
        "kl_sampler_learner_k1",
        "kl_sampler_learner_k3",
    ):
        assert g[f"mismatch/{k}"] == 0.0
    assert g["mismatch/chi2"] == 0.0
    assert g["mismatch/ess_ratio"] == pytest.approx(1.0) and g["mismatch/seq_ess_ratio"] == pytest.approx(1.0)
    assert g["mismatch/token_ratio_p999"] == 1.0 and g["mismatch/seq_ratio_prod_p99"] == 1.0
    assert g["mismatch/prob_corr"] == pytest.approx(1.0)


def test_all_masked_sequence_is_excluded_and_neutral():
    s, ll, m = _inputs()
    s3 = torch.cat([s, torch.full((1, 3), NAN, dtype=torch.float64)])
    l3 = torch.cat([ll, torch.zeros(1, 3, dtype=torch.float64)])
    m3 = torch.cat([m, torch.zeros(1, 3, dtype=torch.bool)])
    r = mismatch_metrics(s3, l3, m3)
    ref = mismatch_metrics(s, ll, m).metrics
    assert r.seq_valid.tolist() == [True, True, False]
    assert r.metrics == pytest.approx(ref, rel=1e-12)
    for key, v in r.per_sequence.items():
        assert not torch.isnan(v).any(), key
    assert r.per_sequence["ess_ratio"][2] == 1.0 and r.per_sequence["chi2"][2] == 0.0


def test_empty_mask_gives_defined_values():
    s = torch.full((2, 4), NAN)
    r = mismatch_metrics(s, s.clone(), torch.zeros(2, 4, dtype=torch.bool))
    g = r.metrics
    assert all(not math.isnan(v) for v in g.values())
    assert g["mismatch/n_tokens"] == 0 and g["mismatch/kl_sampler_learner_k3"] == 0.0
    assert g["mismatch/token_ratio_p999"] == 1.0 and g["mismatch/ess_ratio"] == 1.0
    assert g["mismatch/prob_corr"] == 1.0
    assert r.seq_valid.tolist() == [False, False]
    # Zero-size batches are fine too.
    g0 = mismatch_metrics(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5)).metrics
    assert g0["mismatch/n_tokens"] == 0 and not any(math.isnan(v) for v in g0.values())


def test_extreme_ratio_never_nan():
    s = torch.tensor([[-900.0, -0.1]], dtype=torch.float64)
    ll = torch.tensor([[-0.0, -0.1]], dtype=torch.float64)
    g = mismatch_metrics(s, ll, torch.ones(1, 2)).metrics
    assert not any(math.isnan(v) for v in g.values())
    assert g["mismatch/kl_learner_sampler_k3"] == math.inf
    assert g["mismatch/seq_log_ratio_prod_p50"] == pytest.approx(900.0)
    assert math.isfinite(g["mismatch/seq_ratio_prod_p50"])  # saturates at float max
    assert g["mismatch/ess_ratio"] == pytest.approx(0.5)  # one weight dominates: ESS = 1 of 2


def test_quantiles_match_torch_quantile_on_random_input():
    torch.manual_seed(3)
    s = -torch.rand(6, 50, dtype=torch.float64) * 4
    ll = s + 0.3 * torch.randn(6, 50, dtype=torch.float64)
    m = torch.rand(6, 50) > 0.3
    g = mismatch_metrics(s, ll, m).metrics
    d = (ll - s)[m]
    for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999), ("p001", 0.001)):
        assert_outward(math.log(g[f"mismatch/token_ratio_{name}"]), d, q)
    seq = torch.where(m, ll - s, torch.zeros_like(s)).sum(1)
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        assert_outward(g[f"mismatch/seq_log_ratio_prod_{name}"], seq, q)
    w = d.exp()
    assert g["mismatch/ess_ratio"] == pytest.approx(
        float(w.sum() ** 2 / (w.numel() * (w * w).sum())), rel=1e-12
    )


def test_float32_inputs_are_accepted():
    s, ll, m = _inputs(pad_value=0.0)
    g32 = mismatch_metrics(s.float(), ll.float(), m).metrics
    g64 = mismatch_metrics(s, ll, m).metrics
    assert g32["mismatch/chi2"] == pytest.approx(g64["mismatch/chi2"], rel=1e-5)


@pytest.mark.parametrize(
    "case, match",
    [
        ("learner_shape", "learner_logp shape"),
        ("mask_shape", "loss_mask shape"),
        ("rank", r"must be \[B, T\]"),
        ("nan_valid", "sampler_logp is not finite"),
        ("mask_values", "loss_mask must be bool"),
        ("int_logp", "must be a floating tensor"),
        ("importance_shape", "importance.token_above_cap"),
        ("extra_quantile", "extra_token_quantiles"),
    ],
)
def test_bad_input_raises_clear_error(case, match):
    s, ll, m = _inputs(pad_value=0.0)
    kwargs = {}
    if case == "learner_shape":
        ll = ll[:, :2]
    elif case == "mask_shape":
        m = m[:1]
    elif case == "rank":
        s, ll, m = s.flatten(), ll.flatten(), m.flatten()
    elif case == "nan_valid":
        s[0, 1] = NAN
    elif case == "mask_values":
        m = m.long() * 2
    elif case == "int_logp":
        s = s.long()
    elif case == "importance_shape":
        masks = importance_masks(ll, s, m, level="token", mode="truncate", cap_high=2.0)
        kwargs["importance"] = dataclasses.replace(masks, token_above_cap=masks.token_above_cap[:, :1])
    elif case == "extra_quantile":
        kwargs["extra_token_quantiles"] = (99.0,)
    with pytest.raises(ValueError, match=match):
        mismatch_metrics(s, ll, m, **kwargs)
