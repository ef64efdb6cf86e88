"""The bundle's smoke check says in one line what failed and why (issue 36, item 9), not a traceback: a node
without a working bundle is the case it exists for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture
def broken_torch(tmp_path):
    """A `torch` that cannot load, as on a node whose CUDA libraries do not match the bundle's."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        'raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")\n'
    )
    return tmp_path


def _smoke(site, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "megagrpo.bundle.smoke", "engine", "--out", str(site / "out"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_a_failing_part_is_one_line_naming_it_and_the_error(broken_torch):
    r = _smoke(broken_torch)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        "smoke engine: FAILED importing torch: ImportError: libcudart.so.13: cannot open shared object file: "
        "No such file or directory (--verbose prints the traceback)"
    ]
    report = json.loads(r.stdout)
    assert report["smoke"] == "engine" and report["ok"] is False
    assert report["failed"].startswith("importing torch: ImportError: libcudart.so.13")


def test_verbose_keeps_the_traceback(broken_torch):
    r = _smoke(broken_torch, "--verbose")
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr and 'torch/__init__.py", line 1' in r.stderr
    assert r.stderr.splitlines()[-1].startswith(
        "smoke engine: FAILED importing torch: ImportError: libcudart"
    )
