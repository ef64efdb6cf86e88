"""Issue 15: the package stands on its own. A wheel built from the clone is installed (not editable) into a
fresh venv, and every command that used to reach into the repository by path runs from a directory
outside the clone: `megagrpo convert` both ways, `megagrpo probe`, `megagrpo submit --dry-run` and
`megagrpo train --nproc 2` for one step. Those of them README.md shows are its own commands, read from its
text (tests/fixtures/doc_commands.py, issue 43), as is docs/slurm.md's `make setup` of the two-clones test.
The installed console script (pyproject's [project.scripts], written by the installer with its `__main__`
guard) starts the probe's SGLang engine in its own process: the spawn start method runs it again there.

The probe run here is also the mismatch probe's end-to-end test (formerly test_mismatch_probe.py's own
run of the same `megagrpo.probe.main` through tools/mismatch_probe.py): one SGLang engine start and one
learner per layout serve both files' assertions.

The fresh venv reuses the shared venv's third-party packages (under .venv) through a plain path line in a .pth file (nothing is
downloaded). A path line adds the directory only: the .pth files inside it, the editable install's
finder among them, are not run, so the clone is not importable there; the test checks that too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from megagrpo.tiny_model import make_tiny_model
from tests.fixtures.doc_commands import commands
from tests.integration.test_trainer_e2e import ASYNC_K1, TWO_PROCESS_RUN, check_two_process_run, write_config

REPO = Path(__file__).resolve().parents[2]
# The site-packages that holds the dependencies (torch's): the shared venv's, whether .venv is this clone's
# overlay (whose own site-packages holds only the .pth that reaches it) or a link to the shared venv.
SHARED_SITE = Path(torch.__file__).resolve().parents[1]
# Left out of the copy the wheel is built from: at the clone's root only (a package may be named `dist`:
# megagrpo/dist is one), and anywhere for the caches.
NOT_SOURCE_ROOT = {".git", ".venv", "outputs", "build", "dist"}
NOT_SOURCE = ("__pycache__", "*.egg-info", ".*_cache", ".hypothesis")


def _not_source(directory: str, names: list[str]) -> set[str]:
    skip = shutil.ignore_patterns(*NOT_SOURCE)(directory, names)
    return skip | (NOT_SOURCE_ROOT & set(names) if Path(directory) == REPO else set())


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
    shutil.copytree(REPO, src, symlinks=True, ignore=_not_source)
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
    (site / "_megagrpo_test_base.pth").write_text(f"{SHARED_SITE}\n")
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
    """README's two `megagrpo convert` commands, one after the other."""
    bin_dir, work, env = installed
    model = tiny_model("qwen3_moe")
    convert = {c.words[2]: c for c in commands("convert")}
    assert sorted(convert) == ["hf-to-megatron", "megatron-to-hf"], [c.text for c in commands("convert")]
    to_megatron = convert["hf-to-megatron"].argv({"HF_DIR": model, "OUT_DIR": work / "ckpt"})
    _run([bin_dir / "megagrpo", *to_megatron[1:], "--no-progress"], work, env, 600)
    to_hf = convert["megatron-to-hf"].argv({"CKPT_DIR": work / "ckpt", "OUT_DIR": work / "hf"})
    _run([bin_dir / "megagrpo", *to_hf[1:]], work, env, 600)
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


CLI_DESCRIPTION = "GRPO-family RL post-training for MoE models."


def test_two_clones_side_by_side_each_run_their_own_code(tmp_path):
    """Issue 36, item 13: two clones set up against one shared venv (the second after the first) each run
    their own package: `megagrpo`, `.venv/bin/python` and so every launch that starts `sys.executable`
    (`--nproc`'s torchrun, the probe's, and the Slurm templates' `{{python}}` with `MEGAGRPO_VENV` =
    `sys.prefix`, as test_submit_dry_run_renders_a_job_that_needs_no_checkout checks), and the python
    commands in .venv/bin. The shared venv is only read. With the former editable install into the shared
    venv, the second clone's `make setup` re-pointed it, and the first clone's `megagrpo` ran the second's."""
    shared = SHARED_SITE.parents[2]  # <venv>/lib/python3.12/site-packages
    lock = hashlib.sha256((REPO / "requirements" / "lock-cpu.txt").read_bytes()).hexdigest()[:16]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"venv-{lock}").symlink_to(shared)  # the cache `make setup` finds: the shared venv, as is
    before = sorted(p.name for p in SHARED_SITE.iterdir())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    clones = {name: tmp_path / name for name in ("a", "b")}
    for name, clone in clones.items():
        shutil.copytree(REPO, clone, symlinks=True, ignore=_not_source)
        cli = clone / "megagrpo" / "cli.py"  # each clone's `megagrpo --help` says which clone it is
        text = cli.read_text()
        assert CLI_DESCRIPTION in text
        cli.write_text(text.replace(CLI_DESCRIPTION, f"{CLI_DESCRIPTION} (clone {name})"))
    (setup,) = commands("make setup")  # docs/slurm.md's, with the cache of this test
    for clone in clones.values():  # b last: it must not take a's `megagrpo`
        _run([*setup.words, "--no-print-directory", f"CACHE_DIR={cache}"], clone, env, 300)
    work = tmp_path / "work"  # outside both clones
    work.mkdir()
    probe = "import json, sys, megagrpo; print(json.dumps([megagrpo.__file__, sys.executable, sys.prefix]))"
    for name, clone in clones.items():
        venv, other = clone / ".venv", "b" if name == "a" else "a"
        usage = _run([venv / "bin" / "megagrpo", "--help"], work, env, 120).stdout
        assert f"(clone {name})" in usage and f"(clone {other})" not in usage, usage
        got = json.loads(_run([venv / "bin" / "python", "-c", probe], work, env, 120).stdout)
        assert got == [str(clone / "megagrpo" / "__init__.py"), str(venv / "bin" / "python"), str(venv)], got
        # the shared venv's python commands run on this clone's python (torchrun starts ranks with it)
        assert (venv / "bin" / "torchrun").read_text().splitlines()[0] == f"#!{venv}/bin/python"
    assert sorted(p.name for p in SHARED_SITE.iterdir()) == before  # nothing installed into the shared venv


def _session_procs(sid: int, grace_s: float = 15.0) -> list[int]:
    """Live processes of session `sid`, after up to `grace_s` for helpers (multiprocessing's resource
    tracker) that exit on their own once their parent is gone."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


# The mismatch probe's end-to-end run (formerly its own in test_mismatch_probe.py, run there through
# tools/mismatch_probe.py, which is `megagrpo.probe.main` as the installed `megagrpo probe` is): its own
# SGLang engine sampling clean and with an fp8 round trip of the sampler's weights, the learner on layouts
# 1, tp2 and ep2 (one torchrun each), the table (md + json) and the dlogp plot.
PROBE_PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202], [44, 45, 46, 47, 48, 49, 50, 51]]
(PROBE,) = commands("probe")  # README's `megagrpo probe HF_DIR --layouts ... --inject ...`
PROBE_LAYOUTS = PROBE.words[PROBE.words.index("--layouts") + 1].split(",")


@pytest.fixture(scope="module")
def probe(installed, sglang_model_dir):
    """README's `megagrpo probe` from the installed package, run from outside the clone, on a few prompts
    and groups of 2; (out dir, the JSON table)."""
    bin_dir, work, env = installed
    prompts, out, log = work / "prompts.jsonl", work / "probe", work / "probe.log"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROBE_PROMPTS))
    cmd = [
        bin_dir / "megagrpo", *PROBE.argv({"HF_DIR": sglang_model_dir})[1:],
        "--prompts", prompts, "--group-size", "2", "--out", out, "--no-progress",
    ]  # fmt: skip
    with open(log, "w") as sink:
        # own session: the engine's and torchrun's processes are findable (and killable) by session id
        proc = subprocess.Popen(
            [str(c) for c in cmd], cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=2400)  # an SGLang start takes minutes on a loaded CPU
        finally:
            leftover = _session_procs(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    assert not leftover, f"the probe left processes behind: {leftover}"
    print(text[text.find("### inject") :])  # the table, with pytest -s
    return out, json.loads((out / "mismatch_table.json").read_text())


@pytest.mark.slow
def test_probe_from_outside_the_clone_writes_table_and_plot(probe):
    """Replaces test_install's probe check and test_mismatch_probe's test_cli_writes_table_and_plot."""
    out, res = probe
    assert res["injections"].keys() == {"none", "fp8"}
    names = ["sampler", *PROBE_LAYOUTS]
    for inject, r in res["injections"].items():
        assert r["n_tokens"] == len(PROBE_PROMPTS) * 2 * 16
        assert [(p["a"], p["b"]) for p in r["pairs"]] == [
            (a, b) for i, a in enumerate(names) for b in names[i + 1 :]
        ], inject
        assert r["attribution"].keys() == set(PROBE_LAYOUTS)
        for layout in PROBE_LAYOUTS:  # written by the torchrun runs of `-m megagrpo.probe`
            assert (out / "learner" / layout / f"{inject}.pt").is_file(), (layout, inject)
    md = (out / "mismatch_table.md").read_text()
    assert "### inject = fp8" in md and "| sampler | tp2 |" in md and "| tp2 | ep2 |" in md
    assert "routing_share" in md
    png = (out / "dlogp.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (out / "rollouts" / "none.pt").is_file() and (out / "rollouts" / "fp8.pt").is_file()


@pytest.mark.slow
def test_probe_learner_layouts_agree_to_fp32_tolerance(probe):
    """Formerly test_mismatch_probe's test_learner_layouts_agree_to_fp32_tolerance."""
    _, res = probe
    for inject, r in res["injections"].items():
        for p in r["pairs"]:
            if p["a"] == "sampler":
                continue
            # the learner's weights are clean under every injection: layouts differ by fp32 reduction order
            assert p["abs_dlogp_max"] < 1e-4, (inject, p)
            assert p["kl_sampler_learner_k3"] < 1e-9 and p["kl_learner_sampler_k3"] < 1e-9, (inject, p)
            assert abs(p["ess_ratio"] - 1.0) < 1e-6, (inject, p)


@pytest.mark.slow
def test_probe_fp8_sampler_is_further_from_every_layout(probe):
    """Formerly test_mismatch_probe's test_fp8_sampler_is_further_from_every_layout; its clean half is
    test_install's former probe check (sampler vs learner, both fp32: the same distribution)."""
    _, res = probe
    clean = {p["b"]: p for p in res["injections"]["none"]["pairs"] if p["a"] == "sampler"}
    fp8 = {p["b"]: p for p in res["injections"]["fp8"]["pairs"] if p["a"] == "sampler"}
    for layout in PROBE_LAYOUTS:
        assert clean[layout]["abs_dlogp_max"] < 1e-3, clean[layout]  # CPU SGLang fp32 vs megatron fp32
        assert fp8[layout]["kl_sampler_learner_k3"] > 100 * max(clean[layout]["kl_sampler_learner_k3"], 1e-12)


def test_train_two_processes_expert_parallel_async_with_a_users_reward_module(installed, tmp_path):
    """README's `megagrpo train CONFIG --nproc 2 mesh.ep=2` from the installed package, with async sampling
    (k = 1), scored by a reward module in the user's own directory (on PYTHONPATH, outside the clone): the
    checks of test_trainer_e2e's two-process runs."""
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
    (doc,) = commands("train --nproc 2")
    _run(
        [bin_dir / "megagrpo", *doc.argv({"CONFIG": cfg})[1:], *ASYNC_K1],
        work,
        {**env, "PYTHONPATH": str(rewards)},
        2400,
    )
    check_two_process_run(run, is_async=True)
