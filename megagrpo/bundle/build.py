"""Building the bundles a target spec describes (`megagrpo bundle build`): for each bundle, the traced
import closure minus what the node has, plus the GPU-only packages the spec adds (at the versions the
symbol tables selected), trimmed to the target's SMs, installed and packed; then the manifest.

A bundle's section of the target spec (all optional but `closure`):

    "engine": {"closure": "engine-closure.json",             # `megagrpo bundle trace engine`
               "minus": [],                                  # bundles installed beside it on every node
               "add": {"sglang-kernel": "0.4.6",             # not imported on the CPU, so not traced
                       "transformer-engine": "@transformer-engine-core"},  # @: a selected component's version
               "exclude": {"wandb": "why it is not needed"}, # traced or declared, not needed on the node: why
               "built": ["transformer-engine-torch"],        # no wheel on PyPI: given with --wheel
               "trim": ["sglang-kernel"],                    # zero other SMs' fatbin entries
               "drop": {"sglang-kernel": ["sgl_kernel/flash_ops*"]},  # members left out (globs)
               "why": {"sglang-kernel": "FA3 is 1.1 GB; the engine runs Triton attention"},  # per drop
               "environment": {"SGLANG_...": "1"},          # written to the node's env file
               "smoke": ["sglang", "sgl_kernel"]}            # modules the node's smoke check imports
"""

from __future__ import annotations

import fnmatch
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megagrpo.bundle.closure import Closure, Need, canonical, subtract_node
from megagrpo.bundle.manifest import BundleEntry, Check, PackageEntry
from megagrpo.bundle.pack import download, install_tree, pack_tree, wheel_name_version
from megagrpo.bundle.resolve import Selection
from megagrpo.bundle.target import Target
from megagrpo.errors import MegagrpoError

_BUNDLE_FIELDS = {
    "closure",
    "minus",
    "add",
    "exclude",
    "built",
    "trim",
    "drop",
    "why",
    "environment",
    "smoke",
}


@dataclass
class BundleSpec:
    name: str
    closure: Path
    minus: list[str] = field(default_factory=list)
    add: dict[str, str] = field(default_factory=dict)
    exclude: dict[str, str] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)
    trim: list[str] = field(default_factory=list)
    drop: dict[str, list[str]] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)  # the reason each `drop` is safe, for the manifest
    environment: dict[str, str] = field(default_factory=dict)
    smoke: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, name: str, data: dict, base: Path, where: str) -> BundleSpec:
        unexplained = sorted(set(data.get("drop", {})) - set(data.get("why", {})))
        if unexplained:
            raise MegagrpoError(f"{where}: bundles.{name}.drop: say in bundles.{name}.why why leaving out "
                                f"members of {unexplained} is safe")  # fmt: skip
        unknown = sorted(set(data) - _BUNDLE_FIELDS)
        if unknown:
            raise MegagrpoError(
                f"{where}: bundles.{name}: unknown field(s) {unknown}; allowed {sorted(_BUNDLE_FIELDS)}"
            )
        if "closure" not in data:
            raise MegagrpoError(
                f"{where}: bundles.{name}.closure: name the closure record (`megagrpo bundle trace`)"
            )
        return cls(name, base / data["closure"], **{k: v for k, v in data.items() if k != "closure"})


def bundle_specs(target: Target) -> list[BundleSpec]:
    base = Path(target.source).parent
    specs = [BundleSpec.parse(n, d, base, target.source) for n, d in target.bundles.items()]
    names = {s.name for s in specs}
    for s in specs:
        for m in s.minus:
            if m not in names:
                raise MegagrpoError(f"{target.source}: bundles.{s.name}.minus names {m!r}, not a bundle here")
    return specs


def _fixed(target: Target, name: str) -> bool:
    return any(fnmatch.fnmatch(canonical(name), canonical(p)) for p in target.fixed)


def plan_bundle(
    spec: BundleSpec, target: Target, selections: list[Selection], earlier: dict[str, list[Need]]
):
    """What the bundle carries (`Need`s) and what the node provides, before any download."""
    closure = Closure.load(spec.closure)
    chosen = {s.component: s.chosen for s in selections}
    excluded = {canonical(e) for e in spec.exclude}
    dists = {k: v for k, v in closure.dists.items() if canonical(k) not in excluded}
    fixed = {k for k in dists if _fixed(target, k)}
    needs, provided = subtract_node(dists, target.node_packages, fixed=fixed)
    for name, version in spec.add.items():
        if version.startswith("@"):
            if chosen.get(version[1:]) is None:
                raise MegagrpoError(
                    f"bundles.{spec.name}.add.{name}: component {version[1:]!r} has no selected version"
                )
            version = chosen[version[1:]]
        needs = [n for n in needs if canonical(n.name) != canonical(name)]
        needs.append(Need(name, version, "added by the target spec (GPU-only, not traced on the CPU)"))
    shared = {canonical(n.name) for m in spec.minus for n in earlier.get(m, [])}
    needs = [n for n in needs if canonical(n.name) not in shared]
    return sorted(needs, key=lambda n: canonical(n.name)), provided


def build_bundle(
    spec: BundleSpec,
    target: Target,
    needs: list[Need],
    out: Path,
    cache: Path,
    built_wheels: dict[str, Path],
    carried_elsewhere: Mapping[str, str] | None = None,
    *,
    progress: bool = False,
) -> BundleEntry:
    from megagrpo.bundle.wheels import trim_wheel

    built = {canonical(b) for b in spec.built}
    trims = {canonical(t) for t in [*spec.trim, *spec.drop]}
    why = {canonical(k): v for k, v in spec.why.items()}
    pins = {n.name: n.version for n in needs if canonical(n.name) not in built}
    wheels = download(pins, cache, target.python, target.glibc)
    for b in spec.built:
        w = built_wheels.get(canonical(b))
        if w is None:
            raise MegagrpoError(f"bundle {spec.name} needs the built wheel of {b}: pass it with --wheel PATH")
        want = next(n.version for n in needs if canonical(n.name) == canonical(b))
        if wheel_name_version(w)[1].split("+")[0] != want:
            raise MegagrpoError(f"--wheel {w}: {b} {wheel_name_version(w)[1]}, the bundle needs {want}")
        wheels[canonical(b)] = w
    trimmed = []
    fetched = dict(wheels)  # the wheels as downloaded: their METADATA outlives the trimmed copies
    with tempfile.TemporaryDirectory(prefix=f"megagrpo-bundle-{spec.name}-") as tmp:
        tmp = Path(tmp)
        for name in sorted(trims):
            if name not in wheels:
                raise MegagrpoError(f"bundles.{spec.name}: trims {name}, which the bundle does not carry")
            drop = next((v for k, v in spec.drop.items() if canonical(k) == name), [])
            wheels[name], records = trim_wheel(wheels[name], tmp / "trimmed", target.sm, drop=drop)
            trimmed += records
        installed = install_tree(sorted(wheels.values()), tmp / "tree")
        path = pack_tree(tmp / "tree", out / f"{spec.name}.tar.xz", progress=progress)
    packages = []
    for n in needs:
        c = canonical(n.name)
        reason = n.reason + (f"; members left out: {why[c]}" if c in why else "")
        source = "built" if c in built else "trimmed" if c in trims else "pypi"
        packages.append(PackageEntry(n.name, n.version, reason, source))
    checks = [
        Check("installed", True, f"{len(wheels)} wheels, {installed} bytes installed, packed with xz"),
        requirements_check(spec, target, needs, fetched, carried_elsewhere or {}),
    ]
    entry = BundleEntry.from_file(spec.name, path, target.bundle_limit_bytes, packages, trimmed, checks)
    entry.environment = dict(spec.environment)
    entry.smoke = list(spec.smoke)
    return entry


def wheel_requirements(wheel: Path) -> list[str]:
    """The `Requires-Dist` lines of a wheel's METADATA."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def requirements_check(
    spec: BundleSpec, target: Target, needs: list[Need], wheels: dict[str, Path], elsewhere: Mapping[str, str]
) -> Check:
    """The declared requirements of the packages the spec ADDS (which no trace covered) are met by the
    bundle, the bundles it is installed beside, or the node. Traced packages are proven by the trace: their
    unmet declarations (sglang's FlashInfer, DeepEP) are what the closure leaves out on purpose."""
    from packaging.requirements import Requirement

    have = {canonical(n.name): n.version for n in needs} | {canonical(k): v for k, v in elsewhere.items()}
    node = {canonical(k): v for k, v in target.node_packages.items()}
    added = {canonical(a) for a in spec.add}
    excluded = {canonical(e) for e in spec.exclude}
    env = {"python_version": target.python, "extra": ""}
    unmet = []
    for name in sorted(added & set(wheels)):
        for line in wheel_requirements(wheels[name]):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonical(req.name)
            if _fixed(target, dep) or dep in excluded:
                continue
            version = have.get(dep, node.get(dep, "absent"))
            if version == "absent":
                unmet.append(f"{name} needs {req}: not on the node and in no bundle")
            elif version is not None and not req.specifier.contains(version, prereleases=True):
                unmet.append(f"{name} needs {req}: {version} is there")
    detail = (
        "; ".join(unmet) if unmet else f"the declared requirements of {sorted(added & set(wheels))} are met"
    )
    return Check("requirements", not unmet, detail)
