"""Launch a distributed CPU test body in N processes: one subprocess that imports megatron once and
forks the ranks (import dominates start-up; forking from a parent that has done no compute is safe).

Usage from a test: `launch("tests.dist.workers_smoke:main", 2, tmp_path, timeout=300)`; the worker is
called as `fn(rank, world, outdir, **kwargs)` with RANK/WORLD_SIZE/MASTER_* exported, and writes its
results under outdir. A non-zero exit (any rank raised) fails the test with the captured output.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(target: str, nprocs: int, outdir: Path, *, timeout: float = 600, **kwargs: Any) -> str:
    """Run `target` ("module:function") on `nprocs` forked ranks; returns combined output."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tests.dist._harness",
        target,
        str(nprocs),
        str(free_port()),
        str(outdir),
        json.dumps(kwargs),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log = outdir / "launch.log"
    with open(log, "w") as sink:
        # Output goes to a file, not a pipe: dist_checkpointing's writer spawns helper processes that
        # outlive the ranks and would hold a pipe open. The whole process group is killed at the end.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            raise AssertionError(
                f"{target} on {nprocs} ranks timed out after {timeout}s:\n{_tail(log, 8000)}"
            ) from None
        finally:
            _kill_group(proc.pid)
    if proc.returncode != 0:
        raise AssertionError(
            f"{target} on {nprocs} ranks failed (exit {proc.returncode}):\n{_tail(log, 12000)}"
        )
    return log.read_text(errors="replace")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _tail(path: Path, n: int) -> str:
    return path.read_text(errors="replace")[-n:]


def _child(rank: int, target: str, world: int, port: int, outdir: str, kwargs: dict[str, Any]) -> None:
    import torch

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    modname, fname = target.split(":")
    getattr(importlib.import_module(modname), fname)(rank, world, Path(outdir), **kwargs)


def main() -> None:
    target, nprocs, port, outdir, kwargs = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        json.loads(sys.argv[5]),
    )
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat()
    # Import the heavy modules once, before forking.
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch.multiprocessing as mp

    importlib.import_module(target.split(":")[0])
    mp.start_processes(
        _child, args=(target, nprocs, port, outdir, kwargs), nprocs=nprocs, start_method="fork", join=True
    )


if __name__ == "__main__":
    main()
