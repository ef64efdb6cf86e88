"""Issue 14, data-parallel rollout: the number of engines changes neither the batch nor the decisions of
dynamic sampling, and each round's prompts are sampled exactly once, split over the engines (one
4-process launch, no SGLang: tests/integration/test_slurm.py runs real engines)."""

from __future__ import annotations

import json

import pytest

from tests.dist._harness import launch

WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout_groups")
    launch("tests.dist.workers_rollout_groups:main", WORLD, out, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_engine_count_gives_the_same_batch(results):
    ref = results[0]["1"]
    assert len(ref["kept_prompts"]) >= 4 and ref["rounds"] > 1  # refills happened
    for n in range(1, WORLD + 1):
        for rank in range(WORLD):
            r = results[rank][str(n)]
            assert r["rewards"] == ref["rewards"], f"{n} engines, rank {rank}"
            assert r["kept_prompts"] == ref["kept_prompts"], f"{n} engines, rank {rank}"
            assert (r["rounds"], r["dropped"]) == (ref["rounds"], ref["dropped"])


def test_owners_are_evenly_spaced_and_share_each_round(results):
    for n in range(1, WORLD + 1):
        owners = [rank for rank in range(WORLD) if results[rank][str(n)]["engine"] is not None]
        assert owners == [e * WORLD // n for e in range(n)]
        rounds = results[0][str(n)]["rounds"]
        for k in range(rounds):
            shares = [results[rank][str(n)]["generated"][k] for rank in range(WORLD)]
            assert all(not shares[rank] for rank in range(WORLD) if rank not in owners)
            merged = [v for rank in owners for v in shares[rank]]
            assert merged == results[0]["1"]["generated"][k], f"{n} engines, round {k}"


def test_each_owner_keeps_only_the_groups_it_sampled(results):
    for n in range(2, WORLD + 1):
        mine = [v for rank in range(WORLD) for v in results[rank][str(n)]["mine"]]
        assert sorted(mine) == sorted(results[0]["1"]["kept_prompts"])
        for rank in range(WORLD):
            r = results[rank][str(n)]
            assert [r["kept_prompts"][p] for p in r["positions"]] == r["mine"]
