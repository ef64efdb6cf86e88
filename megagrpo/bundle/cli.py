"""Offline GPU bundles (issue 28): record symbol tables from wheels, and select versions by them.

    python tools/gpu_bundle.py record WHEEL [--member GLOB ...] -o TABLE.json
    python tools/gpu_bundle.py select TARGET.json [--manifest OUT.json]

`select` prints, per component, every candidate's verdict (the first missing symbol of each rejected one)
and the newest that resolves. Building the TE torch binding, trimming to the target's SM architectures and
packing the bundles are not implemented yet: `select` says so and stops there.
"""

from __future__ import annotations

import argparse
import sys

from megagrpo.bundle.manifest import Manifest
from megagrpo.bundle.resolve import Provided, select_newest
from megagrpo.bundle.tables import record_wheel
from megagrpo.bundle.target import Target
from megagrpo.errors import MegagrpoError

NOT_YET = (
    "not implemented yet: building the TE torch binding, trimming native libraries to the target's SM "
    "architectures, and packing the learner and engine bundles (docs/gpu.md, 'Offline bundles')"
)


def _record(args) -> int:
    tables = record_wheel(args.wheel, args.member or None, args.workdir)
    out = tables.save(args.out)
    n = sum(len(names) for lib in tables.libraries.values() for names in lib.undefined.values())
    print(f"{tables.label}: {len(tables.libraries)} libraries, {n} references listed -> {out}")
    return 0


def _select(args) -> int:
    target = Target.load(args.target)
    provided = Provided(target.provided_tables())
    selections = [
        select_newest(component, target.candidate_tables(component), provided, args.allow_unchecked)
        for component in target.components
    ]
    print(
        f"target {target.name}: torch {target.torch}, CUDA {target.cuda_major}, Python {target.python}, "
        f"sm {target.sm}"
    )
    for s in selections:
        print(s.describe())
    if args.manifest:
        path = Manifest(target, selections).write(args.manifest)
        print(f"manifest (selection only, no bundles yet) -> {path}")
    print(NOT_YET)
    return 0 if all(s.chosen is not None for s in selections) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megagrpo bundle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="write the symbol tables of a wheel's shared libraries")
    rec.add_argument("wheel")
    rec.add_argument("-o", "--out", required=True, help="the JSON table to write")
    rec.add_argument("--member", action="append", help="glob of the wheel members to read (default: all .so)")
    rec.add_argument("--workdir", help="where to unpack each library while reading it (default: $TMPDIR)")
    sel = sub.add_parser("select", help="pick each component's newest version that resolves on the target")
    sel.add_argument("target", help="target spec JSON (see megagrpo/bundle/target.py)")
    sel.add_argument("--manifest", help="also write a manifest of the selection here")
    sel.add_argument(
        "--allow-unchecked",
        action="store_true",
        help="accept references to libraries whose table the target lacks (counted, not checked)",
    )
    args = p.parse_args(argv)
    try:
        return _record(args) if args.cmd == "record" else _select(args)
    except MegagrpoError as e:
        print(f"gpu_bundle: error: {e}", file=sys.stderr)
        return 2
