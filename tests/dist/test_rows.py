"""Issue 14, the sharded data plane: each rank receives exactly the rows its DP rank trains on, intact,
from whichever engine sampled them; TP peers receive the same rows; per-rank bytes fall as 1/DP (one
4-process launch over three meshes and two engine counts, no model)."""

from __future__ import annotations

import json

import pytest

from tests.dist._harness import launch

WORLD = 4
MESHES = {1: "dp4", 2: "dp2", 4: "dp1"}  # tp -> key prefix


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("rows")
    launch("tests.dist.workers_rows:main", WORLD, out, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("engines", [1, 2])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_rank_receives_exactly_its_dp_ranks_rows(results, dp, engines):
    key = f"dp{dp}_e{engines}"
    by_dp: dict[int, list[int]] = {}
    for rank in range(WORLD):
        r = results[rank][key]
        assert r["local"] == r["plan_local"]
        assert r["got"] == r["want"], f"rank {rank}: a row arrived changed or in the wrong order"
        assert r["texts"] == [""], "decoded text travels to the learner"
        # TP peers of one DP rank hold the same rows
        assert by_dp.setdefault(r["dp_rank"], r["local"]) == r["local"]
    rows = sorted(i for local in by_dp.values() for i in local)
    assert rows == list(range(len(results[0][key]["seq_lens"]))), "a row is missing or trained twice"
    assert len(by_dp) == dp


def test_the_number_of_engines_changes_no_rank_s_rows(results):
    for rank in range(WORLD):
        for dp in (1, 2, 4):
            one, two = results[rank][f"dp{dp}_e1"], results[rank][f"dp{dp}_e2"]
            assert (one["local"], one["got"]) == (two["local"], two["got"])


def test_per_rank_bytes_fall_with_the_data_parallel_size(results):
    """The acceptance bound: with DP=2 no rank receives more than 55% of what it receives with DP=1."""
    for engines in (1, 2):
        most = {dp: max(results[r][f"dp{dp}_e{engines}"]["bytes"] for r in range(WORLD)) for dp in (1, 2, 4)}
        assert most[1] > 0
        assert most[2] <= 0.55 * most[1], most
        assert most[4] <= 0.30 * most[1], most
