"""Histogram quantiles (`megagrpo.algo.quantiles`): the stated bound against exact type-7 quantiles, exact
extremes, and the same result whatever the number of ranks the values are split over."""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.algo.quantiles import MAX_MAGNITUDE, N_BINS, histogram, summarize
from tests.unit.algo._quantile_ranks import FakeRanks, assert_outward

QS = (0.0, 0.001, 0.01, 0.25, 0.5, 0.75, 0.99, 0.999, 1.0)


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "tiny_log_ratios": 1e-4 * torch.randn(5000, generator=g, dtype=torch.float64),
        "log_ratios": 0.3 * torch.randn(3001, generator=g, dtype=torch.float64),
        "wide": torch.randn(2000, generator=g, dtype=torch.float64)
        * 10 ** (4 * torch.rand(2000, generator=g)),
        "positive": torch.rand(777, generator=g, dtype=torch.float64),  # gammas in (0, 1]
        "ties": torch.tensor([0.0, 0.0, 0.5, 0.5, 0.5, -2.0], dtype=torch.float64),
        "one": torch.tensor([-3.25], dtype=torch.float64),
        "fp32": (0.5 * torch.randn(999, generator=g)).float(),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_quantiles_are_outward_and_within_the_bound(case):
    x = _cases()[case]
    (s,) = summarize([x])
    assert s.n == x.numel() and int(s.counts.sum()) == x.numel() and s.counts.numel() == N_BINS
    for q in QS:
        assert_outward(s.quantile(q), x, q)
    assert s.quantile(0.0) == float(x.min()) and s.quantile(1.0) == float(x.max())  # exact extremes


def test_values_beyond_the_range_stay_on_the_outward_side():
    x = torch.tensor(
        [-4 * MAX_MAGNITUDE, -1.0, 0.0, 2.0, 3 * MAX_MAGNITUDE, 5 * MAX_MAGNITUDE], dtype=torch.float64
    )
    (s,) = summarize([x])
    assert s.quantile(0.99) >= float(torch.quantile(x, 0.99)) and s.quantile(0.99) <= 5 * MAX_MAGNITUDE
    assert s.quantile(0.01) <= float(torch.quantile(x, 0.01)) and s.quantile(0.01) >= -4 * MAX_MAGNITUDE
    assert histogram(torch.tensor([math.inf, -math.inf]))[[0, -1]].tolist() == [1, 1]


def test_split_over_ranks_gives_the_same_summary_and_fixed_bytes():
    """1 rank vs 4 (uneven, one empty): identical counts and extremes, so identical quantiles; each rank
    receives the same fixed bytes whatever its share and the total."""
    xs = [_cases()["log_ratios"], _cases()["positive"]]
    one = summarize(xs)
    cuts = [0, 1000, 1000, 2500, None]
    ranks = FakeRanks(4)

    def per_rank(rank, red):
        return summarize([x[cuts[rank] : cuts[rank + 1]] for x in xs], red)

    for got in ranks.run(per_rank):
        for a, b in zip(got, one, strict=True):
            assert torch.equal(a.counts, b.counts) and (a.n, a.lo, a.hi) == (b.n, b.lo, b.hi)
            assert [a.quantile(q) for q in QS] == [b.quantile(q) for q in QS]
    assert ranks.received == [2 * (N_BINS * 8 + 2 * 8)] * 4
    with pytest.raises(ValueError, match="no values"):
        summarize([torch.zeros(0)])[0].quantile(0.5)
