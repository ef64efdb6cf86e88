"""Issue 16, item 3: every rank builds its NCCL communicators with the settings SGLang's Engine gives only
the ranks that own an engine (NCCL_CUMEM_ENABLE=0, NCCL_NVLS_ENABLE=0, where unset), in the package and in
the Slurm library."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megagrpo.learner import mesh
from megagrpo.learner.mesh import NCCL_DEFAULTS, DistEnv, MeshConfig, set_nccl_defaults

REPO = Path(__file__).resolve().parents[3]


def test_defaults_fill_only_unset_variables():
    env = {"NCCL_NVLS_ENABLE": "1"}
    set_nccl_defaults(env)
    assert env == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}


class _Stop(Exception):
    pass


@pytest.mark.parametrize("user", [{}, {"NCCL_CUMEM_ENABLE": "1"}])
def test_init_mesh_sets_them_before_the_process_group(monkeypatch, user):
    """What init_process_group (the first communicator) sees: the defaults, or the user's value."""
    for key in NCCL_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    for key, value in user.items():
        monkeypatch.setenv(key, value)
    seen = {}

    def fake_init(*args, **kwargs):
        seen.update({k: os.environ.get(k) for k in NCCL_DEFAULTS})
        raise _Stop

    monkeypatch.setattr(mesh.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(mesh.dist, "init_process_group", fake_init)
    with pytest.raises(_Stop):
        mesh.init_mesh(MeshConfig(), DistEnv.from_environ({}))
    assert seen == {**NCCL_DEFAULTS, **user}


@pytest.mark.parametrize("user", ["", "NCCL_NVLS_ENABLE=1"])
def test_slurm_library_exports_them_on_gpu_jobs(tmp_path, user):
    script = f"""
        set -e
        scontrol() {{ echo node01; }}
        {"export " + user if user else ""}
        source {REPO / "slurm" / "lib.sh"}
        megagrpo_setup gpu >/dev/null
        echo "$NCCL_CUMEM_ENABLE $NCCL_NVLS_ENABLE"
    """
    env = {k: v for k, v in os.environ.items() if k not in NCCL_DEFAULTS and not k.startswith("SLURM_")}
    env.update(
        SLURM_JOB_NODELIST="node01", SLURM_JOB_ID="7", SLURM_JOB_NAME="t", MEGAGRPO_LOG_DIR=str(tmp_path)
    )
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == (["0", "1"] if user else ["0", "0"])
