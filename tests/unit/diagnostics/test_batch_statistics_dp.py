"""Batch statistics through the reducer interface on fake DP ranks (threads, `FakeRanks`): the quantiles of
`mismatch_metrics`, `token_ratio_quantiles` and the RSPO gamma p1 are bit-identical on 1 and 4 ranks, and
what a rank receives for them depends neither on the batch nor on the DP size (issue 25: they used to
gather every valid token's log-ratio to every rank)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.diagnostics.mismatch import mismatch_metrics, token_ratio_quantiles
from megagrpo.moe.stats import router_shift_summary
from tests.unit.algo._quantile_ranks import FakeRanks

QUANTILE_KEYS = ("token_ratio", "seq_ratio", "seq_log_ratio", "token_ratio_q0.9")


def _batch(rows: int, T: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(rows, T, generator=g, dtype=torch.float64) * 3
    ll = s + 0.2 * torch.randn(rows, T, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, T, generator=g) > 0.2
    mask[-1] = False  # an all-masked row
    return s, ll, mask


def _cuts(rows: int, n: int) -> list[slice]:
    """Uneven row shards; with n > 1 the last rank holds no row at all."""
    if n == 1:
        return [slice(0, rows)]
    edges = [0, *(round(rows * (r + 1) / (n - 1) * 0.9) for r in range(n - 2)), rows, rows]
    return [slice(edges[r], edges[r + 1]) for r in range(n)]


def _per_rank_metrics(rows: int, n: int):
    s, ll, mask = _batch(rows)
    cuts = _cuts(rows, n)
    ranks = FakeRanks(n)

    def fn(rank, red):
        c = cuts[rank]
        full = mismatch_metrics(s[c], ll[c], mask[c], extra_token_quantiles=(0.9,), reducer=red).metrics
        only = token_ratio_quantiles(s[c], ll[c], mask[c], [0.999, 0.001], reducer=red)
        gamma = torch.exp(-(ll[c] - s[c]).abs())[mask[c]]  # stands in for unfloored gammas in (0, 1]
        n_tok = torch.tensor([float(gamma.numel())], dtype=torch.float64)
        shift = router_shift_summary(gamma, n_tok * 0.1, n_tok, gamma_min=0.8, reducer=red)
        return full, only, shift.gamma_p1

    return ranks.run(fn), ranks.received


def test_one_and_four_ranks_give_identical_quantiles():
    (ref,), _ = _per_rank_metrics(48, 1)
    got, _ = _per_rank_metrics(48, 4)
    for full, only, p1 in got:
        assert full.keys() == ref[0].keys()
        for k, v in ref[0].items():
            if k.startswith(tuple(f"mismatch/{q}" for q in QUANTILE_KEYS)):
                assert full[k] == v, k  # histogram counts add exactly: bit-identical
            else:
                assert full[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
        assert only == ref[1] and p1 == ref[2]
        assert only["mismatch/token_ratio_p999"] == full["mismatch/token_ratio_p999"]


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_rank_do_not_grow_with_the_batch_or_dp(n):
    _, small = _per_rank_metrics(8, n)
    _, large = _per_rank_metrics(64, n)
    _, dp2 = _per_rank_metrics(64, 2)
    assert small == large == [dp2[0]] * n, (small, large, dp2)
    assert dp2[0] < 300_000  # five 41 KB histograms and a few hundred bytes of sums and extremes
