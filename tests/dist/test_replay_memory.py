"""Issue 14: a rank's replay tables are sized by one micro-batch on that rank, never by the batch.

Two launches run the trainer's replay path (data-plane plan, old pass in the plan's micro-batches, R2
training steps with RSPO weights; tests/dist/workers_replay_memory.py) on equal-length rows with 2 rows per
micro-batch: one process (DP1) and two processes (DP2, and DP1 x TP2 with sequence parallelism).
"""

from __future__ import annotations

import json

import pytest

from tests.dist._harness import launch

CLEAN = {"moe/replay_unconsumed": 0.0, "moe/replay_reused": 0.0, "moe/replay_fallback_tokens": 0.0}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world, cases in ((1, [["dp", 8], ["dp", 16]]), (2, [["dp", 16], ["dp", 32], ["tp2_sp", 16]])):
        d = tmp_path_factory.mktemp(f"replay_memory{world}")
        launch("tests.dist.workers_replay_memory:main", world, d, timeout=900, cases=cases)
        out[world] = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
    return out


def test_replay_tables_do_not_grow_with_the_batch_or_dp(results):
    dp1 = results[1][0]
    base = dp1["dp_b8"]["peak"]
    assert base > 0
    # twice the rows at the same micro-batch size: the same per-micro-batch tables
    assert dp1["dp_b16"]["peak"] == base
    for rank in results[2]:
        # DP2 (each rank trains half the rows) and a batch 4x larger: still one micro-batch's tables
        assert rank["dp_b16"]["peak"] == base and rank["dp_b32"]["peak"] == base
        # a sequence-parallel rank's routers see half of each micro-batch's tokens
        assert rank["tp2_sp_b16"]["peak"] < 0.6 * base


def test_the_old_pass_store_holds_only_what_this_rank_routed(results):
    dp1 = results[1][0]
    assert dp1["dp_b16"]["store"] == 2 * dp1["dp_b8"]["store"]  # per row
    for rank in results[2]:
        assert rank["dp_b16"]["local_rows"] == 8
        assert rank["dp_b16"]["store"] == dp1["dp_b8"]["store"]  # 1/DP of the rows
        assert rank["tp2_sp_b16"]["store"] == dp1["dp_b8"]["store"]  # half of 16 rows' tokens


def test_replay_along_the_trainer_path_is_clean(results):
    for world in (1, 2):
        for rank in results[world]:
            for case, r in rank.items():
                m = r["metrics"]
                assert {k: m[k] for k in CLEAN} == CLEAN, case
                # unchanged weights between the old pass and the first mini-batch: R2 replays exactly
                assert m["moe/agreement_old_current_first"] == 1.0, case
                assert 0.9 < m["moe/load_entropy"] <= 1.0, case
