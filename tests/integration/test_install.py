"""Issue 15: the package stands on its own. A wheel built from the clone is installed (not editable) into a
fresh venv, and every command that used to reach into the repository by path runs from a directory
outside the clone: `megagrpo convert` both ways, `megagrpo probe`, `megagrpo submit --dry-run` and
`megagrpo train --nproc 2` for one step.

The fresh venv reuses .venv's third-party packages through a plain path line in a .pth file (nothing is
downloaded). A path line adds the directory only: the .pth files inside it, the editable install's
finder among them, are not run, so the clone is not importable there; the test checks that too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megagrpo.tiny_model import make_tiny_model
from tests.integration.test_trainer_e2e import EP2_ASYNC, TWO_PROCESS_RUN, check_two_process_run, write_config

REPO = Path(__file__).resolve().parents[2]
NOT_SOURCE = (
    ".git",
    ".venv",
    "outputs",
    "build",
    "dist",
    "__pycache__",
    "*.egg-info",
    ".*_cache",
    ".hypothesis",
)


def _run(cmd: list, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout
    )
    assert res.returncode == 0, f"{cmd}\nexit {res.returncode}\n{(res.stdout + res.stderr)[-4000:]}"
    return res


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, a working directory outside the clone, the environment to run in)."""
    tmp = tmp_path_factory.mktemp("install")
    src, wheels, venv, work = tmp / "src", tmp / "wheels", tmp / "venv", tmp / "work"
    # Build from a copy, so the build's egg-info and build/ never land in the shared working tree.
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", wheels, src],
        tmp, env, 300,
    )  # fmt: skip
    (wheel,) = wheels.glob("megagrpo-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env, 120)
    _run([sys.executable, "-m", "uv", "pip", "install", "-q", "--python", venv / "bin" / "python",
          "--no-deps", "--no-index", wheel], tmp, env, 300)  # fmt: skip
    # Only now (after the install, so no installer sees the editable megagrpo) are .venv's packages added.
    site = Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     tmp, env, 60).stdout.strip())  # fmt: skip
    (site / "_megagrpo_test_base.pth").write_text(sysconfig.get_path("purelib") + "\n")
    work.mkdir()
    return venv / "bin", work, env


def test_the_installed_package_is_the_one_imported(installed):
    bin_dir, work, env = installed
    probe = (
        "import json, sys; import megagrpo; from megagrpo.submit.render import TEMPLATE_DIR; "
        "print(json.dumps({'file': megagrpo.__file__, 'path': sys.path, "
        "'finders': [type(f).__module__ for f in sys.meta_path], 'lib': (TEMPLATE_DIR / 'lib.sh').read_text()}))"
    )
    got = json.loads(_run([bin_dir / "python", "-c", probe], work, env, 120).stdout)
    assert Path(got["file"]).resolve().is_relative_to(bin_dir.parent.resolve()), got["file"]
    assert str(REPO) not in [str(Path(p).resolve()) for p in got["path"] if p], got["path"]
    assert not any("__editable__" in m for m in got["finders"]), got["finders"]
    assert got["lib"] == (REPO / "slurm" / "lib.sh").read_text()  # the templates ship as package data


def test_convert_round_trip_from_outside_the_clone(installed, tiny_model):
    bin_dir, work, env = installed
    model = tiny_model("qwen3_moe")
    _run(
        [bin_dir / "megagrpo", "convert", "hf-to-megatron", model, work / "ckpt", "--no-progress"],
        work,
        env,
        600,
    )
    _run([bin_dir / "megagrpo", "convert", "megatron-to-hf", work / "ckpt", work / "hf"], work, env, 600)
    want = load_file(str(model / "model.safetensors"))
    got = {}
    for f in sorted((work / "hf").glob("*.safetensors")):
        got.update(load_file(str(f)))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_submit_dry_run_renders_a_job_that_needs_no_checkout(installed, tiny_model):
    bin_dir, work, env = installed
    cfg = work / "submit.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"hf_path": str(tiny_model("qwen3_moe"))}}))
    res = _run(
        [
            bin_dir / "megagrpo",
            "submit",
            cfg,
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--device",
            "cpu",
            "--dry-run",
            "--log-dir",
            work / "slurm-logs",
        ],
        work,
        {**env, "PATH": str(bin_dir)},
        300,
    )  # fmt: skip  (a PATH without Slurm's clients: the dry run checks no partition)
    script = res.stdout
    assert "-m megagrpo.launch.slurm_task" in script and "-m megagrpo.launch.run train" in script
    assert str(REPO) not in script
    assert f"MEGAGRPO_VENV={bin_dir.parent}" in script


def test_probe_from_outside_the_clone(installed, tiny_model):
    bin_dir, work, env = installed
    out = work / "probe"
    # an SGLang start takes minutes on a loaded CPU, hence the long limit
    _run(
        [bin_dir / "megagrpo", "probe", tiny_model("qwen3_moe"), "--prompts", "2", "--layouts", "1",
         "--max-new-tokens", "4", "--out", out, "--no-progress"],
        work, env, 2400,
    )  # fmt: skip
    res = json.loads((out / "mismatch_table.json").read_text())["injections"]["none"]
    assert res["n_tokens"] > 0
    (pair,) = res["pairs"]  # sampler vs the learner on layout 1, both fp32: the same distribution
    assert (pair["a"], pair["b"]) == ("sampler", "1") and pair["abs_dlogp_max"] < 1e-3
    assert (out / "learner" / "1" / "none.pt").is_file()  # written by the torchrun run of `-m megagrpo.probe`


def test_train_two_processes_expert_parallel_async_with_a_users_reward_module(installed, tmp_path):
    """`megagrpo train --nproc 2` from the installed package on an EP2 mesh with async sampling (k = 1),
    scored by a reward module in the user's own directory (on PYTHONPATH, outside the clone): the checks of
    test_trainer_e2e's two-process runs."""
    bin_dir, work, env = installed
    model = make_tiny_model(tmp_path / "model", "qwen3_moe", seed=1)
    rewards = work / "user_rewards"
    rewards.mkdir()
    shutil.copy(REPO / "tests" / "integration" / "trainer_rewards.py", rewards / "my_rewards.py")
    run = work / "train"
    cfg = write_config(
        run,
        model,
        **TWO_PROCESS_RUN,
        rewards__functions=[
            {"name": "my_rewards:output_parity", "weight": 1.0},
            {"name": "my_rewards:always_raises", "weight": 0.5},
        ],
    )
    _run(
        [bin_dir / "megagrpo", "train", cfg, *EP2_ASYNC, "--nproc", "2"],
        work,
        {**env, "PYTHONPATH": str(rewards)},
        2400,
    )
    check_two_process_run(run, is_async=True)
