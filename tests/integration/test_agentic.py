"""`megagrpo train` with `rollout.multi_turn` end to end (issue 26): 3-turn trajectories from a user's
environment (imported by path), R3 on the tiny GLM-4.5 (issue 37: a sigmoid, bias-corrected, group-limited
router with a shared expert and a dense first layer), on 2 learner processes (DP2) with one colocated
engine, and with two disaggregated engine ranks (issue 27: trajectories and evaluation over HTTP), whose
trajectories an external agent drives instead (issue 38): the same conversation written against the real
`openai` client (`agentic_env.openai_agent`), served by the agent endpoint on each engine owner.

* Engine-count, placement and driver invariance hold for trajectories: the built-in driver on one engine and
  the agent endpoint on two sample the same trajectories and log the same metrics (`run_metrics.engine_count_differences`' tolerances, for the reasons given there).
* R3 is exact across turns in the trainer, in both runs: the learner's replayed pass reproduces the
  sampler's logprobs on every model token (mismatch/abs_dp_max) and on those of every turn
  (mismatch/turn_<k>/) at fp32 round-off, and the
  learner's own routing agrees with the sampler's per turn (moe/agreement_rollout_old/turn_<k>).
* The multi-turn metrics reach metrics.jsonl and report.png's data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.run_metrics import engine_count_differences, last_record_per_step
from tests.integration.test_trainer_e2e import cli, write_config

OVER = {
    "schedule__steps": 2,
    "schedule__eval_every": 2,
    "schedule__save_every": 0,
    "replay": "R3",
    "rollout__max_new_tokens": 6,
    "rollout__multi_turn": {
        "enabled": True,
        "environment": "tests.integration.agentic_env:ThreeToolTurns",
        "max_turns": 3,
        "max_tokens": 96,
    },
}
RUNS = {  # name: extra arguments
    "one": ("rollout.num_engines=1", "--nproc", "2"),
    "two": (
        "rollout.num_engines=2",
        "rollout.placement.kind=disaggregated",
        "rollout.multi_turn.agent.function=tests.integration.agentic_env:openai_agent",
        "--nproc",
        "4",
    ),
}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """GLM-4.5's family: Qwen3-MoE's R3 exactness through `megagrpo train` is asserted by test_trainer_e2e's
    full run (single-turn; the per-turn replay bookkeeping this file checks does not depend on the router)."""
    from megagrpo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "m", "glm4_moe", seed=1)


def _sampled(record_dir: Path) -> list:
    return sorted(
        json.dumps(json.loads(line))
        for f in record_dir.glob("*.jsonl")
        for line in f.read_text().splitlines()
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, moe_model):
    tmp = tmp_path_factory.mktemp("agentic")
    out = {}
    for name, extra in RUNS.items():
        rec = tmp / name / "sampled"
        rec.mkdir(parents=True)
        cfg = write_config(tmp / name, moe_model, **OVER)
        res = cli("train", str(cfg), *extra, env={"MEGAGRPO_TEST_RECORD_DIR": str(rec)})
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        out[name] = (last_record_per_step(tmp / name / "run"), _sampled(rec), tmp / name)
    return out


@pytest.mark.parametrize("run", sorted(RUNS))
def test_multi_turn_metrics_and_r3_exact_on_every_turn(runs, run):
    m, sampled, _ = runs[run]
    assert sorted(m) == [0, 1, 2]
    for step in (1, 2):
        r = m[step]
        assert r["rollout/turns_mean"] == 3.0 and r["rollout/truncated_max_turns_frac"] == 0.0
        assert 0 < r["rollout/env_token_frac"] < 1 and r["rollout/stale_tokens_masked"] == 0.0
        # no agent session failed, departed or was refused (the endpoint run's; the driver's are 0 too)
        for k in ("branches", "branch_refusals", "agent_bad_requests", "agent_timeouts", "agent_errors"):
            assert r[f"rollout/{k}"] == 0.0, k
        assert r["rollout/rows_per_session"] == 1.0  # so one row per session, as the driver's
        # 1 byte per route entry (int8 holds the tiny model's experts): rows = tokens - 1 per trajectory
        assert r["rollout/route_bytes_per_traj"] > 0
        print(run, step, r["mismatch/abs_dp_max"], r["mismatch/abs_dlogp_mean"])  # with -s
        # per token, every turn (|dp| is small where p is: the log-space mean is the stricter bound)
        assert r["mismatch/abs_dp_max"] <= 1e-5 and r["mismatch/abs_dlogp_mean"] <= 1e-6, r
        for k in range(3):
            assert r[f"mismatch/turn_{k}/n_tokens"] > 0
            assert r[f"mismatch/turn_{k}/abs_dp_mean"] < 1e-5, (k, r[f"mismatch/turn_{k}/abs_dp_mean"])
            # the learner's own routing agrees with the sampler's on every turn (same weights, fp32)
            assert r[f"moe/agreement_rollout_old/turn_{k}"] > 0.9, (
                k,
                r[f"moe/agreement_rollout_old/turn_{k}"],
            )
        assert r["loss/grad_norm"] > 0
    assert "eval/accuracy" in m[2]
    assert len(sampled) >= 2 * 16, "every trajectory of both steps (and the evaluation) is recorded"


def test_one_and_two_engines_sample_the_same_trajectories_and_log_the_same_metrics(runs):
    (ma, sa, _), (mb, sb, dir_b) = runs["one"], runs["two"]
    assert sa == sb, f"{len(set(sa) ^ set(sb))} trajectories differ"
    # both disaggregated engines ran trajectories: the agents run on their owners, learner ranks 0, 1, and
    # the endpoint drove every one of them (the built-in driver none of the first run's)
    assert len(list((dir_b / "sampled").glob("*.jsonl"))) == 2
    agent_sessions = [x for f in (dir_b / "sampled").glob("*.agent") for x in f.read_text().splitlines()]
    assert sorted(json.dumps(json.loads(x)) for x in agent_sessions) == sb
    assert not list((runs["one"][2] / "sampled").glob("*.agent"))
    assert engine_count_differences(ma, mb) == {}
