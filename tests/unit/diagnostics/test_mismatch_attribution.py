"""Attribution shares: definitions, edge cases, and the routing-vs-numeric split on constructed passes."""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.diagnostics.attribution import attribute_mismatch, attribution_shares


def test_shares_when_parts_fall_short_leave_a_residual():
    s = attribution_shares(1.0, 0.6, 0.3)
    assert s["mismatch/routing_share"] == pytest.approx(0.6)
    assert s["mismatch/numeric_share"] == pytest.approx(0.3)
    assert s["mismatch/residual_share"] == pytest.approx(0.1)
    assert s["mismatch/attribution_total"] == 1.0


def test_shares_when_parts_overshoot_are_rescaled_to_their_sum():
    s = attribution_shares(1.0, 0.8, 0.4)
    assert s["mismatch/routing_share"] == pytest.approx(2 / 3)
    assert s["mismatch/numeric_share"] == pytest.approx(1 / 3)
    assert s["mismatch/residual_share"] == 0.0


@pytest.mark.parametrize(
    "total, routing, numeric", [(0.0, 0.0, 0.0), (1e-15, 1e-16, 0.0), (-1e-9, -1e-9, 0.0)]
)
def test_shares_are_zero_when_nothing_to_attribute(total, routing, numeric):
    s = attribution_shares(total, routing, numeric)
    assert s["mismatch/routing_share"] == 0.0 and s["mismatch/numeric_share"] == 0.0
    assert s["mismatch/residual_share"] == 0.0


def test_negative_part_is_clamped_and_unmeasured_part_omitted():
    s = attribution_shares(2.0, -0.1)
    assert s["mismatch/routing_share"] == 0.0 and "mismatch/numeric_share" not in s
    assert s["mismatch/residual_share"] == 1.0
    assert s["mismatch/attribution_total"] == 2.0


def test_shares_reject_non_finite():
    with pytest.raises(ValueError, match="routing must be finite"):
        attribution_shares(1.0, math.nan, 0.1)


def _passes(seed=0):
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(8, 64, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(8, 64, generator=g) > 0.1
    return g, sampler, mask


def test_routing_noise_only_makes_routing_share_dominate():
    g, sampler, mask = _passes()
    # Learner without replay: some tokens routed differently -> large log-prob changes on those tokens.
    rerouted = torch.rand(8, 64, generator=g) < 0.2
    no_replay = sampler + torch.where(
        rerouted, 0.5 * torch.randn(8, 64, generator=g, dtype=torch.float64), 0.0
    )
    r3 = sampler.clone()  # replaying the sampler's routes removes the difference
    s = attribute_mismatch(
        sampler,
        no_replay,
        mask,
        learner_no_replay_logp=no_replay,
        learner_r3_logp=r3,
        learner_fp32_logp=no_replay,
    )
    assert s["mismatch/routing_share"] > 0.9
    assert s["mismatch/numeric_share"] < 0.05


def test_numeric_noise_only_makes_numeric_share_dominate():
    g, sampler, mask = _passes(1)
    fp32 = sampler.clone()
    bf16 = sampler + 1e-2 * torch.randn(
        8, 64, generator=g, dtype=torch.float64
    )  # same routes, rounding noise
    s = attribute_mismatch(
        sampler, bf16, mask, learner_no_replay_logp=bf16, learner_r3_logp=bf16, learner_fp32_logp=fp32
    )
    assert s["mismatch/numeric_share"] > 0.9
    assert s["mismatch/routing_share"] < 0.05


def test_attribute_needs_both_routing_passes():
    _, sampler, mask = _passes()
    with pytest.raises(ValueError, match="both learner_no_replay_logp and learner_r3_logp"):
        attribute_mismatch(sampler, sampler, mask, learner_r3_logp=sampler)
