"""The node a bundle is built for, as a JSON spec:

    {"name": "torch-2.11.0-cu130-sm90", "torch": "2.11.0+cu130", "cuda_major": 13, "python": "3.12",
     "sm": [90], "bundle_limit_mib": 64,
     "provided": ["nvidia-cublas-13.1.0.3.json", ...],          # tables of the node's libraries
     "components": {"transformer-engine": ["te-2.12.0.json", ...]}}  # candidates' tables

Table paths are relative to the spec's folder. `provided` describes what the node already has, which is
torch's own pinned CUDA wheels on a node with a PyPI torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megagrpo.bundle.files import read_json
from megagrpo.bundle.tables import PackageTables
from megagrpo.errors import MegagrpoError

MIB = 1 << 20
_FIELDS = {
    "name",
    "torch",
    "cuda_major",
    "python",
    "sm",
    "bundle_limit_mib",
    "provided",
    "components",
    "note",
    "node_packages",
    "fixed",
    "bundles",
    "glibc",
}


@dataclass
class Target:
    name: str
    torch: str
    cuda_major: int
    python: str
    sm: list[int]
    provided: list[Path]
    components: dict[str, list[Path]]
    bundle_limit_mib: int = 64
    source: str = ""
    glibc: str = "2.28"  # the node's glibc: which manylinux wheels it runs (`ldd --version` there)
    # What the node already has (name -> version, None where unknown): a bundle carries only the rest.
    node_packages: dict[str, str | None] = field(default_factory=dict)
    fixed: list[str] = field(default_factory=list)  # site packages never replaced (globs): torch, nvidia-*
    bundles: dict[str, dict] = field(default_factory=dict)  # per bundle, see megagrpo/bundle/build.py

    @property
    def bundle_limit_bytes(self) -> int:
        return self.bundle_limit_mib * MIB

    def provided_tables(self) -> list[PackageTables]:
        return [PackageTables.load(p) for p in self.provided]

    def candidate_tables(self, component: str) -> list[PackageTables]:
        return [PackageTables.load(p) for p in self.components[component]]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "torch": self.torch,
            "cuda_major": self.cuda_major,
            "python": self.python,
            "sm": self.sm,
            "bundle_limit_mib": self.bundle_limit_mib,
        }

    @classmethod
    def load(cls, path: str | Path) -> Target:
        path = Path(path)
        data = read_json(path, "no such target spec (see megagrpo/bundle/target.py for its fields)")
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise MegagrpoError(f"{path}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
        for key, kind in (("name", str), ("torch", str), ("cuda_major", int), ("python", str)):
            if not isinstance(data.get(key), kind):
                raise MegagrpoError(f"{path}: field {key!r} must be a {kind.__name__}, e.g. the node's value")
        sm = data.get("sm")
        if not (isinstance(sm, list) and sm and all(isinstance(a, int) for a in sm)):
            raise MegagrpoError(f"{path}: field 'sm' must be a non-empty list of SM numbers, e.g. [90]")
        base = path.parent
        provided = data.get("provided") or []
        if not provided:
            raise MegagrpoError(f"{path}: field 'provided' lists no symbol table of the node's libraries")
        components = data.get("components") or {}
        if not components:
            raise MegagrpoError(f"{path}: field 'components' names no component with candidate tables")
        return cls(
            name=data["name"],
            torch=data["torch"],
            cuda_major=data["cuda_major"],
            python=data["python"],
            sm=sm,
            provided=[base / p for p in provided],
            components={c: [base / p for p in paths] for c, paths in components.items()},
            bundle_limit_mib=int(data.get("bundle_limit_mib", 64)),
            source=str(path),
            glibc=str(data.get("glibc", "2.28")),
            node_packages=dict(data.get("node_packages") or {}),
            fixed=list(data.get("fixed") or []),
            bundles=dict(data.get("bundles") or {}),
        )
