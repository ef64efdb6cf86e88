"""Issue 10, MPI bootstrap: the mesh check (launch/mesh_check.py, TP2 on 2 ranks) under `mpirun -np 2`.

Two launches side by side: one takes ranks from Open MPI's OMPI_COMM_WORLD_* variables (MASTER_ADDR/PORT
given with -x), the other asks for mpi4py (`MEGAGRPO_BOOTSTRAP=mpi4py`: ranks from COMM_WORLD, rank 0's
host and port broadcast over MPI). Both go through `DistEnv.from_environ()`. The `srun --mpi=pmix` case is
in test_slurm.py, which owns the Slurm daemons. Open MPI is installed when missing (apt-get, as root) and
mpi4py through pip; the tests skip loudly only when that is impossible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.slurm_cluster import ensure_mpi4py, ensure_packages, free_ports

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600


@pytest.fixture(scope="module")
def mpi_ready(tmp_path_factory):
    why = ensure_packages(tmp_path_factory.mktemp("apt") / "apt.log") or ensure_mpi4py()
    if why:
        print(f"\n!!! MPI integration tests SKIPPED: {why}", file=sys.stderr)
        pytest.skip(f"!!! MPI bootstrap tests cannot run: {why}")


@pytest.mark.slow
def test_mesh_check_under_mpirun_env_and_mpi4py(mpi_ready, tmp_path):
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_"))}
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGAGRPO_BOOTSTRAP"):
        base_env.pop(var, None)
    base_env["PYTHONPATH"] = str(REPO)
    mpirun = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    check = [sys.executable, str(REPO / "launch" / "mesh_check.py"), "--tp", "2"]
    (port,) = free_ports(1)
    runs = {
        "mpirun": (
            [*mpirun, "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", *check],
            base_env,
        ),
        "mpi4py": ([*mpirun, "-x", "MEGAGRPO_BOOTSTRAP=mpi4py", *check], base_env),
    }
    procs = {}
    for name, (cmd, env) in runs.items():
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed below
        procs[name] = (
            subprocess.Popen(
                [*cmd, "--out", str(tmp_path / f"{name}.json")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
            log,
        )
    try:
        for name, (p, log) in procs.items():
            p.wait(timeout=TIMEOUT)
            log.close()
            text = (tmp_path / f"{name}.log").read_text()
            assert p.returncode == 0, f"{name}:\n{text[-4000:]}"
    finally:
        for p, log in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=30)
            log.close()
    for name in runs:
        res = json.loads((tmp_path / f"{name}.json").read_text())
        assert res["ok"], res
        assert res["launcher"] == name and res["world"] == 2
        assert [r["rank"] for r in res["ranks"]] == [0, 1]
        assert [r["local_rank"] for r in res["ranks"]] == [0, 1]
        assert all(r["tp_size"] == 2 for r in res["ranks"])
