"""`rollout.mode: async` end to end: real SGLang engine on its own core, real megatron learner, tiny
Qwen3-MoE. The five runs share one process and one SGLang engine (`pooled_runs.py`):

- colocated and async with max_staleness 0, both with the engine pinned to core 1: the same completions
  and every non-timing metric within fp32 round-off (relative 1e-6);
- async with max_staleness 2 for 4 steps: no trained completion is older than 2 versions and the lag
  reaches 2; the lag's own mismatch metrics are reported;
- the same run resumed from its step-2 checkpoint: the queued rounds are drawn again (the same prompts),
  regenerated and counted in `rollout/regenerated`;
- multi-turn trajectories (3 turns, a user's environment) with max_staleness 1: every model token records
  the version that generated it, the lag reaches 1 per token, and no trained token is older than 1.

The schedule's corner cases (k = 1, 2, 3, refills, a stale round) run on a fake engine in
tests/unit/trainer/test_async_rollout.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.pooled_runs import run_pooled
from tests.integration.test_trainer_e2e import records, write_config

STEPS = 4
# Timing and throughput metrics differ between any two runs; the rest must not.
TIMING = ("perf/", "sync/seconds", "sync/gbps")


def samples(run: Path) -> list:
    """Every (prompt, completion) the run scored."""
    out = []
    for f in sorted((run / "samples").glob("*.jsonl")):
        out += [tuple(json.loads(line)) for line in f.read_text().splitlines()]
    return out


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    from megagrpo.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("async")
    model = make_tiny_model(tmp / "model", "qwen3_moe", seed=1)
    common = {
        "rewards__functions": [{"name": "tests.integration.trainer_rewards:recorded_parity", "weight": 1.0}],
        "schedule__eval_every": 0,
        "schedule__save_every": 1,
        "checkpoint__keep_last": 10,
        "algo__tis": {"enabled": True, "cap": 2.0},
        "replay": "R3",
        "rollout__max_total_tokens": 16384,  # one KV size for every run, so the multi-turn run pools too
    }
    runs = {
        "colocated": {"rollout__placement": {"engine_cores": [1]}, "schedule__steps": 3},
        "k0": {"rollout__mode": "async", "rollout__max_staleness": 0, "schedule__steps": 3},
        "k2": {"rollout__mode": "async", "rollout__max_staleness": 2, "schedule__steps": STEPS},
        "k1_turns": {
            "rollout__mode": "async",
            "rollout__max_staleness": 1,
            "schedule__steps": 3,
            "rollout__multi_turn": {
                "enabled": True,
                "environment": "tests.integration.agentic_env:ThreeToolTurns",
                "max_turns": 3,
                "max_tokens": 64,
            },
        },
    }
    paths = {name: write_config(tmp / name, model, **common, **over) for name, over in runs.items()}
    # the k2 run again from its step-2 checkpoint, logging elsewhere
    resumed = yaml.safe_load(paths["k2"].read_text())
    resumed["logging"]["out_dir"] = str(tmp / "k2_resumed" / "run")
    (tmp / "k2_resumed").mkdir()
    paths["k2_resumed"] = tmp / "k2_resumed" / "config.yaml"
    paths["k2_resumed"].write_text(yaml.safe_dump(resumed))
    ckpt2 = tmp / "k2" / "ckpt" / "step_00000002"
    args = [str(paths[n]) for n in ("colocated", "k0", "k2")] + [f"{paths['k2_resumed']}:{ckpt2}"]
    args.append(str(paths["k1_turns"]))
    res = run_pooled(*args)
    assert res.returncode == 0, res.stderr[-4000:]
    return {name: p.parent for name, p in paths.items()}


def test_max_staleness_0_repeats_colocated_mode(async_runs):
    colo, k0 = async_runs["colocated"], async_runs["k0"]
    # the reward functions run on worker threads, so the recording order varies: compare as multisets
    assert samples(colo) and sorted(samples(colo)) == sorted(samples(k0))
    a, b = records(colo / "run"), records(k0 / "run")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    not_bit_equal = set()
    for ra, rb in zip(a, b, strict=True):
        extra = set(rb) - set(ra)
        # async adds the mismatch by lag (all lag 0 here); colocated mode has nothing async lacks but
        # the time of its memory swap (perf/sleep_seconds)
        assert {k for k in ra if not k.startswith(TIMING)} <= set(rb)
        assert all(k.startswith("mismatch/lag_0/") for k in extra), extra
        assert rb["mismatch/lag_0/n_tokens"] == ra["mismatch/n_tokens"]
        for key, va in ra.items():
            if key.startswith(TIMING) or not isinstance(va, float):
                continue
            assert rb[key] == pytest.approx(va, rel=1e-6, abs=1e-12), key
            if rb[key] != va:
                not_bit_equal.add(key)
        assert rb["rollout/staleness_max"] == 0.0
    # The learner pins the same cores in both runs and the engine starts alike, so the whole step is
    # bit-equal; a difference here would have to be explained by a change of order in the step.
    assert not_bit_equal == set(), sorted(not_bit_equal)


def test_no_trained_sample_is_older_than_k(async_runs):
    recs = records(async_runs["k2"] / "run")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert r["rollout/staleness_max"] <= 2
        assert r["rollout/dropped_stale"] == 0 and r["rollout/regenerated"] == 0
        fracs = [r[f"rollout/lag_{d}_frac"] for d in range(3)]
        assert sum(fracs) == pytest.approx(1.0)
        # the mismatch of each lag covers exactly that lag's tokens
        assert sum(r[f"mismatch/lag_{d}/n_tokens"] for d in range(3)) == r["mismatch/n_tokens"]
    # step n's first round comes from version max(0, n - 2): the pipeline fills, then the lag is 2
    assert recs[0]["rollout/staleness_max"] == 0
    assert recs[1]["rollout/staleness_max"] == 1
    assert recs[2]["rollout/staleness_max"] == 2 and recs[3]["rollout/staleness_max"] == 2
    assert recs[3]["mismatch/lag_2/n_tokens"] > 0
    for r in recs:
        assert r["perf/learner_idle_seconds"] >= 0 and r["perf/sampler_idle_seconds"] >= 0


def test_resume_regenerates_the_queued_rounds_and_counts_them(async_runs):
    whole = records(async_runs["k2"] / "run")
    resumed = records(async_runs["k2_resumed"] / "run")
    assert [r["step"] for r in resumed] == [3, 4]
    cfg = yaml.safe_load((async_runs["k2"] / "config.yaml").read_text())
    r = cfg["rollout"]
    import math

    first_round = math.ceil(r["prompts_per_step"] * 1.25) * r["group_size"]  # the schema's oversample
    # the checkpoint after step 2 held steps 3 and 4's first rounds: both are generated again
    assert resumed[0]["rollout/regenerated"] == 2 * first_round
    assert resumed[1]["rollout/regenerated"] == 0
    assert resumed[0]["rollout/staleness_max"] == 0  # regenerated with the checkpoint's weights
    assert resumed[1]["rollout/staleness_max"] <= 2
    # nothing lost: the resumed run samples the same prompts the uninterrupted run sampled at those steps
    before = {p for p, _ in samples(async_runs["k2"])}
    after = {p for p, _ in samples(async_runs["k2_resumed"])}
    assert after <= before
    assert whole[2]["step"] == 3


def test_multi_turn_trajectories_carry_per_token_versions_within_the_bound(async_runs):
    recs = records(async_runs["k1_turns"] / "run")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["rollout/turns_mean"] == 3.0 and r["rollout/staleness_max"] <= 1
        # per token: every trained model token is at lag 0 or 1, and none was masked as older
        assert r["rollout/stale_tokens_masked"] == 0
        assert r["mismatch/lag_0/n_tokens"] + r["mismatch/lag_1/n_tokens"] == r["mismatch/n_tokens"]
        assert sum(r[f"mismatch/turn_{k}/n_tokens"] for k in range(3)) == r["mismatch/n_tokens"]
    assert recs[0]["mismatch/lag_1/n_tokens"] == 0 and recs[2]["mismatch/lag_1/n_tokens"] > 0
