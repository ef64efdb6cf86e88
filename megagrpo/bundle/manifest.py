"""The manifest of a set of bundles: the target, the version selection, and per bundle its file, size,
hash, packages, what was trimmed, and the checks it passed (`megagrpo.manifest/1`, written as JSON).

A check records what was verified and how; a failed one is kept, not dropped, so a manifest never claims
more than was shown.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from megagrpo.bundle.files import sha256_file
from megagrpo.bundle.resolve import Selection
from megagrpo.bundle.target import MIB, Target
from megagrpo.bundle.trim import TrimRecord
from megagrpo.errors import MegagrpoError

FORMAT = "megagrpo.manifest/1"


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str

    def to_json(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclass(frozen=True)
class PackageEntry:
    name: str
    version: str
    reason: str  # why the bundle carries it: "not on the node", "node has 5.17.0; sglang needs ==5.19.0", ...
    source: str  # "pypi" (the official wheel), "built" (e.g. the TE torch binding), "trimmed"

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "source": self.source, "reason": self.reason}


@dataclass
class BundleEntry:
    name: str  # "learner" or "engine"
    file: str
    bytes: int
    sha256: str
    packages: list[PackageEntry] = field(default_factory=list)
    trimmed: list[TrimRecord] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)  # for the node's env file (bundle.install)
    smoke: list[str] = field(default_factory=list)  # modules the node's smoke check imports

    @classmethod
    def from_file(
        cls,
        name: str,
        path: str | Path,
        limit_bytes: int,
        packages: list[PackageEntry] = (),
        trimmed: list[TrimRecord] = (),
        checks: list[Check] = (),
    ) -> BundleEntry:
        """The entry of the bundle file at `path`, its size measured and checked against `limit_bytes`."""
        path = Path(path)
        if not path.is_file():
            raise MegagrpoError(f"{path}: bundle file not found; build the bundle before its manifest")
        size = path.stat().st_size
        size_check = Check(
            "size",
            size <= limit_bytes,
            f"{size} bytes ({size / MIB:.1f} MiB), limit {limit_bytes} bytes ({limit_bytes / MIB:.0f} MiB)",
        )
        return cls(
            name, path.name, size, sha256_file(path), list(packages), list(trimmed), [size_check, *checks]
        )

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "file": self.file,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "passed": self.passed,
            "packages": [p.to_json() for p in self.packages],
            "trimmed": [t.to_json() for t in self.trimmed],
            "checks": [c.to_json() for c in self.checks],
            "environment": self.environment,
            "smoke": self.smoke,
        }


def selection_checks(selections: list[Selection]) -> list[Check]:
    """One check per component: a version whose libraries resolve on the target was found."""
    checks = []
    for s in selections:
        if s.chosen is None:
            checks.append(
                Check(f"symbols:{s.component}", False, "no candidate is shown to resolve on the target")
            )
            continue
        chosen = next(v for v in s.verdicts if v.version == s.chosen)
        detail = f"{chosen.package} {chosen.version}: {chosen.resolved} references resolve"
        if chosen.node_runtime:
            detail += "; left to the node: " + ", ".join(
                f"{p} ({n})" for p, n in sorted(chosen.node_runtime.items())
            )
        if chosen.unchecked:
            detail += "; unchecked (no table): " + ", ".join(
                f"{t} ({n})" for t, n in sorted(chosen.unchecked.items())
            )
        checks.append(Check(f"symbols:{s.component}", True, detail))
    return checks


@dataclass
class Manifest:
    target: Target
    selections: list[Selection]
    bundles: list[BundleEntry] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    keep: list[dict] = field(default_factory=list)  # entries of bundles built earlier, kept as written

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "created": self.created,
            "target": self.target.to_json(),
            "selection": [s.to_json() for s in self.selections],
            "checks": [c.to_json() for c in selection_checks(self.selections)],
            "bundles": [*self.keep, *(b.to_json() for b in self.bundles)],
        }

    def write(self, path: str | Path) -> Path:
        """Write atomically: a reader never sees half a manifest."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path
