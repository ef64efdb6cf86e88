"""On the node: install a bundle into a folder, with no network, and say how to use it.

    python -m megagrpo.bundle.install BUNDLE.tar.xz --manifest manifest.json --into DIR

Checks the file against the manifest's size and sha256 first (a truncated transfer is named, not
unpacked), unpacks it into DIR, and writes `DIR/megagrpo-bundle.env`: the PYTHONPATH line and the
environment settings the manifest records for the bundle (e.g. SGLang's kernel-version check off, since the
bundle's sglang-kernel is the one that loads under the node's torch). `source DIR/megagrpo-bundle.env` and
run `python -m megagrpo.bundle.smoke` to see what loads.

Standard library only: it runs before anything the bundle brings is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import tarfile
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
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle, "r:xz") as tar:
        tar.extractall(into, filter="data")
    env = {"PYTHONPATH": f"{into}${{PYTHONPATH:+:$PYTHONPATH}}", **entry.get("environment", {})}
    lines = [f"# written by megagrpo.bundle.install for {bundle.name}"]
    for k, v in env.items():
        lines.append(f'export {k}="{v}"' if k == "PYTHONPATH" else f"export {k}={shlex.quote(str(v))}")
    (into / ENV_FILE).write_text("\n".join(lines) + "\n")
    return {"bundle": bundle.name, "into": str(into), "packages": len(entry.get("packages", [])), "env": env}


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
