"""`megagrpo bundle` (also `tools/gpu_bundle.py`): offline bundles for a GPU node (docs/gpu.md).

record WHEEL -o TABLE.json           symbol tables of a wheel's native libraries
select TARGET.json                   each component's newest version that resolves on the node
trace -o CLOSURE.json engine|train   the distributions a workload imports
build-binding --te V --torch V ...   TE's torch binding against the node's torch
build TARGET.json -o DIR             the bundles and their manifest
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megagrpo.bundle.manifest import Manifest
from megagrpo.bundle.resolve import Provided, select_newest
from megagrpo.bundle.tables import record_wheel
from megagrpo.bundle.target import Target
from megagrpo.errors import MegagrpoError


def _record(args) -> int:
    from megagrpo.bundle.tables import PackageTables

    tables = record_wheel(args.wheel, args.member or None, args.workdir)
    if args.provides_for:
        wanted = set().union(*(PackageTables.load(p).referenced() for p in args.provides_for))
        tables = tables.restricted(wanted, references=False)
    elif args.prune:
        tables = tables.restricted(tables.referenced())
    out = tables.save(args.out)
    n = sum(len(names) for lib in tables.libraries.values() for names in lib.undefined.values())
    print(f"{tables.label}: {len(tables.libraries)} libraries, {n} references listed -> {out}")
    return 0


def _selections(target: Target, allow_unchecked: bool = False) -> list:
    """Each component's verdicts and choice against the node's recorded libraries."""
    provided = Provided(target.provided_tables())
    return [
        select_newest(component, target.candidate_tables(component), provided, allow_unchecked)
        for component in target.components
    ]


def _select(args) -> int:
    target = Target.load(args.target)
    selections = _selections(target, args.allow_unchecked)
    print(
        f"target {target.name}: torch {target.torch}, CUDA {target.cuda_major}, Python {target.python}, "
        f"sm {target.sm}"
    )
    for s in selections:
        print(s.describe())
    if args.manifest:
        path = Manifest(target, selections).write(args.manifest)
        print(f"manifest (selection only) -> {path}")
    return 0 if all(s.chosen is not None for s in selections) else 1


def _trace(args) -> int:
    from megagrpo.bundle.closure import Closure, map_to_distributions, trace_imports

    python = args.python or sys.executable
    if args.workload == "engine":
        cmd = [python, "-m", "megagrpo.bundle.smoke", "engine"]
    else:
        cmd = [python, "-m", "megagrpo.cli", "train", *args.train]
        if not args.train:
            raise MegagrpoError(
                "trace train: give the config and overrides after `train`, e.g. trace -o c.json train cfg.yaml schedule.steps=1"
            )
    names = trace_imports(cmd)
    dists = map_to_distributions(python, names, exclude={"megagrpo"})
    version = subprocess.run(
        [python, "-c", "import sys;print(sys.version.split()[0])"], capture_output=True, text=True
    )
    out = Closure(" ".join(cmd[1:]), version.stdout.strip(), dists).save(args.out)
    print(f"{args.workload}: {len(names)} top-level modules, {len(dists)} distributions -> {out}")
    return 0


def _build(args) -> int:
    from pathlib import Path

    from megagrpo.bundle.build import build_bundle, bundle_specs, plan_bundle
    from megagrpo.bundle.pack import wheel_name_version

    target = Target.load(args.target)
    selections = _selections(target)
    for s in selections:
        print(s.describe())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    built = {wheel_name_version(Path(w))[0]: Path(w) for w in args.wheel or []}
    planned, entries = {}, []
    manifest_path = out / "manifest.json"
    old = {}
    if manifest_path.is_file():  # building one bundle keeps the others' entries
        import json

        old = {b["name"]: b for b in json.loads(manifest_path.read_text()).get("bundles", [])}
    for spec in bundle_specs(target):
        needs, node_has = plan_bundle(spec, target, selections, planned)
        planned[spec.name] = needs
        if args.only and spec.name not in args.only:
            continue
        print(f"{spec.name}: {len(needs)} packages to carry, {len(node_has)} the node provides")
        for n in needs:
            print(f"  {n.name} {n.version}: {n.reason}")
        elsewhere = {n.name: n.version for m in spec.minus for n in planned.get(m, [])}
        entry = build_bundle(
            spec, target, needs, out, Path(args.cache or out / "wheels"), built, elsewhere, progress=True
        )
        print(
            f"{spec.name}: {entry.file} {entry.bytes / 2**20:.1f} MiB, checks {'passed' if entry.passed else 'FAILED'}"
        )
        entries.append(entry)
    manifest = Manifest(target, selections, entries)
    manifest.keep = [b for n, b in old.items() if n not in {e.name for e in entries}]
    manifest.write(manifest_path)
    print(f"manifest -> {manifest_path}")
    return 0 if all(e.passed for e in entries) and all(s.chosen for s in selections) else 1


def _build_binding(args) -> int:
    from pathlib import Path

    from megagrpo.bundle.binding import build_te_binding

    wheel = build_te_binding(args.te, args.torch, args.cuda, Path(args.work), Path(args.out), args.jobs)
    print(f"transformer_engine_torch {args.te} for torch {args.torch} -> {wheel}")
    return 0


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
    rec.add_argument(
        "--provides-for",
        nargs="+",
        metavar="TABLE",
        help="a library the node provides (torch): keep only the definitions these candidates reference",
    )
    rec.add_argument(
        "--prune",
        action="store_true",
        help="a candidate: keep only the definitions its own libraries reference",
    )
    sel = sub.add_parser("select", help="pick each component's newest version that resolves on the target")
    sel.add_argument("target", help="target spec JSON (see megagrpo/bundle/target.py)")
    sel.add_argument("--manifest", help="also write a manifest of the selection here")
    sel.add_argument(
        "--allow-unchecked",
        action="store_true",
        help="accept references to libraries whose table the target lacks (counted, not checked)",
    )
    tr = sub.add_parser("trace", help="record the distributions a workload imports (its import closure)")
    tr.add_argument("workload", choices=["engine", "train"])
    tr.add_argument("-o", "--out", required=True, help="the closure JSON to write")
    tr.add_argument("--python", help="the interpreter whose packages are traced (default: this one)")
    tr.add_argument("train", nargs=argparse.REMAINDER, help="for `train`: the config and dotted overrides")
    bu = sub.add_parser("build", help="build the target spec's bundles and their manifest")
    bu.add_argument("target", help="target spec JSON with a `bundles` section")
    bu.add_argument("-o", "--out", required=True, help="folder for the bundles and manifest.json")
    bu.add_argument("--wheel", action="append", help="a built wheel a bundle needs (the TE torch binding)")
    bu.add_argument("--only", action="append", help="build only this bundle (repeatable)")
    bu.add_argument("--cache", help="wheel download cache (default: OUT/wheels)")
    bb = sub.add_parser(
        "build-binding", help="build TE's torch binding against the target torch (no GPU needed)"
    )
    bb.add_argument("--te", required=True, help="TE version, the one `select` picked (e.g. 2.12.0)")
    bb.add_argument("--torch", required=True, help="the node's torch version without the local tag (2.11.0)")
    bb.add_argument("--cuda", required=True, help="the CUDA major.minor torch was built with (13.0)")
    bb.add_argument("--work", required=True, help="build folder (a venv with that torch: about 4.6 GB)")
    bb.add_argument("-o", "--out", required=True, help="where the wheel goes")
    bb.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = p.parse_args(argv)
    commands = {
        "record": _record,
        "select": _select,
        "trace": _trace,
        "build": _build,
        "build-binding": _build_binding,
    }
    try:
        return commands[args.cmd](args)
    except MegagrpoError as e:
        print(f"gpu_bundle: error: {e}", file=sys.stderr)
        return 2
