"""`megagrpo train` end to end: real SGLang engine, real megatron learner, tiny Qwen3-MoE, through the CLI.

The runs are module-scoped and shared by the assertions, because each one starts an engine (tens of
seconds here). `cli` runs the command a user types after `make setup`: this clone's `.venv/bin/megagrpo`
(tools/clone_venv.py), one process starting its own engine, as the files that import it do too (issue 43: that
script killed every single-process engine start, while the tests ran `python -m megagrpo.cli`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.doc_commands import commands
from tests.integration.run_metrics import last_record_per_step, step_differences

REPO = Path(__file__).resolve().parents[2]
MEGAGRPO = REPO / ".venv" / "bin" / "megagrpo"  # the clone's console script, as `make setup` writes it
GROUPS = ("rollout/", "reward/", "adv/", "loss/", "mismatch/", "moe/", "sync/", "perf/", "eval/")


def write_config(tmp: Path, model: Path, **over) -> Path:
    cfg = {
        "model": {"hf_path": str(model), "dtype": "float32"},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8, "max_rounds": 2},
        "algo": {"variant": "gspo", "agg": "seq-mean-token-mean", "tis": {"enabled": True, "cap": "auto"}},
        "replay": "none",
        "data": {
            "synthetic": {
                "task": "addition",
                "min_digits": 1,
                "max_digits": 2,
                "num_train": 200,
                "num_eval": 8,
                "seed": 3,
            }
        },
        "rewards": {
            "functions": [
                {"name": "tests.integration.trainer_rewards:output_parity", "weight": 1.0},
                {"name": "tests.integration.trainer_rewards:always_raises", "weight": 0.5},
            ]
        },
        "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
        "schedule": {"steps": 2, "micro_batch_size": 16, "eval_every": 2, "save_every": 1, "seed": 0},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "logging": {"out_dir": str(tmp / "run"), "tensorboard": True},
    }
    for dotted, value in over.items():
        node = cfg
        *path, leaf = dotted.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = value
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*args: str, timeout: float = 900, env: dict | None = None, **popen) -> subprocess.CompletedProcess:
    """`megagrpo ARGS` as a user runs it: the clone's console script, whose `.pth` puts the clone (and so
    `tests.*` reward functions) on the path; no PYTHONPATH."""
    assert MEGAGRPO.is_file(), f"{MEGAGRPO} is missing: `make setup` writes it"
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(MEGAGRPO), *args],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        **popen,
    )


def start_cli(*args: str, env: dict | None = None, module: str = "megagrpo.cli", **popen) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env, **popen)


def kill_after_first_checkpoint(
    *args: str, ckpt_dir: Path, timeout: float = 900, env: dict | None = None
) -> None:
    """Start `megagrpo <args>` and SIGKILL it, with its engines' processes, once its step-1 checkpoint is
    complete (meta.json is written last). Single-process runs only: torchrun starts each rank in a session
    of its own, which this kill does not reach (a `--nproc` run's ranks would run on)."""
    proc = start_cli(
        *args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # one process group: the kill takes SGLang's scheduler children too
    )
    first = ckpt_dir / "step_00000001" / "meta.json"
    try:
        deadline = time.monotonic() + timeout
        while not first.exists():
            assert proc.poll() is None, f"{args} ended before its first checkpoint"
            assert time.monotonic() < deadline, f"no checkpoint in {timeout:.0f} s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from megagrpo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "m", "qwen3_moe", seed=1)


# One uninterrupted run serves every test that reads a finished run: the metric groups, the console, the
# evaluation of its checkpoint, and the reference that the SIGKILLed-then-resumed run must repeat.
FULL_RUN = {"schedule__steps": 3, "schedule__save_every": 1, "schedule__eval_every": 3, "replay": "R3"}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, moe_model):
    tmp = tmp_path_factory.mktemp("run1")
    res = cli("train", str(write_config(tmp, moe_model, **FULL_RUN)))
    return tmp, res


def test_three_steps_log_every_metric_group(full_run):
    tmp, res = full_run
    assert res.returncode == 0, res.stderr[-3000:]
    recs = records(tmp / "run")
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    keys = set().union(*recs)
    for group in GROUPS:
        assert any(k.startswith(group) for k in keys), f"no {group} metric in {sorted(keys)}"
    # R3 with the sampler in fp32 on Qwen3-MoE's softmax router: the learner's logprobs are the sampler's to
    # fp32 round-off on every token of every step, the steps after a weight sync too
    for r in recs[1:]:
        print("qwen3_moe", r["step"], r["mismatch/abs_dp_max"])  # with -s
        assert r["mismatch/abs_dp_max"] <= 1e-5, (r["step"], r["mismatch/abs_dp_max"])
    assert (tmp / "run" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert list((tmp / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert (
        sorted(p.name for p in (tmp / "ckpt").iterdir() if p.name.startswith("step_"))[-1] == "step_00000003"
    )


def test_a_raising_reward_is_counted_and_never_stops_the_run(full_run):
    tmp, res = full_run
    assert res.returncode == 0
    steps = [r for r in records(tmp / "run") if r["step"] > 0]
    assert all(r["reward/errors"] > 0 for r in steps)
    assert all(r["loss/tokens"] > 0 or r.get("rollout/skipped_step") == 1 for r in steps)
    # each function's mean: the raising one scores 0, so the combined reward (weight 1 on parity) is parity's
    fns = "reward/tests.integration.trainer_rewards:"
    assert all(r[f"{fns}always_raises/mean"] == 0.0 for r in steps)
    assert all(r[f"{fns}output_parity/mean"] == pytest.approx(r["reward/mean"]) for r in steps)


def test_console_shows_the_steps_without_the_known_library_noise(full_run):
    """The default console (megagrpo/console.py): step lines, and none of the known-harmless library
    messages, neither from the CLI process nor from SGLang's spawned children."""
    tmp, res = full_run
    assert res.returncode == 0
    out = res.stdout + res.stderr
    assert re.search(r"^step 3 ", out, re.M), out[-3000:]
    for noise in (
        "Transformer Engine and Apex are not installed",  # megatron-core, warnings
        "GPTModel IS DEPRECATED",  # megatron-core, logging
        "Only CUDA, HIP and XPU support AWQ",  # SGLang, in the parent and in its children
        "Triton is not supported on current platform",  # SGLang's children
    ):
        assert noise not in out, f"{noise!r} is on the console:\n{out[-3000:]}"


def test_eval_of_a_checkpoint_repeats_the_runs_own_evaluation(full_run):
    """`megagrpo eval --resume step_3`, README's command with this run's config and checkpoint, scores the
    held-out set greedily with the step-3 weights: the same numbers the training run logged at step 3,
    written under run/eval/ without touching the run's log."""
    tmp, res = full_run
    assert res.returncode == 0
    before = (tmp / "run" / "metrics.jsonl").read_text()
    (doc,) = commands("eval")
    step_3 = tmp / "ckpt" / "step_00000003"
    ev = cli(*doc.argv({"CONFIG": tmp / "config.yaml", "outputs/demo/checkpoints/step_00000100": step_3})[1:])
    assert ev.returncode == 0, ev.stderr[-3000:]
    (rec,) = records(tmp / "run" / "eval")
    train3 = records(tmp / "run")[-1]
    assert rec["step"] == train3["step"] == 3
    for k in ("eval/accuracy", "eval/reward_mean", "eval/response_len_mean", "eval/prompts"):
        assert rec[k] == train3[k], k
    assert (tmp / "run" / "metrics.jsonl").read_text() == before
    # The checkpoint carries the HF config and tokenizer, so it converts to a complete HF model.
    ckpt = tmp / "ckpt" / "step_00000003"
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()


def test_sft_stage_learns_and_writes_an_hf_model_the_rl_stage_can_start_from(tmp_path, moe_model):
    """`megagrpo sft`: REINFORCE with advantage 1 (token NLL) on prompt + answer pairs, then an HF export."""
    sft_data = {
        "synthetic": {"task": "addition", "min_digits": 1, "max_digits": 1, "num_train": 64, "num_eval": 8}
    }
    cfg = write_config(
        tmp_path,
        moe_model,
        model__hf_path=str(tmp_path / "sft_model"),
        sft={
            "base_path": str(moe_model),
            "output_dir": str(tmp_path / "sft_model"),
            "steps": 4,
            "lr": 3e-3,
            "batch_size": 16,
            "data": sft_data,
        },
    )
    res = cli("sft", str(cfg), "--verbose")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Transformer Engine and Apex are not installed" in res.stderr  # --verbose hides nothing
    recs = records(tmp_path / "run" / "sft")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[-1]["sft/nll"] < recs[0]["sft/nll"]  # the same 64 problems, seen again: the NLL falls
    assert all(r["loss/grad_norm"] > 0 and r["loss/lr"] == pytest.approx(3e-3) for r in recs)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the RL stage's log is its own
    out = tmp_path / "sft_model"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert list(out.glob("*.safetensors"))
    from megagrpo.bridge.hf_config import arch_from_hf

    assert arch_from_hf(out) == arch_from_hf(moe_model)


def test_sigterm_checkpoints_and_exits_for_requeue(tmp_path, moe_model):
    """Issue 25, item 1: SIGTERM while the first engine request is in flight (the step-0 evaluation; SGLang
    arms its own drain-and-exit(0) at its first request) must end in a checkpoint and exit 75, with the
    requeue marker that the sbatch script maps to `scontrol requeue` (tests/integration/test_slurm.py runs
    the requeue itself). The signal is sent by the process itself at the request's first output."""
    cfg = write_config(
        tmp_path, moe_model, schedule__steps=200, schedule__save_every=0, schedule__eval_every=2
    )
    marker = tmp_path / "job.requeue"
    proc = start_cli(
        "train",
        str(cfg),
        module="tests.integration.sigterm_in_generate",
        env={"MEGAGRPO_REQUEUE_MARKER": str(marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "SIGTERM during the first engine request" in out, out[-3000:]
    assert proc.returncode == 75, out[-3000:]
    assert "SIGTERM: saved" in out and marker.is_file()
    assert [r["step"] for r in records(tmp_path / "run")] == [0]  # the evaluation, then the stop
    assert (tmp_path / "ckpt" / "step_00000000" / "meta.json").is_file()


def test_sigkill_then_resume_repeats_the_uninterrupted_run(tmp_path, moe_model, full_run):
    """A (the module's full run) runs 3 steps through. B, the same config, is SIGKILLed (with its engine's
    processes) once its step-1 checkpoint is complete, then resumed with `--resume auto`: every step's
    metrics must equal A's exactly."""
    run_a, res_a = full_run
    assert res_a.returncode == 0, res_a.stderr[-3000:]
    cfg_b = write_config(tmp_path / "b", moe_model, **FULL_RUN)

    kill_after_first_checkpoint("train", str(cfg_b), ckpt_dir=tmp_path / "b" / "ckpt")
    killed_after = max(r["step"] for r in records(tmp_path / "b" / "run"))
    assert killed_after < 3, "B finished before the kill: nothing was resumed"

    res_b = cli("train", str(cfg_b), "--resume", "auto")
    assert res_b.returncode == 0, res_b.stderr[-3000:]
    assert re.search(r"resumed from \S+ at step [12]\b", res_b.stdout), res_b.stdout[-2000:]
    ma, mb = last_record_per_step(run_a / "run"), last_record_per_step(tmp_path / "b" / "run")
    assert sorted(ma) == sorted(mb) == [0, 1, 2, 3]
    assert any(ma[s]["loss/grad_norm"] > 0 for s in (1, 2, 3)), "no step moved the policy: vacuous comparison"
    assert "moe/load_drift" in mb[3] and "mismatch/tis_cap" in mb[3]  # restored tracker and adaptive cap
    assert step_differences(ma, mb, [0, 1, 2, 3]) == {}


def test_bad_config_fails_fast_without_traceback(tmp_path, moe_model):
    for over, expected in (
        ({"algo__variant": "ppo"}, "algo.variant: 'ppo' is not one of"),
        ({"rollout__group_size": 1}, "group_size"),
    ):
        res = cli("train", str(write_config(tmp_path, moe_model, **over)), timeout=120)
        assert res.returncode == 2, res.stderr[-2000:]
        assert "Traceback" not in res.stderr and expected in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing started: validation comes before any process group


TWO_PROCESS_RUN = {"schedule__steps": 2, "schedule__eval_every": 2, "schedule__save_every": 2, "replay": "R3"}
# Async sampling (k = 1) on README's `megagrpo train CONFIG --nproc 2 mesh.ep=2`: run by test_install.py
ASYNC_K1 = ("rollout.mode=async", "rollout.max_staleness=1")


def check_two_process_run(tmp: Path, is_async: bool) -> None:
    """What a 2-rank run of TWO_PROCESS_RUN must log: 3 records with every metric group, the learner routing
    as the sampler did under R3 with no replay fallback, a sync and a checkpoint; an async run (k = 1)
    trains step 2 on the round generated during step 1."""
    recs = records(tmp / "run")
    assert [r["step"] for r in recs] == [0, 1, 2]
    keys = set().union(*recs)
    for group in GROUPS:
        assert any(k.startswith(group) for k in keys), f"no {group} metric in {sorted(keys)}"
    rec = recs[1]
    assert rec["loss/tokens"] > 0
    assert rec["moe/agreement_rollout_old"] > 0.99  # same weights: the learner routes as the sampler did
    assert rec["moe/replay_fallback_tokens"] == 0 and rec["moe/replay_unconsumed"] == 0
    assert rec["sync/bytes"] > 0
    assert (tmp / "ckpt" / "step_00000002" / "meta.json").is_file()
    # async: step 1 samples now (lag 0), step 2 trains on the round generated during step 1 (lag 1)
    lags = [r["rollout/staleness_max"] for r in recs[1:]]
    assert lags == ([0.0, 1.0] if is_async else [0.0, 0.0])


def test_two_processes_pipeline_parallel(tmp_path, moe_model):
    """The same loop on a PP2 mesh (torchrun, 2 ranks): rank 0 samples, both ranks train and export, and
    each stage receives and replays (R3) only its own MoE layers' routes. The EP2 mesh with async sampling
    runs the same checks from the installed wheel (test_install.py)."""
    cfg = write_config(tmp_path, moe_model, **TWO_PROCESS_RUN)
    res = cli("train", str(cfg), "mesh.pp=2", "--nproc", "2")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    check_two_process_run(tmp_path, is_async=False)


# Each family on two processes (issue 37, part 4: DP2 and one model-parallel mesh), in the launch each
# family already had: DeepSeek-V3 data-parallel, GLM-4.5 expert-parallel (each rank holds 4 of the 8 routed
# experts; the shared expert and the dense first layer are replicated).
FAMILY_MESHES = {"deepseek_v3": (), "glm4_moe": ("mesh.ep=2",)}


@pytest.mark.parametrize("family", sorted(FAMILY_MESHES))
def test_the_families_train_with_gspo_r3_and_tis(tmp_path, family):
    """`megagrpo train` on DeepSeek-V3 (MLA as Moonlight ships it, without a q latent, with DeepSeek-V3's
    YaRN; the q latent and plain rope are served against transformers by test_sglang_engine's family engine) on DP2 and GLM-4.5
    on EP2, GSPO + R3 + TIS with the sampler in fp32 (issue 37, part 4): every step's learner logprobs equal
    the sampler's to fp32 round-off, also after a weight sync (MLA, shared experts, dense layer, correction
    bias; under EP2 gathered from both ranks), the learner routes as the sampler did, nothing falls back."""
    from megagrpo.tiny_model import make_tiny_model

    # q_lora_rank 0 writes Moonlight's null q latent (deepseek_v3 only; GLM-4.5 has none)
    model = make_tiny_model(
        tmp_path / "model", family, seed=1, **({"q_lora_rank": 0} if family == "deepseek_v3" else {})
    )
    cfg = write_config(
        tmp_path, model, **{**TWO_PROCESS_RUN, "schedule__save_every": 0, "schedule__eval_every": 0}
    )
    res = cli("train", str(cfg), *FAMILY_MESHES[family], "--nproc", "2")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    recs = [r for r in records(tmp_path / "run") if "mismatch/abs_dp_max" in r]
    assert [r["step"] for r in recs] == [1, 2]  # step 2 samples with the weights synced after step 1
    for rec in recs:
        print(family, rec["step"], rec["mismatch/abs_dp_max"], rec["mismatch/abs_dlogp_mean"])  # with -s
        assert rec["sync/bytes"] > 0 or rec["step"] == 1
        assert rec["mismatch/abs_dp_max"] <= 1e-5 and rec["mismatch/abs_dlogp_mean"] <= 1e-6, rec
        assert rec["moe/agreement_rollout_old"] > 0.99 and rec["moe/replay_fallback_tokens"] == 0
