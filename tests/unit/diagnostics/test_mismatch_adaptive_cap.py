"""tis.cap: auto — direction, window arithmetic, clamping, resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megagrpo.diagnostics.adaptive_cap import AdaptiveCap
from megagrpo.diagnostics.mismatch import mismatch_metrics
from tests.unit.algo._quantile_ranks import assert_outward


def _step_metrics(noise: float, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(16, 128, generator=g, dtype=torch.float64) * 3
    ll = s + noise * torch.randn(16, 128, generator=g, dtype=torch.float64)
    return mismatch_metrics(s, ll, torch.ones(16, 128)).metrics


def test_cap_follows_mismatch_up_and_down():
    cap = AdaptiveCap(cap_min=1.01, cap_max=10.0, window=3, initial=2.0)
    assert cap.cap == 2.0
    caps = [cap.update(_step_metrics(n, i)) for i, n in enumerate([0.01, 0.02, 0.05, 0.1, 0.2, 0.4])]
    assert all(b > a for a, b in zip(caps, caps[1:])), caps
    down = [cap.update(_step_metrics(n, 10 + i)) for i, n in enumerate([0.05, 0.02, 0.01, 0.01])]
    assert all(b < a for a, b in zip([caps[-1], *down], down)), down
    assert cap.metrics() == {"mismatch/tis_cap": down[-1]}


def test_window_geometric_mean_hand_value():
    cap = AdaptiveCap(cap_min=1.0, cap_max=100.0, window=2)
    cap.observe(2.0)
    assert cap.observe(8.0) == pytest.approx(4.0)  # sqrt(2·8)
    assert cap.observe(32.0) == pytest.approx(16.0)  # window drops the 2: sqrt(8·32)
    cap2 = AdaptiveCap(cap_min=1.0, cap_max=100.0, window=2, margin=1.5)
    cap2.observe(2.0)
    assert cap2.observe(8.0) == pytest.approx(6.0)


def test_clamping():
    cap = AdaptiveCap(cap_min=1.5, cap_max=5.0, window=4, initial=50.0)
    assert cap.cap == 5.0  # initial is clamped too
    assert cap.observe(1.0) == 1.5
    assert cap.observe(1e300) == 5.0  # geometric mean of 1 and 1e300 is 1e150
    assert cap.observe(math.inf) == 5.0
    low = AdaptiveCap(cap_min=0.1, cap_max=0.9, quantile=0.001, log_name="mismatch/mis_floor")
    assert 0.1 <= low.update(_step_metrics(0.3, 0)) < 0.9
    assert "mismatch/mis_floor" in low.metrics()


def test_empty_step_is_skipped_and_bad_values_raise():
    cap = AdaptiveCap(cap_min=1.0, cap_max=4.0, initial=3.0)
    assert cap.update({"mismatch/n_tokens": 0.0, "mismatch/token_ratio_p999": 1.0}) == 3.0
    with pytest.raises(ValueError, match="lack 'mismatch/token_ratio_p999'"):
        cap.update({"mismatch/n_tokens": 4.0})
    with pytest.raises(ValueError, match="must be > 0"):
        cap.observe(math.nan)
    with pytest.raises(ValueError, match="cap_min <= cap_max"):
        AdaptiveCap(cap_min=3.0, cap_max=2.0)
    with pytest.raises(ValueError, match="window"):
        AdaptiveCap(cap_min=1.0, cap_max=2.0, window=0)


def test_state_dict_resume_is_exact():
    a = AdaptiveCap(cap_min=1.0, cap_max=10.0, window=3)
    for q in (1.5, 2.5, 1.7, 3.1):
        a.observe(q)
    b = AdaptiveCap(cap_min=1.0, cap_max=10.0, window=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.cap == a.cap
    for q in (2.2, 1.1):
        assert b.observe(q) == a.observe(q)
    with pytest.raises(ValueError, match="not an AdaptiveCap state"):
        b.load_state_dict({"prev": []})


def test_from_config_section_and_nonstandard_quantile():
    from types import SimpleNamespace

    cap = AdaptiveCap.from_auto_config(SimpleNamespace(quantile=0.995, window=4, clamp=[1.2, 8.0]))
    assert (cap.cap_min, cap.cap_max, cap.window, cap.metric) == (1.2, 8.0, 4, "mismatch/token_ratio_q0.995")
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(4, 64, generator=g, dtype=torch.float64)
    ll = s + 0.3 * torch.randn(4, 64, generator=g, dtype=torch.float64)
    m = mismatch_metrics(s, ll, torch.ones(4, 64), extra_token_quantiles=(0.995,)).metrics
    got = m["mismatch/token_ratio_q0.995"]
    assert_outward(math.log(got), (ll - s).flatten(), 0.995)
    assert cap.update(m) == pytest.approx(min(8.0, max(1.2, got)), rel=1e-12)
    # the histogram's cap is conservative: never below the exact quantile's (it truncates no more)
    assert cap.cap >= min(8.0, max(1.2, math.exp(float(torch.quantile((ll - s).flatten(), 0.995)))))
