"""`rollout.placement.kind: disaggregated` end to end on the CPU: learner ranks and engine ranks in one
`megagrpo train --nproc` launch, tiny Qwen3-MoE (DeepSeek-V3's family with its MTP layer for the
pipeline-stage run), real SGLang HTTP servers, weights over gloo.

- the shipped configs/disaggregated_qwen3_moe.yaml (async, max_staleness 1, GSPO, R3, TIS auto) at tiny
  sizes: 2 learners (DP2) + 1 engine rank, the engine's weights checked against the learner's export bit
  for bit after every sync; its SGLang scheduler killed mid-run: the run ends within the engine deadline
  with an error naming the engine, and resumes from its last checkpoint;
The equivalence with colocated mode (max_staleness 0, 2 engine ranks against 1 colocated engine) and the
preemption of a 2-node job (one learner node, one rollout node) run in test_slurm.py, whose local
disaggregated run is that job's uninterrupted reference.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.fixtures.doc_commands import commands
from tests.integration.run_metrics import last_record_per_step
from tests.integration.test_option_matrix import data_overrides, reward_override, size_overrides
from tests.integration.test_trainer_e2e import MEGAGRPO, REPO, cli

DEADLINE_S = 60  # rollout.placement.engine_timeout_s of the fault run
SHIPPED = REPO / "configs" / "disaggregated_qwen3_moe.yaml"


def common(model: Path) -> dict:
    return {
        "rewards__functions": [{"name": "tests.integration.trainer_rewards:recorded_parity", "weight": 1.0}],
        "schedule__eval_every": 0,
        "algo__tis": {"enabled": True, "cap": 2.0},
        "replay": "R3",
        "rollout__max_total_tokens": 16384,
    }


def _wait_for(pred, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}: rc {proc.returncode}\n{log.read_text()[-4000:]}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} within {timeout} s\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _scheduler(pid: int) -> psutil.Process:
    """The engine rank's SGLang scheduler (SGLang titles it `sglang::scheduler...`)."""
    procs = [p for p in psutil.Process(pid).children(recursive=True) if _titled(p, "sglang::scheduler")]
    assert len(procs) == 1, [p.cmdline() for p in psutil.Process(pid).children(recursive=True)]
    return procs[0]


def _titled(p: psutil.Process, title: str) -> bool:
    try:
        return any(title in part for part in p.cmdline())
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """The shipped disaggregated config (tiny sizes, one engine) killed mid-step, then resumed from its last
    checkpoint to two more steps: the path a user runs, `megagrpo train CONFIG --nproc`."""
    from megagrpo.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("disagg")
    model = make_tiny_model(tmp / "model", "qwen3_moe", seed=1)
    shipped = yaml.safe_load(SHIPPED.read_text())
    overrides = [
        *size_overrides(tmp, model),
        *data_overrides(shipped, tmp),
        reward_override(shipped),
        "rollout.num_engines=1",  # 2 learners (DP2) + 1 engine rank
        f"rollout.placement.engine_timeout_s={DEADLINE_S}",
        "sync.checksum=true",
        "schedule.save_every=1",
        "checkpoint.keep_last=3",
        "logging.console=true",
    ]
    ckpt = tmp / "ckpt"
    log = tmp / "killed.log"
    # README's `megagrpo train CONFIG --nproc 3 rollout.placement.kind=disaggregated`, through the clone's
    # console script (tests/fixtures/doc_commands.py)
    (doc,) = commands("train --nproc disaggregated")
    train = [str(MEGAGRPO), *doc.argv({"CONFIG": SHIPPED})[1:], *overrides]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*train, "schedule.steps=200"],
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
    try:  # 200 steps is far more than it reaches: the engine dies first
        _wait_for(
            lambda: (ckpt / "step_00000002" / "meta.json").exists(), 600, "step-2 checkpoint", proc, log
        )
        _scheduler(proc.pid).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=DEADLINE_S + 60)
        ended_after = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
    reached = max(int(p.name.split("_")[1]) for p in ckpt.glob("step_*") if (p / "meta.json").exists())
    resumed = cli(*train[1:], f"schedule.steps={reached + 2}", "--resume", "auto")
    return {
        "killed": (proc.returncode, ended_after, log.read_text()),
        "reached": reached,
        "resumed": resumed,
        "run": tmp / "run",
    }


def test_a_killed_engine_ends_the_run_with_its_name_within_the_deadline(fault_runs):
    code, ended_after, out = fault_runs["killed"]
    assert code != 0, out[-3000:]
    assert ended_after < DEADLINE_S, (ended_after, out[-3000:])
    assert "engine 0" in out and "resume from the last checkpoint" in out, out[-3000:]


def test_async_disaggregated_resumes_trains_and_every_sync_is_bit_exact(fault_runs):
    res, reached = fault_runs["resumed"], fault_runs["reached"]
    assert res.returncode == 0, res.stderr[-4000:] + res.stdout[-2000:]
    out = res.stdout + res.stderr
    assert "weights group megagrpo-weights-0 over gloo, 2 ranks" in out
    steps = last_record_per_step(fault_runs["run"])
    assert sorted(steps) == list(range(1, reached + 3))  # the killed run's steps, then the resumed two
    for step, rec in steps.items():
        # the engine's parameters hash like the learner's export after every sync, before and after the kill
        assert rec["sync/checksum_ok"] == 1.0, step
        assert rec["rollout/staleness_max"] <= 1 and rec["rollout/dropped_stale"] == 0
    assert any(rec["rollout/lag_1_frac"] > 0 for rec in steps.values())  # one-step-off reached
    assert steps[reached + 2]["rollout/regenerated"] == 0


def test_pipeline_stages_send_their_own_weights_bit_exact(tmp_path):
    """PP 2 learners + 1 engine rank: each pipeline stage feeds the engine over a weights group of its own
    (no stage's tensors pass through the owner), and after every sync the engine's parameters hash like the
    stages' exports together. The stages are uneven (issue 37 section 4): 3 layers, 1 on the first stage
    (mesh.first_stage_layers) and 2 on the last, through `megagrpo train`. The model is DeepSeek-V3's
    family as it ships (issue 43): MLA with a q latent, whose q_a/kv_a pair SGLang fuses at load, sent in
    1 MiB buckets over the broadcast, and a multi-token-prediction layer that the sync neither sends nor
    expects."""
    from megagrpo.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "deepseek_v3", seed=1, layers=3, mtp_layers=1)
    shipped = yaml.safe_load(SHIPPED.read_text())
    res = cli(
        "train", str(SHIPPED),
        *size_overrides(tmp_path, model), *data_overrides(shipped, tmp_path), reward_override(shipped),
        "rollout.num_engines=1", "mesh.pp=2", "mesh.first_stage_layers=1", "mesh.ep=1", "sync.checksum=true",
        "sync.bucket_mb=1", "schedule.steps=2",
        "schedule.save_every=0", "--nproc", "3",
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for stage in (0, 1):
        assert f"weights group megagrpo-weights-0-stage{stage} over gloo, 2 ranks" in out, out[-4000:]
    assert "rank 1 sends its pipeline stage's weights: engine 0 stage 1" in out
    steps = last_record_per_step(tmp_path / "run")
    assert sorted(steps) == [1, 2]
    for step, rec in steps.items():
        assert rec["sync/checksum_ok"] == 1.0, step
        assert rec["sync/bytes"] > 0 and rec["loss/grad_norm"] > 0, step
