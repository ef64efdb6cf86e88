"""Issue 10 against a real Slurm (slurm-wlm 22.05): slurmctld and two slurmd ("n1", "n2") on this machine,
started and stopped (by PID) by the module fixture; see tests/integration/slurm_cluster.py.

* `megagrpo submit --dry-run` renders scripts that `sbatch --test-only` accepts (every layout);
* bad input (too many or too few processes for the mesh, a missing partition, GPUs on a CPU partition,
  an unwritable log directory) fails before anything is submitted;
* a real 2-node job of each multi-node layout (srun-only and per-node torchrun) runs the learner's TP2
  logprob check across the two nodes (launch/mesh_check.py via `--stage check`);
* a real `megagrpo train` job on 2 nodes x 2 tasks (DP2 x TP2, one SGLang engine per node, issue 14)
  completes and writes metrics, and a second one, preempted with `scancel --batch --signal=USR1` (what
  `#SBATCH --signal=B:USR1@120` does), checkpoints, requeues itself, resumes, and ends with the same
  metrics and samples as the uninterrupted job;
* the number of engines changes no completion (issue 14; formerly tests/integration/test_engine_count.py):
  a local one-engine run of the same config on 4 processes samples the same completions as the
  uninterrupted two-engine job and logs the same metrics to 1e-6. The jobs above are its two-engine runs,
  and the preempted one its two-engine resume check, so one set of 4-process launches serves both files'
  assertions;
* disaggregated placement (issue 27): a 2-node job whose n1 learns and n2 runs the two SGLang engines,
  preempted and resumed, ends with the metrics and samples of the uninterrupted local run of the same
  layout; and that local run (max_staleness 0) samples and logs what colocated mode with one engine does;
* the mesh check under `srun --mpi=pmix -n 2` with mpi4py bootstrap.

Only the requeue hold is shortened: Slurm keeps a requeued job pending for ~120 s (Reason=BeginTime);
the test sets its StartTime to now once the old instance's credential revocation is behind it
(`SlurmCluster.release_requeued`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megagrpo.cli import main as cli_main
from tests.integration.run_metrics import (
    engine_count_differences,
    last_record_per_step,
    step_differences,
)
from tests.integration.slurm_cluster import (
    NODES,
    PARTITION,
    SlurmCluster,
    ensure_mpi4py,
    ensure_packages,
)
from tests.integration.test_trainer_e2e import FULL_RUN, cli, write_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "demo_qwen3_moe.yaml")
JOB_TIMEOUT = 900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    why = ensure_packages(root / "apt.log")
    if why:
        print(f"\n!!! Slurm integration tests SKIPPED: {why}", file=sys.stderr)
        pytest.skip(f"!!! Slurm integration tests cannot run: {why}")
    c = SlurmCluster(root / "cluster")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)  # the in-process `megagrpo submit` calls sinfo/sbatch
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        alive = [n for n, p in c.procs.items() if p.poll() is None]
        assert not alive, f"Slurm daemons outlived the fixture: {alive}"


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3_moe", experts=8, topk=2)


def overrides(model: Path, out: Path, **extra: object) -> list[str]:
    """A small, deterministic GRPO run on the tiny model (3 steps, a checkpoint after every step), with a
    reward that the random model earns on about half its completions, so every step updates the policy."""
    kv = {
        "model.hf_path": model,
        "logging.out_dir": out / "run",
        "checkpoint.dir": out / "ckpt",
        "checkpoint.resume": "never",
        "logging.tensorboard": "false",
        "data.synthetic.num_train": 64,
        "data.synthetic.num_eval": 8,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "schedule.micro_batch_size": 16,
        "schedule.steps": 3,
        "schedule.eval_every": 0,
        "schedule.save_every": 1,
        "algo.dynamic_sampling": "false",
        "rewards.functions": "[{name: 'tests.integration.slurm_cluster.parity_reward'}]",
        "replay": "none",
        **extra,
    }
    return [f"{k}={v}" for k, v in kv.items()]


def submit(*args: str) -> tuple[int, str]:
    """Run `megagrpo submit ...` in this process; returns (exit code, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli_main(["submit", *map(str, args)])
    return code, out.getvalue()


def submitted(*args: str) -> tuple[int, Path]:
    code, out = submit(*args)
    assert code == 0, out
    job = int(re.search(r"submitted job (\d+)", out).group(1))
    log = Path(re.search(r"log:\s+(\S+)", out).group(1))
    return job, log


def tail(path: Path, n: int = 60) -> str:
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-n:])
        if path.exists()
        else f"({path} missing)"
    )


# -- rendering and bad input (no job runs) ---------------------------------------------------------


@pytest.mark.parametrize("layout,nodes,procs", [("single", 1, 2), ("torchrun", 2, 2), ("srun", 2, 2)])
def test_dry_run_renders_a_script_sbatch_accepts(cluster, model_dir, tmp_path, layout, nodes, procs):
    before = cluster.job_ids()
    code, out = submit(
        CONFIG,
        *overrides(model_dir, tmp_path, **{"mesh.ep": 2, "rollout.prompts_per_step": 16}),
        "--nodes",
        nodes,
        "--gpus-per-node",
        procs,
        "--layout",
        layout,
        "--partition",
        PARTITION,
        "--time",
        "00:10:00",
        "--dry-run",
    )
    assert code == 0, out
    assert "#!/bin/bash" in out and f"#SBATCH --nodes={nodes}" in out and "--gres" not in out  # CPU mode
    assert "#SBATCH --partition=debug" in out and "#SBATCH --time=00:10:00" in out
    script = next((tmp_path / "run" / "slurm").glob("*.sbatch"))
    r = cluster.run("sbatch", "--test-only", str(script), check=False)
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr
    assert cluster.job_ids() == before  # nothing was submitted


@pytest.mark.parametrize(
    "case,args,message",
    [
        (
            "more",
            ["--nodes", "2", "--gpus-per-node", "2", "rollout.prompts_per_step=1", "rollout.group_size=2"],
            "more than the mesh can use",
        ),
        (
            "fewer",
            ["--nodes", "1", "--gpus-per-node", "1", "mesh.tp=2", "mesh.sequence_parallel=true"],
            "fewer than",
        ),
        (
            "not dividing",
            ["--nodes", "2", "--gpus-per-node", "2", "mesh.pp=3"],
            "does not divide the world size 4",
        ),
        (
            "partition",
            ["--nodes", "1", "--gpus-per-node", "1", "--partition", "gpu-h100"],
            "no such partition",
        ),
        (
            "too many nodes",
            ["--nodes", "3", "--gpus-per-node", "1", "rollout.prompts_per_step=12"],
            "only 2 node",
        ),
        ("too many cpus", ["--nodes", "1", "--gpus-per-node", "1", "--cpus-per-proc", "8"], "have 2"),
        ("gpus on cpus", ["--nodes", "1", "--gpus-per-node", "1", "--device", "gpu"], "has no GPUs"),
        ("log dir", ["--nodes", "1", "--gpus-per-node", "1", "--log-dir", "FILE/logs"], "--log-dir"),
    ],
)
def test_bad_input_fails_before_submission(cluster, model_dir, tmp_path, case, args, message):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = [a.replace("FILE", str(blocker)) for a in args]
    mesh_over = [a for a in args if "=" in a and not a.startswith("-")]
    flags = [a for a in args if a not in mesh_over]
    before = cluster.job_ids()
    code, out = submit(CONFIG, *overrides(model_dir, tmp_path), *mesh_over, *flags)
    assert code == 2, out
    assert message in out, out
    assert "Traceback" not in out
    assert cluster.job_ids() == before


# -- real jobs -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_node_jobs_agree_with_the_single_process_reference(cluster, model_dir, tmp_path):
    """Both multi-node layouts, submitted together: TP2 across n1 and n2, logprobs vs transformers."""
    jobs = {}
    for layout in ("srun", "torchrun"):
        out = tmp_path / layout
        jobs[layout] = submitted(
            CONFIG,
            *overrides(model_dir, out, **{"mesh.tp": 2, "mesh.sequence_parallel": "true"}),
            "--nodes",
            2,
            "--gpus-per-node",
            1,
            "--layout",
            layout,
            "--stage",
            "check",
            "--job-name",
            f"check-{layout}",
        )
    for layout, (job, log) in jobs.items():
        info = cluster.wait_job(job, JOB_TIMEOUT)
        assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{layout}: {info.state}\n{tail(log)}"
        res = json.loads((log.parent / f"check-{layout}-{job}.check.json").read_text())
        assert res["ok"], res
        assert res["launcher"] == ("srun" if layout == "srun" else "torchrun")
        assert res["world"] == 2 and res["tp"] == 2
        assert {r["host"] for r in res["ranks"]} == set(NODES), res["ranks"]  # one rank on each node
        assert sorted(r["node_rank"] for r in res["ranks"]) == [0, 1]
        assert res["logprob_max_abs_diff"] <= 1e-4 and res["logprob_tokens"] > 50
        assert "MASTER_ADDR=127.0.0.1" in log.read_text()  # n1's NodeAddr, from scontrol


# The train jobs: the seeded 3-step run of test_trainer_e2e (R3, TIS `auto`, evaluation at steps 0 and 3)
# on DP2 x TP2, scored by a reward that records every (prompt, completion) it scores.
TRAIN_RUN = {
    **FULL_RUN,
    "rewards__functions": [{"name": "tests.integration.trainer_rewards:recorded_parity", "weight": 1.0}],
}
DP2_TP2 = ("mesh.tp=2", "mesh.sequence_parallel=true")
# One engine against two: compared with `run_metrics.engine_count_differences` (its tolerances, and why).


def sampled(record_dir: Path) -> set[tuple[str, str]]:
    pairs = set()
    for f in record_dir.glob("*.jsonl"):
        pairs |= {tuple(json.loads(line)) for line in f.read_text().splitlines() if line}
    return pairs


@pytest.fixture(scope="module")
def engine_runs(cluster, model_dir, tmp_path_factory):
    """Three runs of TRAIN_RUN on 4 processes (DP2 x TP2), each with its own record of what it sampled:

    * "one": one engine (rank 0), a local `megagrpo train --nproc 4`;
    * "a": a Slurm job on both nodes (2 tasks per node, `rollout.num_engines=2`: one engine per node, owned
      by ranks 0 and 2, each sampling and scoring half of every round and of the held-out set), uninterrupted;
    * "b": the same job again, which Slurm runs after A (both take every CPU of both nodes), preempted with
      `scancel --batch --signal=USR1` (what `#SBATCH --signal=B:USR1@120` does) after its first step: it
      checkpoints, requeues itself and resumes.

    Returns ({name: run directory}, {name: (job id, log)} for the two Slurm jobs)."""
    tmp = tmp_path_factory.mktemp("engines")
    dirs = {name: tmp / name for name in ("one", "a", "b")}
    cfg = {name: write_config(d, model_dir, **TRAIN_RUN) for name, d in dirs.items()}
    for d in dirs.values():
        (d / "sampled").mkdir()

    res = cli(
        "train", str(cfg["one"]), *DP2_TP2, "--nproc", "4",
        env={"MEGAGRPO_TEST_RECORD_DIR": str(dirs["one"] / "sampled")},
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]

    jobs = {
        name: submitted(
            cfg[name],
            *DP2_TP2,
            "rollout.num_engines=2",
            "--nodes",
            2,
            "--gpus-per-node",
            2,
            "--layout",
            "torchrun",
            "--job-name",
            f"mg-{name}",
            "--env",
            f"MEGAGRPO_TEST_RECORD_DIR={dirs[name] / 'sampled'}",
        )  # fmt: skip
        for name in ("a", "b")
    }
    (job_a, log_a), (job_b, log_b) = jobs["a"], jobs["b"]
    metrics_b = dirs["b"] / "run" / "metrics.jsonl"

    deadline = time.monotonic() + 2 * JOB_TIMEOUT  # B starts when A is done
    while not (metrics_b.exists() and '"step": 1' in metrics_b.read_text()):
        info = cluster.job(job_b)
        assert info.state in ("PENDING", "RUNNING"), (
            f"B ended before its first step: {info.state}\n{tail(log_b)}"
        )
        assert time.monotonic() < deadline, tail(log_b)
        time.sleep(0.5)
    cluster.run("scancel", "--batch", "--signal=USR1", str(job_b))

    # the script asks for a requeue; Slurm holds the job ~120 s, which the test shortens to the moment
    # the old instance's credential revocation can no longer refuse the new one
    cluster.release_requeued(job_b, deadline - time.monotonic())

    info_a = cluster.wait_job(job_a, JOB_TIMEOUT)
    info_b = cluster.wait_job(job_b, JOB_TIMEOUT)
    assert info_a.state == "COMPLETED" and info_a.exit_code == "0:0", tail(log_a)
    assert info_b.state == "COMPLETED" and info_b.exit_code == "0:0", (
        f"{tail(log_b)}\n{cluster.ctld_log_tail()}"
    )
    assert info_a.restarts == 0 and info_b.restarts == 1
    return dirs, jobs


@pytest.mark.slow
def test_train_job_and_preemption_resume_equal_an_uninterrupted_run(engine_runs):
    """Formerly this file's test of the same name, on the run of test_trainer_e2e plus recorded rewards:
    two `megagrpo train` jobs from the same config, each on both nodes (2 tasks per node, DP2 x TP2, one
    engine per node), so Slurm runs them one after the other: A runs through; B gets USR1 after its first
    step, checkpoints, requeues itself and resumes. Both must end with the same metrics and samples. This
    is also the two-engine resume check of the former test_engine_count.py (which SIGKILLed its local
    two-engine run after its step-1 checkpoint and resumed it)."""
    dirs, jobs = engine_runs
    (_, log_a), (_, log_b) = jobs["a"], jobs["b"]
    text_b = log_b.read_text()
    # one engine per node: owners are ranks 0 and 2, the first task of n1 and of n2
    engines = sorted(set(re.findall(r"engine (\d) of 2: rank (\d) on (\S+),", log_a.read_text())))
    assert engines == [("0", "0", NODES[0]), ("1", "2", NODES[1])], tail(log_a)

    # B: signal -> checkpoint at a step boundary -> requeue -> resume from that checkpoint
    assert "got SIGUSR1" in text_b, tail(log_b)
    saved = re.search(r"SIGUSR1: saved (\S+) at step (\d+)", text_b)
    assert saved, tail(log_b)
    stopped_at = int(saved.group(2))
    assert 1 <= stopped_at < 3, "B was not stopped before its last step: nothing was resumed"
    assert "scontrol requeue" in text_b and "restart 1:" in text_b
    assert re.search(rf"resumed from \S+ at step {stopped_at}", text_b), tail(log_b)

    # A wrote metrics for every step, in every group a GRPO step logs
    ma, mb = last_record_per_step(dirs["a"] / "run"), last_record_per_step(dirs["b"] / "run")
    assert sorted(ma) == [0, 1, 2, 3] and sorted(mb) == [0, 1, 2, 3]
    groups = {k.split("/")[0] for k in ma[3]}
    assert {"rollout", "reward", "loss", "perf"} <= groups, sorted(groups)
    assert any(ma[s]["loss/grad_norm"] > 0 for s in ma if s), (
        "no step moved the policy: the comparison is vacuous"
    )
    assert step_differences(ma, mb, (0, 1, 2, 3)) == {}
    assert sampled(dirs["b"] / "sampled") == sampled(dirs["a"] / "sampled")


@pytest.mark.slow
def test_two_engines_sample_the_same_completions_as_one(engine_runs):
    """Formerly test_engine_count.py's test_two_engines_sample_the_same_completions (issue 14): the number of
    engines changes no completion; the two-engine run is Slurm job A."""
    dirs, _ = engine_runs
    one, two = sampled(dirs["one"] / "sampled"), sampled(dirs["a"] / "sampled")
    assert len(one) > 50
    assert one == two, f"{len(one ^ two)} (prompt, completion) pairs differ, e.g. {sorted(one ^ two)[:2]}"
    # both engines sampled: the two-engine run's reward calls ran in two processes
    assert len(list((dirs["a"] / "sampled").glob("*.jsonl"))) >= 2


@pytest.mark.slow
def test_two_engines_log_the_same_metrics_as_one(engine_runs):
    """Formerly test_engine_count.py's test_two_engines_log_the_same_metrics, with R3, TIS `auto` and
    evaluation on; the two-engine run is Slurm job A."""
    dirs, _ = engine_runs
    m1, m2 = last_record_per_step(dirs["one"] / "run"), last_record_per_step(dirs["a"] / "run")
    assert sorted(m1) == sorted(m2) == [0, 1, 2, 3]
    assert any(m1[s]["loss/grad_norm"] > 0 for s in (1, 2, 3)), "no step moved the policy"
    assert "eval/accuracy" in m2[0] and "eval/accuracy" in m2[3] and "mismatch/tis_cap" in m2[3]
    assert engine_count_differences(m1, m2) == {}
    # the comparison is not vacuous: grad norms, rewards and evaluation are real numbers, equal to 1e-6
    assert m1[3]["loss/grad_norm"] > 0 and 0 < m1[1]["reward/mean"] < 1


# Disaggregated placement (issue 27): 2 learner ranks + 2 engine ranks, asynchronous with max_staleness 0.
DISAGG = (
    "rollout.placement.kind=disaggregated",
    "rollout.num_engines=2",
    "rollout.mode=async",
    "rollout.max_staleness=0",
)


def preempt_after_first_step(cluster, job: int, log: Path, metrics: Path) -> None:
    """USR1 to the batch script once the job has logged step 1 (what `#SBATCH --signal=B:USR1@120` does),
    then let Slurm start the requeued job at once."""
    deadline = time.monotonic() + 2 * JOB_TIMEOUT
    while not (metrics.exists() and '"step": 1' in metrics.read_text()):
        info = cluster.job(job)
        assert info.state in ("PENDING", "RUNNING"), f"ended before its first step: {info.state}\n{tail(log)}"
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.5)
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    cluster.release_requeued(job, deadline - time.monotonic())


@pytest.fixture(scope="module")
def disagg_runs(cluster, model_dir, tmp_path_factory):
    """TRAIN_RUN three ways, each recording what it sampled:

    * "colocated": one engine beside the learner, `megagrpo train --nproc 2` (DP2);
    * "local": 2 learner ranks (DP2) + 2 engine ranks, `--nproc 4`;
    * "slurm": the same as "local" as a 2-node Slurm job, n1 learning and n2 serving, preempted with USR1
      after its first step: it checkpoints, requeues itself and resumes with new engine processes."""
    tmp = tmp_path_factory.mktemp("disagg")
    dirs = {name: tmp / name for name in ("colocated", "local", "slurm")}
    cfg = {name: write_config(d, model_dir, **TRAIN_RUN) for name, d in dirs.items()}
    for d in dirs.values():
        (d / "sampled").mkdir()
    for name, extra, nproc in (("colocated", (), "2"), ("local", DISAGG, "4")):
        res = cli(
            "train", str(cfg[name]), *extra, "--nproc", nproc,
            env={"MEGAGRPO_TEST_RECORD_DIR": str(dirs[name] / "sampled")},
        )  # fmt: skip
        assert res.returncode == 0, (name, (res.stdout + res.stderr)[-4000:])
    job, log = submitted(
        cfg["slurm"], *DISAGG,
        "--nodes", 2, "--gpus-per-node", 2, "--layout", "torchrun", "--job-name", "mg-disagg",
        "--env", f"MEGAGRPO_TEST_RECORD_DIR={dirs['slurm'] / 'sampled'}",
    )  # fmt: skip
    preempt_after_first_step(cluster, job, log, dirs["slurm"] / "run" / "metrics.jsonl")
    info = cluster.wait_job(job, JOB_TIMEOUT)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", f"{tail(log)}\n{cluster.ctld_log_tail()}"
    assert info.restarts == 1
    return dirs, log


@pytest.mark.slow
def test_disaggregated_job_on_a_rollout_node_resumes_from_preemption_exactly(disagg_runs):
    """Issue 27: one learner node and one rollout node; the preempted, requeued and resumed job ends with
    the metrics and samples of the uninterrupted local run of the same layout, bit for bit."""
    dirs, log = disagg_runs
    text = log.read_text()
    # the engines run on n2 (ranks 2 and 3), owned by the learner ranks 0 and 1 on n1
    engines = sorted(
        set(re.findall(r"engine (\d) of 2: rank (\d) on (\S+), owned by rank (\d) on (\S+)", text))
    )
    assert engines == [("0", "2", NODES[1], "0", NODES[0]), ("1", "3", NODES[1], "1", NODES[0])], tail(log)
    assert "over gloo, 2 ranks" in text
    saved = re.search(r"SIGUSR1: saved (\S+) at step (\d+)", text)
    assert saved and 1 <= int(saved.group(2)) < 3, tail(log)
    assert re.search(rf"resumed from \S+ at step {saved.group(2)}", text), tail(log)
    local, slurm = last_record_per_step(dirs["local"] / "run"), last_record_per_step(dirs["slurm"] / "run")
    assert sorted(local) == sorted(slurm) == [0, 1, 2, 3]
    assert any(local[s]["loss/grad_norm"] > 0 for s in (1, 2, 3)), "no step moved the policy"
    assert step_differences(local, slurm, (0, 1, 2, 3)) == {}
    assert sampled(dirs["slurm"] / "sampled") == sampled(dirs["local"] / "sampled")


@pytest.mark.slow
def test_two_engine_ranks_at_staleness_0_repeat_one_colocated_engine(disagg_runs):
    """Issue 27's equivalence: max_staleness 0 on 2 engine ranks samples the same completions as colocated
    mode with one engine on the same learner mesh, and logs the same non-timing metrics to fp32 round-off."""
    dirs, _ = disagg_runs
    colo, local = sampled(dirs["colocated"] / "sampled"), sampled(dirs["local"] / "sampled")
    assert len(colo) > 50 and colo == local
    a, b = last_record_per_step(dirs["colocated"] / "run"), last_record_per_step(dirs["local"] / "run")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    # async adds the mismatch by lag (all lag 0) and its queue's figures; colocated its memory swap
    assert all(set(a[s]) - set(b[s]) <= {"perf/sleep_seconds"} for s in a), [set(a[s]) - set(b[s]) for s in a]
    shared_a = {s: {k: v for k, v in a[s].items() if k in b[s]} for s in a}
    shared_b = {s: {k: v for k, v in b[s].items() if k in a[s]} for s in b}
    assert engine_count_differences(shared_a, shared_b) == {}
    assert all(b[s]["mismatch/lag_0/n_tokens"] == a[s]["mismatch/n_tokens"] for s in (1, 2, 3))
    assert "eval/accuracy" in b[0] and "eval/accuracy" in b[3]


@pytest.mark.slow
def test_mesh_check_under_srun_mpi_pmix_with_mpi4py(cluster, tmp_path):
    why = ensure_mpi4py()
    if why:
        print(f"\n!!! srun --mpi=pmix test SKIPPED: {why}", file=sys.stderr)
        pytest.skip(f"!!! mpi4py unavailable: {why}")
    out = tmp_path / "pmix.json"
    # one node: two slurmd on one host share /tmp/spmix_appdir_*, so a 2-node pmix step collides here
    cmd = ["srun", "--mpi=pmix", "-N", "1", "-n", "2", sys.executable, str(REPO / "launch" / "mesh_check.py")]
    env = {**cluster.env, "MEGAGRPO_BOOTSTRAP": "mpi4py", "PYTHONPATH": str(REPO)}
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    r = subprocess.run(
        [*cmd, "--out", str(out), "--tp", "2"], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["launcher"] == "mpi4py" and res["world"] == 2, res
    assert [r["rank"] for r in res["ranks"]] == [0, 1] and [r["local_rank"] for r in res["ranks"]] == [0, 1]
