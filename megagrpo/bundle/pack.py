"""Packing a bundle: fetch the wheels a bundle needs, trim them, install them into one folder, and pack
that folder as `<name>.tar.xz` (docs/gpu.md, "Offline bundles").

The wheels are installed here, not on the node: `pip install --target` with `--no-deps --no-index` on the
build machine for the target's Python and platform gives a tree the node only has to unpack, so the node
needs neither pip's resolver nor network. Packing the installed tree with xz rather than shipping the
wheels (deflate) saves about a third: the engine bundle's 281 MB installed packs to 42.3 MiB.

Per-bundle cost on the build machine: one download of each wheel (cached), one install, one xz -9 pass
over the installed tree (single-threaded: about 8 minutes for the engine bundle).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from megagrpo.bundle.closure import canonical
from megagrpo.errors import MegagrpoError


def platforms(glibc: str) -> list[str]:
    """The manylinux tags a node with this glibc accepts (x86_64), newest first: pip matches them exactly."""
    major, minor = (int(x) for x in glibc.split(".")[:2])
    if major != 2 or minor < 17:
        raise MegagrpoError(f"target glibc {glibc!r}: give the node's `ldd --version`, 2.17 or newer")
    tags = [f"manylinux_2_{m}_x86_64" for m in range(minor, 16, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return canonical(name), version


def download(pins: dict[str, str], cache: Path, python: str, glibc: str) -> dict[str, Path]:
    """Fetch `name==version` wheels for the target's Python and platform into `cache` (one pip call for the
    missing ones); return name -> wheel path. Only wheels: the node builds nothing."""
    cache.mkdir(parents=True, exist_ok=True)
    have = {wheel_name_version(w): w for w in cache.glob("*.whl")}
    missing = [f"{n}=={v}" for n, v in sorted(pins.items()) if (canonical(n), v) not in have]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(cache),
               "--python-version", python, "--implementation", "cp"]  # fmt: skip
        for p in platforms(glibc):
            cmd += ["--platform", p]
        proc = subprocess.run(cmd + missing, capture_output=True, text=True)
        if proc.returncode != 0:
            raise MegagrpoError(
                f"could not download {len(missing)} wheel(s) for Python {python}, glibc {glibc}: "
                f"{proc.stderr.strip()[-1500:]}\nA package with no wheel must be built (like the TE binding) "
                "and given with --wheel"
            )
        have = {wheel_name_version(w): w for w in cache.glob("*.whl")}
    out = {}
    for n, v in pins.items():
        w = have.get((canonical(n), v))
        if w is None:
            raise MegagrpoError(f"{n}=={v}: no wheel in {cache} after the download; is the version right?")
        out[canonical(n)] = w
    return out


def install_tree(wheels: list[Path], into: Path) -> int:
    """Install every wheel into `into` in ONE pip call (a later `--target` install into a folder that holds a
    package skips it with only a warning). Returns the installed bytes."""
    if into.exists():
        shutil.rmtree(into)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
           "--target", str(into), *map(str, wheels)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MegagrpoError(
            f"installing the bundle's wheels into {into} failed: {proc.stderr.strip()[-2000:]}"
        )
    return sum(f.stat().st_size for f in into.rglob("*") if f.is_file() and not f.is_symlink())


def pack_tree(tree: Path, out: Path, *, preset: int = 9, progress: bool = False) -> Path:
    """`tree`'s contents as `out` (tar.xz), member names relative to the tree, written atomically. xz -9 is
    single-threaded (about 8 minutes for the engine bundle on one core): `progress` shows bytes packed."""
    import contextlib

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    paths = [p for p in sorted(tree.rglob("*")) if "__pycache__" not in p.parts]
    total = sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())
    bar = (
        Progress(TextColumn(f"packing {out.name}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        if progress
        else contextlib.nullcontext()
    )
    tmp = out.with_name(out.name + ".tmp")
    with bar, tarfile.open(tmp, "w:xz", preset=preset) as tar:
        task = bar.add_task("pack", total=total) if progress else None
        for path in paths:
            tar.add(path, arcname=str(path.relative_to(tree)), recursive=False)
            if progress and path.is_file() and not path.is_symlink():
                bar.advance(task, path.stat().st_size)
    tmp.replace(out)
    return out
