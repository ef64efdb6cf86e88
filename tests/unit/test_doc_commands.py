"""Issue 43: every command README.md and docs/*.md show is run by a test, from the docs' own text
(tests/fixtures/doc_commands.py). Here: that each one has a test that runs it, and the commands that need no
engine (make's recipes, the memory plan, a cluster job's --dry-run, the GPU node's bundle install and what
only parses off a GPU node). The engines' commands run in the integration launches `RUNNERS` names."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

import megagrpo.submit.slurm as slurm
from megagrpo.cli import main
from tests.fixtures.doc_commands import (
    PLACEHOLDERS,
    REPO,
    RUNNERS,
    commands,
    doc_commands,
    runner_of,
    untagged_command_blocks,
)

# The config a cluster's plan and submission stand on where the docs write CONFIG: docs/slurm.md's example.
CLUSTER_CONFIG = "configs/countdown_qwen3_moe_gdpo.yaml"


def test_every_doc_command_has_a_test_that_runs_it():
    cmds = doc_commands()
    assert len(cmds) >= 30, [c.text for c in cmds]  # the parser found the blocks
    unknown = [f"{c.where}: {c.text}" for c in cmds if runner_of(c) is None]
    assert not unknown, "commands no test runs (add a rule to runner_of and run them there):\n" + "\n".join(
        unknown
    )
    assert not untagged_command_blocks(), "tag these blocks bash (run) or text (synopsis, output)"
    used = {p for c in cmds for p in c.placeholders()}
    assert used == set(PLACEHOLDERS), f"PLACEHOLDERS rows no command uses: {set(PLACEHOLDERS) - used}"
    assert {runner_of(c) for c in cmds} == set(RUNNERS), "RUNNERS rows with no command"


def test_an_edited_or_new_example_is_what_runs(tmp_path, monkeypatch):
    """The commands are the text's: an override changed in the docs is the override the test runs, and a
    command of a kind no test runs is refused."""
    import tests.fixtures.doc_commands as dc

    doc = tmp_path / "README.md"
    doc.write_text(
        "```bash\nmegagrpo train CONFIG algo.clip_high=0.3 \\\n  --resume auto   # a comment\n"
        "megagrpo frobnicate CONFIG\n```\n\n```\nmegagrpo plan CONFIG --nodes 2\n```\n"
    )
    monkeypatch.setattr(dc, "DOCS", (doc,))
    monkeypatch.setattr(dc, "REPO", tmp_path)
    train, odd = dc.doc_commands()
    assert train.where == "README.md:2" and runner_of(train) == "one process"
    assert train.argv({"CONFIG": "c.yaml"}) == [
        "megagrpo",
        "train",
        "c.yaml",
        "algo.clip_high=0.3",
        "--resume",
        "auto",
    ]
    with pytest.raises(AssertionError, match="no value for"):
        train.argv({})
    assert runner_of(odd) is None
    assert dc.untagged_command_blocks() == ["README.md:8: megagrpo plan CONFIG --nodes 2"]


def test_make_targets_as_dry_runs():
    for cmd in commands("make -n"):
        res = subprocess.run(
            ["make", "-n", *cmd.words[1:]], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 0, f"{cmd.where}: {cmd.text}\n{res.stderr[-2000:]}"
        assert res.stdout.strip(), f"{cmd.where}: {cmd.text}: make would run nothing"


def _released_model(config: str) -> Path:
    """The released architecture's config.json folder (configs/models/) the config's model path names."""
    hf_path = yaml.safe_load((REPO / config).read_text())["model"]["hf_path"]
    model = REPO / "configs" / "models" / Path(hf_path).name
    assert (model / "config.json").is_file(), f"{config}: no configs/models/ entry for {hf_path}"
    return model


@pytest.fixture
def no_slurm(monkeypatch):
    def partitions(*a, **k):
        raise slurm.NoController("no controller in unit tests")

    monkeypatch.setattr(slurm, "partitions", partitions)


def test_plan_and_submit_commands(tmp_path, monkeypatch, capsys, no_slurm):
    """`megagrpo plan` and `megagrpo submit` as written, on the released architecture of the config (a
    submission as its --dry-run: it needs a cluster), in process."""
    monkeypatch.chdir(REPO)  # the docs' paths are the clone's
    cmds = commands("plan") + commands("submit")
    for cmd in cmds:
        argv = cmd.argv({"CONFIG": CLUSTER_CONFIG})[1:]
        config = argv[1]
        argv.insert(2, f"model.hf_path={_released_model(config)}")
        if argv[0] == "submit":
            argv += [] if "--dry-run" in argv else ["--dry-run"]
            argv += ["--log-dir", str(tmp_path / "logs")]
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 0, f"{cmd.where}: {cmd.text}\n{err[-3000:]}"
        if argv[0] == "plan":
            assert "verdict: FITS" in out, f"{cmd.where}: {out[-2000:]}"
        else:
            assert "dry run, nothing submitted" in err and "megagrpo.launch.run train" in out, err[-2000:]


def _pack(folder: Path, files_of: dict[str, dict[str, str]]) -> None:
    """Bundles `<name>.tar.xz` of `files` and their one manifest.json, as `megagrpo bundle build` writes them."""
    folder.mkdir()
    entries = []
    for name, files in files_of.items():
        path = folder / f"{name}.tar.xz"
        with tarfile.open(path, "w:xz") as tar:
            for rel, text in files.items():
                info = tarfile.TarInfo(rel)
                info.size = len(text.encode())
                tar.addfile(info, io.BytesIO(text.encode()))
        blob = path.read_bytes()
        entries.append(
            {
                "file": path.name,
                "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest(),
                "environment": {f"BUNDLE_{name.upper()}": name},
            }
        )
    (folder / "manifest.json").write_text(json.dumps({"bundles": entries}))


def test_bundle_install_commands(tmp_path):
    """docs/gpu.md's install and `source` lines on two bundles packed here, run as written (python3: this
    venv's interpreter, as on the node)."""
    bundles = tmp_path / "bundles"
    _pack(bundles, {"engine": {"eng/__init__.py": ""}, "learner": {"lrn/__init__.py": ""}})
    values = {
        "engine.tar.xz": bundles / "engine.tar.xz",
        "learner.tar.xz": bundles / "learner.tar.xz",
        "manifest.json": bundles / "manifest.json",
        "/opt/mg": tmp_path / "mg",
    }
    sourced = []
    for cmd in commands("bundle install"):
        argv = cmd.argv(values)
        if argv[0] == "source":
            res = subprocess.run(
                ["bash", "-ec", f'source "{argv[1]}"; env'], capture_output=True, text=True, timeout=60
            )
            sourced += re.findall(r"^BUNDLE_\w+=(\w+)$", res.stdout, re.M)
        else:
            res = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, f"{cmd.where}: {cmd.text}\n{res.stderr[-2000:]}"
    assert sorted(sourced) == ["engine", "learner"]
    assert (tmp_path / "mg" / "engine" / "eng" / "__init__.py").is_file()
    assert (tmp_path / "mg" / "learner" / "lrn" / "__init__.py").is_file()


class _Parsed(Exception):
    pass


def test_gpu_node_commands_parse(monkeypatch):
    """What needs a GPU node's packages, CUDA or downloads is parsed by the command's own parser: its
    subcommand and every option exist and take the values written. The tier's script: its syntax and stage."""
    from megagrpo.bundle import cli as bundle_cli
    from megagrpo.bundle import smoke

    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    entry = {("tools/gpu_bundle.py",): bundle_cli.main, ("-m", "megagrpo.bundle.smoke"): smoke.main}
    for cmd in commands("parse"):
        w = cmd.words
        rest = w[2:] if w[1] == "tools/gpu_bundle.py" else w[3:]
        with pytest.raises(_Parsed):
            entry[(w[1],) if w[1] == "tools/gpu_bundle.py" else tuple(w[1:3])](list(rest))
    for cmd in commands("gpu tier"):
        script = REPO / cmd.words[0]
        assert os.access(script, os.X_OK), script
        assert subprocess.run(["bash", "-n", script], timeout=30).returncode == 0
        usage = re.search(r"usage: \S+ BUNDLE_DIR \[([\w|]+)\]", script.read_text())
        assert usage and cmd.words[2] in usage[1].split("|"), (cmd.text, usage)
