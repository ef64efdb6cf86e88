"""tools/clone_venv.py (issue 36, item 13) on a fake shared venv: the clone's .venv imports the clone's
package and the shared venv's dependencies, its commands run on its own python, and the shared venv is
only read. The real shared venv and two real clones: test_install.py's two-clones test."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from tools.clone_venv import CONSOLE_SCRIPT, STAMP, make_overlay, recipe

REPO = Path(__file__).resolve().parents[2]
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
    assert (venv / STAMP).read_text() == f"{shared} {clone} {recipe()}\n"
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


# A stand-in for megagrpo.cli whose command does what SGLang's engine start does: a child process started
# with the spawn method, which runs the parent's main script again (as `__mp_main__`) before its target.
# Each call of main() leaves a line in CALLS; a second one means the child ran the command too, and its own
# process start then fails (multiprocessing refuses a start during the child's bootstrapping).
SPAWNING_CLI = """import multiprocessing, os, sys


def scheduler():
    pass


def main():
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    child = multiprocessing.get_context("spawn").Process(target=scheduler)
    child.start()
    child.join()
    return child.exitcode
"""


def test_the_console_script_runs_its_command_once_under_spawn(tmp_path):
    """Issue 43: `.venv/bin/megagrpo` called main() without a `__main__` guard, so every engine start through
    it died with "Rank 0 scheduler died during initialization". The real engine through the real script:
    tests/integration/test_trainer_e2e.py (its `cli`)."""
    shared = _fake_shared(tmp_path)
    clone = tmp_path / "clone"
    (clone / "megagrpo").mkdir(parents=True)
    (clone / "megagrpo" / "__init__.py").write_text("")
    (clone / "megagrpo" / "cli.py").write_text(SPAWNING_CLI)
    venv = make_overlay(shared, clone)
    calls = tmp_path / "calls"
    res = subprocess.run(
        [venv / "bin" / "megagrpo"], capture_output=True, text=True, env={"CALLS": str(calls)}, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(calls.read_text().splitlines()) == 1


def test_make_setup_redoes_an_overlay_of_an_earlier_recipe(tmp_path):
    """The stamp holds clone_venv.py's hash, so a clone set up before a change to its console script (the
    unguarded one of issue 43) gets the new one from `make setup`; a current overlay is left as it is."""
    shared = _fake_shared(tmp_path)
    (shared / "bin" / "python").unlink()
    (shared / "bin" / "python").symlink_to(sys.executable)  # `make setup` runs clone_venv.py with it
    (shared / ".installed").touch()
    clone = tmp_path / "clone"
    for f in ("Makefile", "tools/clone_venv.py", "requirements/lock-cpu.txt"):
        (clone / f).parent.mkdir(parents=True, exist_ok=True)
        (clone / f).write_bytes((REPO / f).read_bytes())
    venv = make_overlay(shared, clone)

    def setup() -> None:
        subprocess.run(["make", "-s", "setup", f"VENV={shared}"], cwd=clone, check=True, capture_output=True)

    (venv / "kept").touch()
    setup()
    assert (venv / "kept").exists()  # current: nothing redone
    (venv / STAMP).write_text(f"{shared} {clone}\n")  # the stamp of the recipe before issue 43
    (venv / "bin" / "megagrpo").write_text(
        "import sys\n\nfrom megagrpo.cli import main\n\nsys.exit(main())\n"
    )
    setup()
    assert not (venv / "kept").exists()
    assert (venv / STAMP).read_text() == f"{shared} {clone} {recipe()}\n"
    assert (venv / "bin" / "megagrpo").read_text() == f"#!{venv}/bin/python\n{CONSOLE_SCRIPT}"


# A script that calls the real megagrpo.cli.main() unguarded, and as the parent starts a spawned child.
UNGUARDED_SCRIPT = """import multiprocessing, sys

from megagrpo.cli import main


def scheduler():
    pass


if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=scheduler)
    child.start()
    child.join()
    sys.exit(child.exitcode)
sys.exit(main(["convert"]))
"""


def test_the_cli_refuses_to_run_in_a_spawned_child_of_an_unguarded_script(tmp_path):
    """megagrpo.cli.main() called by a spawned child's re-run of an unguarded main script (any script that
    calls it so, a stale `.venv/bin/megagrpo` among them) stops there with the fix named, instead of running
    the command (a second engine) inside the child."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    res = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]  # the child's exit: the user error
    assert "calls megagrpo.cli.main() when it is imported" in res.stderr and "usage" not in res.stderr
    assert "`make setup`" in res.stderr and "Traceback" not in res.stderr


def _unguarded_entry_calls(source: str) -> list[str]:
    """Module-level calls of `main`/`sys.exit` outside `if __name__ == "__main__":` (what a spawned child,
    re-running the script as `__mp_main__`, would run again)."""
    bad = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            continue
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            name = ast.unparse(call.func)
            if name in ("main", "sys.exit") and not isinstance(node, ast.FunctionDef | ast.ClassDef):
                bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    return bad


def test_every_script_runs_its_command_only_as_the_main_module():
    """The scripts a user runs (tools/, launch/, the modules run with `-m`, the console script) start their
    command under the `__main__` guard, so a spawned child (SGLang's scheduler) never runs it again."""
    assert _unguarded_entry_calls("import sys\nfrom megagrpo.cli import main\n\nsys.exit(main())\n")
    assert not _unguarded_entry_calls(CONSOLE_SCRIPT)
    scripts = [*(REPO / "tools").glob("*.py"), *(REPO / "launch").glob("*.py")]
    scripts += [p for p in (REPO / "megagrpo").rglob("*.py") if "__main__" in p.read_text()]
    bad = {str(p.relative_to(REPO)): b for p in scripts if (b := _unguarded_entry_calls(p.read_text()))}
    assert not bad, bad
