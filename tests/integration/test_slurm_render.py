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
