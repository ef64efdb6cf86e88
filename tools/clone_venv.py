"""`make setup`'s clone-local venv: `.venv`, a small venv of this clone's own on top of the shared one.

    <shared venv>/bin/python tools/clone_venv.py <shared venv> <clone root>

The shared venv (`~/.cache/megagrpo/venv-<lock hash>`) holds the dependencies and no megagrpo; several
clones use it at once. `.venv` is made from the shared venv's interpreter, and its site-packages holds one
.pth file: the clone's root, then the shared site-packages through `site.addsitedir` (so the .pth files
there still run). Its bin/ has `megagrpo` and the shared venv's commands: python scripts with their `#!`
line pointing at `.venv/bin/python`, anything else linked. So `megagrpo`, `.venv/bin/python` and every
process started with `sys.executable` (torchrun, srun, the Slurm templates' python, whose MEGAGRPO_VENV is
`sys.prefix`) import this clone's package, whichever clone ran `make setup` last. Standard library only:
it runs before anything of the clone is importable.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import sysconfig
import venv
from pathlib import Path

STAMP = ".overlay-of"  # "<shared venv> <clone root> <recipe>": the overlay is redone when any changes
# The console script. Its guard is what keeps a command single: SGLang starts its scheduler with the spawn
# method, which runs the parent's main script again in the child (as `__mp_main__`), and an unguarded call
# would start the command, and a second engine, in there (issue 43).
CONSOLE_SCRIPT = """import sys

from megagrpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
"""


def recipe() -> str:
    """A hash of this file, in the stamp (and in the Makefile's `setup`): a clone set up by an earlier
    recipe, whose console script may lack the guard, is set up again."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


SHEBANG = re.compile(rb"#!\S*/bin/python[0-9.]*\n")
SKIP = re.compile(r"python[0-9.]*|activate.*|Activate.*|megagrpo")


def make_overlay(shared: Path, clone: Path) -> Path:
    """Create (or recreate) `clone/.venv` over `shared`; returns its path. A `.venv` that is a link (the
    former layout: the shared venv itself) is replaced, never followed."""
    dest = clone / ".venv"
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.exists():
        shutil.rmtree(dest)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(dest)
    site = dest / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    shared_site = shared / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    (site / "_megagrpo_clone.pth").write_text(
        f"{clone}\nimport site; site.addsitedir({str(shared_site)!r})\n"
    )
    python = f"#!{dest}/bin/python\n".encode()
    for f in sorted((shared / "bin").iterdir()):
        if SKIP.fullmatch(f.name) or (dest / "bin" / f.name).exists():
            continue
        head = f.read_bytes()[:256] if f.is_file() else b""
        first = head.split(b"\n", 1)[0] + b"\n"
        if SHEBANG.fullmatch(first):  # a python entry point of the shared venv: run it on .venv's python
            (dest / "bin" / f.name).write_bytes(python + f.read_bytes()[len(first) :])
            (dest / "bin" / f.name).chmod(0o755)
        else:  # a native command (ruff, uv) or a shell script: the shared one, as it is
            (dest / "bin" / f.name).symlink_to(f)
    (dest / "bin" / "megagrpo").write_text(python.decode() + CONSOLE_SCRIPT)
    (dest / "bin" / "megagrpo").chmod(0o755)
    (dest / STAMP).write_text(f"{shared} {clone} {recipe()}\n")
    return dest


if __name__ == "__main__":
    shared_venv, clone_root = (Path(a).absolute() for a in sys.argv[1:3])
    print(f"==> {make_overlay(shared_venv, clone_root)}: this clone's code on {shared_venv}")
