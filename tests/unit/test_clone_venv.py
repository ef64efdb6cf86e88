"""tools/clone_venv.py (issue 36, item 13) on a fake shared venv: the clone's .venv imports the clone's
package and the shared venv's dependencies, its commands run on its own python, and the shared venv is
only read. The real shared venv and two real clones: test_install.py's two-clones test."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from tools.clone_venv import STAMP, make_overlay

SITE = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)


def _fake_shared(root: Path) -> Path:
    shared = root / "shared"
    (shared / SITE).mkdir(parents=True)
    (shared / SITE / "fakedep.py").write_text("WHERE = 'shared'\n")
    (shared / SITE / "fakedep_hook.pth").write_text("import os; os.environ['FAKEDEP_PTH_RAN'] = '1'\n")
    (shared / SITE / "megagrpo").mkdir()  # a stale install of another clone in the shared venv
    (shared / SITE / "megagrpo" / "__init__.py").write_text("WHERE = 'shared'\n")
    bin_dir = shared / "bin"
    bin_dir.mkdir()
    (bin_dir / "tool").write_text(f"#!{shared}/bin/python3.12\nimport fakedep\nprint(fakedep.WHERE)\n")
    (bin_dir / "native").write_bytes(b"\x7fELF\x02\x01\x01")
    (bin_dir / "megagrpo").write_text(f"#!{shared}/bin/python\nraise SystemExit('the shared one')\n")
    (bin_dir / "python").write_text("not the interpreter\n")
    return shared


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts)


def test_the_overlay_imports_the_clone_and_the_shared_dependencies(tmp_path):
    shared = _fake_shared(tmp_path)
    before = _files(shared)
    clone = tmp_path / "clone"
    (clone / "megagrpo").mkdir(parents=True)
    (clone / "megagrpo" / "__init__.py").write_text("WHERE = 'clone'\n")
    (clone / ".venv").symlink_to(shared)  # the former layout: .venv was the shared venv itself

    venv = make_overlay(shared, clone)

    assert venv == clone / ".venv" and not venv.is_symlink()
    assert (venv / STAMP).read_text() == f"{shared} {clone}\n"
    probe = (
        "import json, os, sys, fakedep, megagrpo; "
        "print(json.dumps([megagrpo.WHERE, fakedep.WHERE, os.environ.get('FAKEDEP_PTH_RAN'), sys.prefix]))"
    )
    out = subprocess.run(
        [venv / "bin" / "python", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={},
        cwd=tmp_path,
    ).stdout
    assert json.loads(out) == ["clone", "shared", "1", str(venv)]
    # python entry points run on the clone's python; native commands are the shared ones
    tool = venv / "bin" / "tool"
    assert tool.read_text().splitlines()[0] == f"#!{venv}/bin/python" and not tool.is_symlink()
    assert (
        subprocess.run([tool], capture_output=True, text=True, check=True, env={}, cwd=tmp_path).stdout
        == "shared\n"
    )
    assert (venv / "bin" / "native").resolve() == shared / "bin" / "native"
    megagrpo = (venv / "bin" / "megagrpo").read_text()
    assert megagrpo.startswith(f"#!{venv}/bin/python\n") and "from megagrpo.cli import main" in megagrpo
    assert (venv / "bin" / "python").resolve() != (shared / "bin" / "python").resolve()
    assert _files(shared) == before  # only read (bytecode of what was imported aside)


def test_a_second_overlay_replaces_the_first(tmp_path):
    shared = _fake_shared(tmp_path)
    clone = tmp_path / "clone"
    clone.mkdir()
    first = make_overlay(shared, clone)
    (first / "leftover").write_text("x")
    second = make_overlay(shared, clone)
    assert second == first and not (second / "leftover").exists()
