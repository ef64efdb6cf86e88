"""Which candidate version loads on the target: every reference of its native libraries must resolve in the
libraries the target provides (or in the candidate's own libraries), decided from symbol tables alone.

The rules are the dynamic loader's:
- a reference `name@tag` binds only to a definition of `name` carrying `tag` (default `@@` or hidden `@`),
  wherever it is; the library that defines version `tag` is the one that must define `name`;
- an unversioned reference binds to a default or unversioned definition in any loaded library;
- a weak reference may stay unresolved.
A tag no recorded library defines is either the C/C++ runtime's (dropped when recording) or a library whose
table the target did not record (e.g. cuDNN): those references are counted as unchecked, by tag, and a
candidate with any is not picked unless the caller allows it.

Two providers are the node's own and on no wheel: the Python interpreter (a torch extension's `Py*`
references bind to the running `python`) and the NVIDIA driver (`cu*` references of a library that needs
`libcuda.so.1`). Unversioned references they define are counted by provider (`node_runtime`), not checked:
both exist on any node that runs torch on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from megagrpo.bundle.tables import SYSTEM_SONAMES, UNVERSIONED, PackageTables
from megagrpo.errors import MegagrpoError


@dataclass(frozen=True)
class Missing:
    """A reference that nothing the target provides resolves."""

    library: str  # the candidate's library (its member path in the wheel)
    symbol: str  # name@tag, or name when unversioned
    provider: str | None  # the soname that defines the tag, when the tag is known

    def __str__(self) -> str:
        where = f" (not defined by {self.provider})" if self.provider else " (defined by no provided library)"
        return f"{self.symbol}{where}, needed by {self.library}"


@dataclass
class Verdict:
    """Whether one candidate's native libraries resolve on the target."""

    package: str
    version: str
    missing: list[Missing] = field(default_factory=list)
    resolved: int = 0  # references checked and found
    unchecked: dict[str, int] = field(default_factory=dict)  # tag -> references with no recorded provider
    unrecorded_needed: list[str] = field(default_factory=list)  # DT_NEEDED with no table, system libs aside
    node_runtime: dict[str, int] = field(default_factory=dict)  # provider -> references left to the node

    @property
    def resolves(self) -> bool:
        """No reference is known to be missing."""
        return not self.missing

    @property
    def proven(self) -> bool:
        """Every reference was checked and found: none missing, none without a recorded provider."""
        return not self.missing and not self.unchecked

    @property
    def first_missing(self) -> Missing | None:
        return self.missing[0] if self.missing else None

    def describe(self) -> str:
        head = f"{self.package} {self.version}: "
        if self.resolves:
            text = head + f"resolves ({self.resolved} references checked)"
        else:
            text = head + f"rejected, {len(self.missing)} missing; first: {self.first_missing}"
        if self.node_runtime:
            text += "; left to the node: " + ", ".join(
                f"{p} ({n})" for p, n in sorted(self.node_runtime.items())
            )
        if self.unchecked:
            tags = ", ".join(f"{tag} ({n})" for tag, n in sorted(self.unchecked.items()))
            text += (
                f"; unproven: no table recorded for the libraries defining {tags} (references); add "
                "their tables to the target's 'provided'"
            )
        return text

    def to_json(self) -> dict:
        return {
            "package": self.package,
            "version": self.version,
            "resolves": self.resolves,
            "proven": self.proven,
            "resolved": self.resolved,
            "missing": [
                {"library": m.library, "symbol": m.symbol, "provider": m.provider} for m in self.missing
            ],
            "unchecked": self.unchecked,
            "unrecorded_needed": self.unrecorded_needed,
            "node_runtime": self.node_runtime,
        }


class Provided:
    """The definitions a set of libraries makes available to the loader."""

    def __init__(self, tables: list[PackageTables]):
        self.by_tag: dict[str, tuple[str, set[str]]] = {}  # tag -> (soname defining it, names)
        self.unversioned: set[str] = set()  # names an unversioned reference can bind to
        self.sonames: set[str] = set()
        for pkg in tables:
            for member, lib in pkg.libraries.items():
                soname = lib.soname or member.rsplit("/", 1)[-1]
                self.sonames.add(soname)
                for tag in lib.version_definitions:
                    self.by_tag.setdefault(tag, (soname, set()))
                for group, default in ((lib.defined, True), (lib.hidden, False)):
                    for tag, names in group.items():
                        if tag != UNVERSIONED:
                            self.by_tag.setdefault(tag, (soname, set()))[1].update(names)
                        if default:
                            self.unversioned.update(names)

    def with_own(self, candidate: PackageTables) -> Provided:
        """These definitions plus the candidate's own: a wheel's libraries resolve among themselves.

        A tag both define (a wheel shipping its own copy of a library the target has) gets the union of
        their names, which is permissive: the loader would use whichever copy it loaded first."""
        merged = Provided([candidate])
        for tag, (soname, names) in self.by_tag.items():
            merged.by_tag.setdefault(tag, (soname, set()))[1].update(names)
        merged.unversioned |= self.unversioned
        merged.sonames |= self.sonames
        return merged


DRIVER = "libcuda.so.1"


def node_runtime_provider(name: str, needed: list[str]) -> str | None:
    """'python' or the driver's soname for an unversioned reference the node itself resolves, else None."""
    if name.startswith(("Py", "_Py")):
        return "python"
    if name.startswith("cu") and DRIVER in needed:
        return DRIVER
    return None


def check(candidate: PackageTables, provided: Provided) -> Verdict:
    """Every strong reference of every native library of `candidate`, against `provided` and itself."""
    scope = provided.with_own(candidate)
    verdict = Verdict(candidate.package, candidate.version)
    unchecked: dict[str, int] = {}
    for member, lib in sorted(candidate.libraries.items()):
        for soname in lib.needed:
            known = soname in scope.sonames or soname in SYSTEM_SONAMES
            if not known and soname not in verdict.unrecorded_needed:
                verdict.unrecorded_needed.append(soname)
        for name, tag in lib.references():
            if tag is None:
                if name in scope.unversioned:
                    verdict.resolved += 1
                elif (runtime := node_runtime_provider(name, lib.needed)) is not None:
                    verdict.node_runtime[runtime] = verdict.node_runtime.get(runtime, 0) + 1
                else:
                    verdict.missing.append(Missing(member, name, None))
            elif tag in scope.by_tag:
                soname, names = scope.by_tag[tag]
                if name in names:
                    verdict.resolved += 1
                else:
                    verdict.missing.append(Missing(member, f"{name}@{tag}", soname))
            else:
                unchecked[tag] = unchecked.get(tag, 0) + 1
    verdict.unchecked = dict(sorted(unchecked.items()))
    return verdict


@dataclass
class Selection:
    """The verdicts of one component's candidates, newest first, and the newest that loads."""

    component: str
    verdicts: list[Verdict]
    chosen: str | None  # the version picked; None when no candidate is shown to load

    def describe(self) -> str:
        lines = [f"{self.component}:"] + [f"  {v.describe()}" for v in self.verdicts]
        pick = self.chosen if self.chosen is not None else "no candidate is shown to load on this target"
        lines.append(f"  -> {pick}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "component": self.component,
            "chosen": self.chosen,
            "verdicts": [v.to_json() for v in self.verdicts],
        }


def _version(pkg: PackageTables) -> Version:
    try:
        return Version(pkg.version)
    except InvalidVersion:
        raise MegagrpoError(
            f"{pkg.source or pkg.label}: version {pkg.version!r} is not a PEP 440 version; record the "
            "table from the wheel, whose file name carries the version"
        ) from None


def select_newest(
    component: str, candidates: list[PackageTables], provided: Provided, allow_unchecked: bool = False
) -> Selection:
    """Check every candidate (so each rejected one names what it lacks) and pick the newest whose every
    reference is found; with `allow_unchecked`, references to libraries without a recorded table are
    let through (the verdicts still count them)."""
    if not candidates:
        raise MegagrpoError(f"component {component!r} has no candidate symbol tables; record some first")
    ordered = sorted(candidates, key=_version, reverse=True)
    seen: dict[Version, PackageTables] = {}
    for pkg in ordered:
        v = _version(pkg)
        if v in seen:
            raise MegagrpoError(
                f"component {component!r}: version {pkg.version} is given twice "
                f"({seen[v].source} and {pkg.source}); keep one"
            )
        seen[v] = pkg
    verdicts = [check(pkg, provided) for pkg in ordered]
    chosen = next((v.version for v in verdicts if v.proven or (allow_unchecked and v.resolves)), None)
    return Selection(component, verdicts, chosen)
