"""Parts of the GRPO step that every config option reaches: TIS/MIS masks from a config section, and
what is measured for the mismatch metrics and the `auto` caps (issue 15: non-standard quantiles and
diagnostics.mismatch=false broke cap 'auto' at step 1; mis.mode truncate was rewritten to mask)."""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.config import config_from_dict
from megagrpo.diagnostics.adaptive_cap import AdaptiveCap
from megagrpo.diagnostics.mismatch import mismatch_metrics
from megagrpo.trainer.grpo import correction_masks, mismatch_measurements

LOG_RATIOS = torch.log(torch.tensor([[0.25, 0.9, 1.0, 3.0], [1.1, 0.5, 5.0, 1.0]]))


def batch():
    sampler = torch.full((2, 4), -1.0)
    learner = sampler + LOG_RATIOS
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    return sampler, learner, mask


def algo(**sections):
    return config_from_dict({"model": {"hf_path": "m"}, "algo": sections}).algo


def test_mis_truncate_truncates_as_documented():
    sampler, learner, mask = batch()
    spec = algo(mis={"enabled": True, "mode": "truncate", "cap": 2.0}).mis
    w = correction_masks(spec, 2.0, learner, sampler, mask).weights
    want = LOG_RATIOS.exp().clamp(max=2.0) * mask
    torch.testing.assert_close(w, want)


def test_masking_modes_default_cap_low_to_one_over_cap():
    sampler, learner, mask = batch()
    spec = algo(mis={"enabled": True, "cap": 2.0}).mis  # mode mask, cap_low null
    w = correction_masks(spec, 2.0, learner, sampler, mask).weights
    r = LOG_RATIOS.exp()
    want = torch.where((r >= 0.5) & (r <= 2.0) & mask, r, torch.zeros_like(r))
    torch.testing.assert_close(w, want)
    icepop = algo(tis={"enabled": True, "mode": "icepop", "cap": 2.0}).tis
    assert icepop.cap_low is None  # formerly a ValueError at step 1: icepop needs a lower bound
    w = correction_masks(icepop, 2.0, learner, sampler, mask).weights
    torch.testing.assert_close(w, want)


@pytest.mark.parametrize("full", [True, False])
def test_a_non_standard_auto_quantile_is_measured_with_or_without_diagnostics(full):
    sampler, learner, mask = batch()
    cap = AdaptiveCap.from_auto_config(algo(tis={"auto": {"quantile": 0.9}}).tis.auto)
    logged, measured = mismatch_measurements(sampler, learner, mask, [cap], full=full)
    assert bool(logged) == full
    ref = mismatch_metrics(sampler, learner, mask, extra_token_quantiles=(0.9,)).metrics
    assert measured["mismatch/token_ratio_q0.9"] == pytest.approx(ref["mismatch/token_ratio_q0.9"])
    assert measured["mismatch/n_tokens"] == 7
    new_cap = cap.update(measured)
    assert math.isfinite(new_cap) and 1.5 <= new_cap <= 10.0
    assert new_cap == pytest.approx(max(1.5, ref["mismatch/token_ratio_q0.9"]))


def test_nothing_is_measured_without_diagnostics_or_caps():
    sampler, learner, mask = batch()
    assert mismatch_measurements(sampler, learner, mask, [], full=False) == ({}, {})
