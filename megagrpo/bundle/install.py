"""On the node: install a bundle into a folder, with no network, and say how to use it.

    python -m megagrpo.bundle.install BUNDLE.tar.xz --manifest manifest.json --into DIR

Checks the file against the manifest's size and sha256 first (a truncated transfer is named, not
unpacked), unpacks it into DIR, and writes `DIR/megagrpo-bundle.env`: the PYTHONPATH line and the
environment settings the manifest records for the bundle (e.g. SGLang's kernel-version check off, since the
bundle's sglang-kernel is the one that loads under the node's torch). `source DIR/megagrpo-bundle.env` and
run `python -m megagrpo.bundle.smoke` to see what loads.

DIR is replaced whole: the bundle is unpacked into a fresh folder beside it, which takes DIR's place only
once it is complete, so an earlier installation leaves no stale file (a module the new bundle dropped would
otherwise still import), and a bundle that fails to unpack leaves the earlier installation as it was. DIR
must be new, empty, or an earlier installation (it has the env file): any other folder is refused, never
removed.

Standard library only: it runs before anything the bundle brings is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ENV_FILE = "megagrpo-bundle.env"


class InstallError(Exception):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_entry(manifest: Path, bundle: Path) -> dict:
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise InstallError(f"{manifest}: cannot read the manifest ({e}); copy it beside the bundle") from e
    for entry in data.get("bundles", []):
        if entry.get("file") == bundle.name:
            return entry
    names = [e.get("file") for e in data.get("bundles", [])]
    raise InstallError(f"{manifest} lists no bundle named {bundle.name!r} (it lists {names})")


def install(bundle: Path, manifest: Path, into: Path) -> dict:
    entry = manifest_entry(manifest, bundle)
    if not bundle.is_file():
        raise InstallError(f"{bundle}: no such bundle file")
    size = bundle.stat().st_size
    if size != entry["bytes"]:
        raise InstallError(f"{bundle}: {size} bytes, the manifest says {entry['bytes']}: copy it again")
    if _sha256(bundle) != entry["sha256"]:
        raise InstallError(
            f"{bundle}: sha256 differs from the manifest's: the file is damaged, copy it again"
        )
    _check_replaceable(into)
    into.parent.mkdir(parents=True, exist_ok=True)
    # Beside DIR, so that the swap is a rename within one file system.
    fresh = Path(tempfile.mkdtemp(prefix=f".{into.name}.installing-", dir=into.parent))
    try:
        fresh.chmod(0o777 & ~_umask())  # mkdtemp's folder is private; an installation is read by the job
        try:
            with tarfile.open(bundle, "r:xz") as tar:
                tar.extractall(fresh, filter="data")
        except (tarfile.TarError, EOFError, OSError) as e:  # lzma.LZMAError is an OSError
            raise InstallError(
                f"{bundle}: cannot unpack it ({type(e).__name__}: {e}); {into} is left as it was"
            ) from e
        env = {"PYTHONPATH": f"{into}${{PYTHONPATH:+:$PYTHONPATH}}", **entry.get("environment", {})}
        lines = [f"# written by megagrpo.bundle.install for {bundle.name}"]
        for k, v in env.items():
            lines.append(f'export {k}="{v}"' if k == "PYTHONPATH" else f"export {k}={shlex.quote(str(v))}")
        (fresh / ENV_FILE).write_text("\n".join(lines) + "\n")
        try:
            _swap(fresh, into)
        except OSError as e:
            raise InstallError(f"{into}: cannot put the new installation in place ({e})") from e
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # gone already unless something failed before the swap
    return {"bundle": bundle.name, "into": str(into), "packages": len(entry.get("packages", [])), "env": env}


def _check_replaceable(into: Path) -> None:
    """InstallError unless `into` is absent, an empty folder, or an earlier installation."""
    if not into.exists():
        return
    if not into.is_dir() or into.is_symlink():
        raise InstallError(
            f"--into {into}: not a folder; give a new or empty folder, or an earlier installation"
        )
    if any(into.iterdir()) and not (into / ENV_FILE).is_file():
        raise InstallError(
            f"--into {into}: a folder with files and no {ENV_FILE}, so not an earlier installation; it would "
            "be replaced whole: give a new or empty folder"
        )


def _swap(fresh: Path, into: Path) -> None:
    """`fresh` takes `into`'s place; the earlier `into`, if any, is removed once it has."""
    if not into.exists():
        fresh.rename(into)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{into.name}.replaced-", dir=into.parent))
    old.rmdir()  # only its unique name is wanted: `into` moves there
    into.rename(old)
    try:
        fresh.rename(into)
    except OSError:
        old.rename(into)  # the earlier installation back in place
        raise
    shutil.rmtree(old)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megagrpo.bundle.install", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("bundle", type=Path)
    p.add_argument("--manifest", type=Path, help="default: manifest.json beside the bundle")
    p.add_argument("--into", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        report = install(args.bundle, args.manifest or args.bundle.with_name("manifest.json"), args.into)
    except InstallError as e:
        print(f"megagrpo.bundle.install: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    print(f"now: source {args.into / ENV_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
