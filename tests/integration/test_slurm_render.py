"""Issue 10 without daemons: template rendering, slurm/lib.sh's signal and requeue logic (with a stand-in
`scontrol`), the stop-file watcher, and the launcher variables -> rank path (`DistEnv.from_environ`).

These run in seconds; tests/integration/test_slurm.py runs the same pieces against a real Slurm.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.launch.bootstrap import mark_requeue, watch_stop_file
from megagrpo.learner.mesh import DistEnv
from megagrpo.submit.render import LAYOUTS, TEMPLATE_DIR, render, render_layout

REPO = Path(__file__).resolve().parents[2]


def values(**over: str) -> dict[str, str]:
    v = dict(
        job_name="mg-test",
        nodes="2",
        procs_per_node="4",
        cpus_per_proc="1",
        cpus_per_node="4",
        log_dir="/tmp/mg-logs",
        signal_seconds="120",
        sbatch_lines="#SBATCH --partition=debug\n#SBATCH --gres=gpu:4",
        env_lines="export NCCL_SOCKET_IFNAME=ib0",
        workdir="/work/repo",
        venv="/work/repo/.venv",
        python="/work/repo/.venv/bin/python",
        device="gpu",
        stage="train",
        program="-m megagrpo.launch.run train /tmp/mg-logs/c.yaml --resume auto",
    )
    v.update(over)
    return v


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_renders_to_valid_bash(layout, tmp_path):
    script = render_layout(layout, values())
    assert not re.search(r"\{\{\s*\w+\s*\}\}", script)
    for line in (
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --output=/tmp/mg-logs/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --gres=gpu:4",
        "megagrpo_setup gpu",
        "export NCCL_SOCKET_IFNAME=ib0",
    ):
        assert line in script, (layout, line)
    assert "scontrol show hostnames" in script and "scontrol requeue" in script  # lib.sh is inlined
    # every #SBATCH line comes before the first command, or sbatch ignores it
    lines = script.splitlines()
    first_cmd = next(i for i, s in enumerate(lines) if s.strip() and not s.startswith("#"))
    assert all(i < first_cmd for i, s in enumerate(lines) if s.startswith("#SBATCH"))
    path = tmp_path / "job.sh"
    path.write_text(script)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if layout == "srun":
        assert "#SBATCH --ntasks-per-node=4" in script and "torch.distributed.run" not in script
    else:
        assert "#SBATCH --ntasks-per-node=1" in script and "torch.distributed.run" in script
    if layout == "torchrun":
        assert '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"' in script


def test_render_refuses_a_missing_field():
    with pytest.raises(ValueError, match="program"):
        render("run {{python}} {{program}}", {"python": "py"})
    with pytest.raises(MegagrpoError, match="--layout 'mpi'"):
        render_layout("mpi", values())


def test_requeue_exit_code_agrees_with_the_trainer():
    from megagrpo.trainer.signals import REQUEUE_EXIT_CODE

    lib = (TEMPLATE_DIR / "lib.sh").read_text()
    assert f"MEGAGRPO_REQUEUE_EXIT={REQUEUE_EXIT_CODE}\n" in lib


# -- slurm/lib.sh with stand-ins for scontrol and the launcher -------------------------------------


def _lib_harness(tmp_path: Path, launcher_body: str) -> tuple[subprocess.Popen, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    scontrol = bindir / "scontrol"
    scontrol.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            echo "$@" >> {tmp_path}/scontrol.calls
            case "$1 $2" in
              "show hostnames") echo node7; echo node8;;
              "show node") echo "NodeName=node7 Arch=x86_64 NodeAddr=10.1.2.7 NodeHostName=node7";;
              "requeue 12345") kill -TERM $PPID;;  # as Slurm does: the running batch script ends
            esac
            """
        )
    )
    scontrol.chmod(0o755)
    launcher = bindir / "fake_launcher"
    launcher.write_text("#!/bin/bash\n" + launcher_body)
    launcher.chmod(0o755)
    job = tmp_path / "job.sh"
    job.write_text(
        "set -uo pipefail\n"
        + (TEMPLATE_DIR / "lib.sh").read_text()
        + f"\nexport MEGAGRPO_LOG_DIR={tmp_path}\nexport MEGAGRPO_VENV=\nmegagrpo_setup cpu\n"
        + 'env | grep -E "^(MASTER_ADDR|MASTER_PORT|CUDA_VISIBLE_DEVICES|MEGAGRPO_STOP_FILE)=" | sort\n'
        + f"megagrpo_launch {launcher}\nrc=$?\necho final=$rc\nexit $rc\n"
    )
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "12345",
        "SLURM_JOB_NAME": "mg",
        "SLURM_JOB_NODELIST": "node[7-8]",
    }
    proc = subprocess.Popen(
        ["bash", str(job)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, tmp_path / "mg-12345.stop"


def test_lib_sets_master_and_requeues_on_exit_75(tmp_path):
    proc, _ = _lib_harness(tmp_path, "exit 75\n")
    out, _ = proc.communicate(timeout=30)
    assert "MASTER_ADDR=10.1.2.7" in out  # the first node's NodeAddr, not its name
    assert "MASTER_PORT=32345" in out  # 20000 + job id % 20000
    assert "CUDA_VISIBLE_DEVICES=" in out
    assert "requeue 12345" in (tmp_path / "scontrol.calls").read_text()
    assert "final=" not in out and proc.returncode == -signal.SIGTERM  # Slurm ended the requeued run


def test_lib_returns_other_exit_codes_without_requeue(tmp_path):
    proc, _ = _lib_harness(tmp_path, "exit 3\n")
    out, _ = proc.communicate(timeout=30)
    assert "final=3" in out
    assert "requeue" not in (tmp_path / "scontrol.calls").read_text()


def test_lib_turns_usr1_into_the_stop_file_and_keeps_waiting(tmp_path):
    # the launcher waits for the stop file, then exits as the trainer would: checkpoint saved, requeue
    body = 'for i in $(seq 1 200); do [ -e "$MEGAGRPO_STOP_FILE" ] && exit 75; sleep 0.1; done; exit 9\n'
    proc, stop = _lib_harness(tmp_path, body)
    deadline = time.monotonic() + 20
    while (
        not (tmp_path / "scontrol.calls").exists()
        or "show node" not in (tmp_path / "scontrol.calls").read_text()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # let megagrpo_launch install its traps
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert "got SIGUSR1" in out, out
    assert "requeue 12345" in (tmp_path / "scontrol.calls").read_text(), out
    assert not stop.exists()  # cleaned for the requeued run


def test_lib_requeues_on_the_marker_when_torchrun_hides_the_exit_code(tmp_path):
    proc, _ = _lib_harness(tmp_path, 'touch "$MEGAGRPO_REQUEUE_MARKER"; exit 1\n')
    out, _ = proc.communicate(timeout=30)
    assert "requeue 12345" in (tmp_path / "scontrol.calls").read_text(), out


def test_slurm_task_wrapper_ignores_usr1_and_sets_the_node_rank():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megagrpo.launch.slurm_task",
            sys.executable,
            "-c",
            "import os, signal; print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, os.environ['PET_NODE_RANK'])",
        ],
        env={**os.environ, "SLURM_NODEID": "3"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.stdout.split() == ["True", "3"], r.stderr


# -- megagrpo/launch/bootstrap.py ------------------------------------------------------------------


def test_stop_file_raises_usr1_only_once_a_handler_is_installed(tmp_path):
    stop = tmp_path / "job.stop"
    got = threading.Event()
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        done = watch_stop_file(stop, poll_s=0.05)
        stop.touch()
        time.sleep(0.3)  # no handler yet: the watcher must hold the request, not lose it
        signal.signal(signal.SIGUSR1, lambda *_: got.set())
        deadline = time.monotonic() + 10
        while not got.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)  # the handler runs in the main thread between bytecodes
        assert got.is_set()
        done.set()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert watch_stop_file("") is None  # no stop file configured: no watcher


def test_requeue_marker(tmp_path):
    marker = tmp_path / "m"
    env = {"MEGAGRPO_REQUEUE_MARKER": str(marker)}
    assert not mark_requeue(0, 75, env) and not marker.exists()
    assert mark_requeue(75, 75, env) and marker.exists()
    assert not mark_requeue(75, 75, {})


# -- launcher variables -> DistEnv (the one path) --------------------------------------------------


def test_distenv_from_slurm_torchrun_and_openmpi_variables():
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NODELIST": "gpu[03-06]",
        "MASTER_PORT": "23456",
    }
    e = DistEnv.from_environ(slurm)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.node_rank) == ("srun", 5, 8, 1, 2)
    assert (e.master_addr, e.master_port) == ("gpu03", 23456)
    # torchrun under srun: torchrun's variables win, the node rank is torchrun's GROUP_RANK
    tr = {
        **slurm,
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
    }
    e = DistEnv.from_environ(tr)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.node_rank, e.master_addr) == (
        "torchrun",
        3,
        4,
        1,
        1,
        "10.0.0.1",
    )
    ompi = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "h0",
    }
    e = DistEnv.from_environ(ompi)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.node_rank) == ("mpirun", 3, 4, 1, 1)


def test_distenv_bad_bootstrap_and_missing_master():
    with pytest.raises(MegagrpoError, match="MEGAGRPO_BOOTSTRAP='pmi'"):
        DistEnv.from_environ({"MEGAGRPO_BOOTSTRAP": "pmi"})
    with pytest.raises(MegagrpoError, match="MASTER_ADDR is not set"):
        DistEnv.from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_distenv_mpi4py_missing_says_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    with pytest.raises(MegagrpoError, match="pip install mpi4py"):
        DistEnv.from_environ({"MEGAGRPO_BOOTSTRAP": "mpi4py"})


# -- `megagrpo submit` without a Slurm controller (issue 25, item 12) -------------------------------


def _fake_slurm(tmp_path: Path, monkeypatch, sinfo_body: str | None) -> Path:
    """A PATH holding a stand-in `sbatch` and, unless None, an `sinfo`; each logs its calls to calls.log."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.log"
    tools = {"sbatch": "echo 1; exit 0\n"} | ({"sinfo": sinfo_body} if sinfo_body is not None else {})
    for name, body in tools.items():
        (bindir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n{body}')
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    return calls


def _submit_args(tmp_path: Path, *extra: str) -> list[str]:
    """A Qwen3-30B-A3B train job on 2 x 8 GPUs (its config.json only: the plan and the dry run read nothing else)."""
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text((REPO / "configs/models/Qwen3-30B-A3B/config.json").read_text())
    return [
        "submit",
        str(REPO / "configs/countdown_qwen3_moe_gdpo.yaml"),
        f"model.hf_path={model}",
        *extra,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--log-dir",
        str(tmp_path / "logs"),
    ]


CONTROLLER_DOWN = (
    'echo "slurm_load_partitions: Unable to contact slurm controller (connect failure)" >&2; exit 1\n'
)


@pytest.mark.parametrize("sinfo", ["missing", "fails", "hangs"])
def test_dry_run_without_a_controller_renders_and_names_the_skipped_checks(
    tmp_path, monkeypatch, capsys, sinfo
):
    from megagrpo.cli import main
    from megagrpo.submit import slurm

    body = {"missing": None, "fails": CONTROLLER_DOWN, "hangs": "exec /bin/sleep 30\n"}[sinfo]
    calls = _fake_slurm(tmp_path, monkeypatch, body)
    monkeypatch.setattr(slurm, "SINFO_TIMEOUT_S", 0.5)
    assert main([*_submit_args(tmp_path), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert (
        out.startswith("#!/bin/bash") and "#SBATCH --gres=gpu:8" in out and "#SBATCH --partition=gpu" in out
    )
    assert re.search(
        r"memory plan: peak [\d.]+ GiB per GPU of a [\d.]+ GiB budget \(80 GiB GPUs\): fits", err
    )
    cause = {
        "missing": "sinfo/sbatch not found on PATH",
        "fails": "Unable to contact slurm controller",
        "hangs": "did not answer in 0.5 s",
    }[sinfo]
    assert re.search(rf"no Slurm controller answered \(.*{cause}.*\); cluster checks skipped", err), err
    assert "cluster checks skipped: " + "; ".join(slurm.CLUSTER_CHECKS) in err
    assert "dry run, nothing submitted" in err and "Traceback" not in err
    assert (
        not calls.exists()
        if sinfo == "missing"
        else calls.read_text().split() == ["sinfo", "-h", "-o", "%P|%a|%D|%c|%G"]
    )


def test_submit_without_a_controller_says_it_needs_one(tmp_path, monkeypatch, capsys):
    from megagrpo.cli import main

    calls = _fake_slurm(tmp_path, monkeypatch, CONTROLLER_DOWN)
    assert main(_submit_args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "no Slurm controller answered" in err and "Unable to contact slurm controller" in err
    assert "submitting needs one" in err and "--dry-run" in err and "Traceback" not in err
    assert "sbatch" not in calls.read_text()  # nothing submitted


def test_a_plan_that_does_not_fit_is_refused_before_asking_the_cluster(tmp_path, monkeypatch, capsys):
    from megagrpo.cli import main

    calls = _fake_slurm(tmp_path, monkeypatch, CONTROLLER_DOWN)
    assert main([*_submit_args(tmp_path, "mesh.pp=1", "mesh.ep=4"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "memory plan does not fit 80 GiB" in err and "--device cpu for a CPU partition" in err
    assert not calls.exists()  # neither sinfo nor sbatch ran
