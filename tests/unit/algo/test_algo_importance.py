"""Train/inference importance weights: TIS caps, MIS/IcePop masks by cause, sequence levels, log space."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.algo.importance import LEVELS, importance_masks, train_inference_weights

F64 = torch.float64


@settings(max_examples=40, deadline=None)
@given(
    x=st.lists(st.floats(-1000, 1000), min_size=1, max_size=24),
    t=st.integers(1, 6),
    cap=st.floats(1.0001, 10.0),
    level=st.sampled_from(LEVELS),
)
def test_tis_never_exceeds_its_cap_and_stays_finite(x, t, cap, level):
    b = -(-len(x) // t)
    m = (torch.arange(b * t) < len(x)).reshape(b, t)
    for dtype in (torch.float64, torch.float32):
        lr = torch.tensor(x + [0.0] * (b * t - len(x)), dtype=dtype).reshape(b, t)
        sampler = torch.full((b, t), -1.0, dtype=dtype)
        w, met = train_inference_weights(lr - 1.0, sampler, m, level=level, mode="truncate", cap_high=cap)
        cap_t = torch.tensor(cap, dtype=dtype)  # the cap as the weights' dtype represents it
        assert bool(torch.isfinite(w).all())
        assert bool((w <= cap_t).all())
        assert float(met["mismatch/is_weight_max"]) <= float(cap_t)
        assert bool((w[~m] == 0).all())


def test_token_level_mask_and_truncate_by_cause():
    lr = torch.tensor([[1.0, 0.0, -1.0, 0.3]], dtype=F64)  # ratios e, 1, 1/e, 1.35
    m = torch.tensor([[True, True, True, False]])
    lp, sp = lr - 2.0, torch.full_like(lr, -2.0)
    masks = importance_masks(lp, sp, m, level="token", mode="mask", cap_high=2.0, cap_low=0.5)
    torch.testing.assert_close(masks.weights, torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=F64))
    assert masks.token_above_cap.tolist() == [[True, False, False, False]]
    assert masks.token_below_floor.tolist() == [[False, False, True, False]]
    assert masks.seq_veto.tolist() == [False]
    w, met = train_inference_weights(lp, sp, m, level="token", mode="icepop", cap_high=2.0, cap_low=0.5)
    torch.testing.assert_close(w, masks.weights)
    assert float(met["mismatch/is_frac_token_above_cap"]) == pytest.approx(1 / 3)
    assert float(met["mismatch/is_frac_token_below_floor"]) == pytest.approx(1 / 3)
    assert float(met["mismatch/is_frac_zero_weight"]) == pytest.approx(2 / 3)
    assert float(met["mismatch/is_frac_seq_veto"]) == 0
    # TIS: cap e at 2, keep 1/e (no floor), padding 0
    w, met = train_inference_weights(lp, sp, m, level="token", mode="truncate", cap_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, math.exp(-1), 0.0]], dtype=F64))
    assert float(met["mismatch/is_frac_token_above_cap"]) == pytest.approx(1 / 3)
    assert float(met["mismatch/is_weight_mean"]) == pytest.approx((3 + math.exp(-1)) / 3)


def test_sequence_and_geometric_levels_veto_whole_sequences():
    # seq 0: log-ratios +0.1 x 6 -> product e^0.6 = 1.82, geometric e^0.1 = 1.105
    # seq 1: -0.5, -0.5 -> product e^-1 = 0.368, geometric e^-0.5 = 0.607; seq 2: empty
    lr = torch.tensor([[0.1] * 6, [-0.5, -0.5, 0, 0, 0, 0], [0.0] * 6], dtype=F64)
    m = torch.tensor([[True] * 6, [True, True] + [False] * 4, [False] * 6])
    lp, sp = lr - 1.0, torch.full_like(lr, -1.0)
    seq = importance_masks(lp, sp, m, level="sequence", mode="mask", cap_high=1.5, cap_low=0.5)
    assert seq.seq_above_cap.tolist() == [True, False, False]
    assert seq.seq_below_floor.tolist() == [False, True, False]
    assert seq.seq_veto.tolist() == [True, True, False]
    assert float(seq.weights.abs().sum()) == 0
    geo_w, met = train_inference_weights(lp, sp, m, level="geometric", mode="mask", cap_high=1.5, cap_low=0.5)
    torch.testing.assert_close(geo_w[0], torch.full((6,), math.exp(0.1), dtype=F64))
    torch.testing.assert_close(geo_w[1, :2], torch.full((2,), math.exp(-0.5), dtype=F64))
    assert float(met["mismatch/is_seqs"]) == 2 and float(met["mismatch/is_frac_seq_veto"]) == 0
    tis_w, met = train_inference_weights(lp, sp, m, level="sequence", mode="truncate", cap_high=1.5)
    torch.testing.assert_close(tis_w[0], torch.full((6,), 1.5, dtype=F64))
    torch.testing.assert_close(tis_w[1, :2], torch.full((2,), math.exp(-1), dtype=F64))
    assert float(met["mismatch/is_frac_seq_above_cap"]) == pytest.approx(1 / 2)
    assert float(met["mismatch/is_frac_seq_veto"]) == 0  # truncation keeps the sequence


def test_veto_low_removes_sequences_with_one_tiny_ratio():
    lr = torch.tensor([[0.0, -12.0, 0.0], [0.0, -0.1, 0.1]], dtype=F64)
    m = torch.ones(2, 3, dtype=torch.bool)
    masks = importance_masks(
        lr, torch.zeros_like(lr), m, level="token", mode="truncate", cap_high=2.0, veto_low=1e-4
    )
    assert masks.seq_veto.tolist() == [True, False]
    assert float(masks.weights[0].abs().sum()) == 0 and bool((masks.weights[1] > 0).all())


def test_log_space_sequence_product_never_overflows():
    lr = torch.full((2, 4096), 5.0)  # product e^20480
    m = torch.ones(2, 4096, dtype=torch.bool)
    w, met = train_inference_weights(
        lr, torch.zeros_like(lr), m, level="sequence", mode="truncate", cap_high=3.0
    )
    assert bool((w == 3.0).all()) and all(bool(torch.isfinite(v)) for v in met.values())
    w, _ = train_inference_weights(
        -lr, torch.zeros_like(lr), m, level="sequence", mode="truncate", cap_high=3.0
    )
    assert bool((w == 0).all())  # e^-20480 underflows to 0, which is the right limit


def test_weights_are_detached_and_padding_may_hold_garbage():
    lp = torch.tensor([[-1.0, float("nan")], [-0.5, float("-inf")]], requires_grad=True)
    sp = torch.tensor([[-1.1, float("inf")], [-0.4, 3.0]])
    m = torch.tensor([[True, False], [True, False]])
    w, met = train_inference_weights(lp, sp, m, level="geometric", mode="truncate", cap_high=2.0)
    assert not w.requires_grad and bool(torch.isfinite(w).all())
    assert w[:, 1].tolist() == [0.0, 0.0]
    assert all(bool(torch.isfinite(v)) for v in met.values())


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"level": "tok"}, "level"),
        ({"mode": "clip"}, "mode"),
        ({"cap_high": -1.0}, "cap_high"),
        ({"cap_low": 3.0}, "cap_low"),
        ({"mode": "icepop"}, "cap_low"),
        ({"mode": "icepop", "cap_low": 0.5, "level": "sequence"}, "level"),
        ({"sampler_logp": torch.zeros(2, 2)}, "sampler_logp"),
        ({"learner_logp": torch.tensor([[float("nan"), 0, 0]] * 2)}, "learner_logp"),
    ],
)
def test_bad_input(kw, needle):
    args = {
        "learner_logp": torch.zeros(2, 3),
        "sampler_logp": torch.zeros(2, 3),
        "loss_mask": torch.ones(2, 3),
    }
    opts = {"level": "token", "mode": "mask", "cap_high": 2.0}
    for k in list(kw):
        (args if k in args else opts)[k] = kw[k]
    with pytest.raises(ValueError, match=needle):
        train_inference_weights(args["learner_logp"], args["sampler_logp"], args["loss_mask"], **opts)
