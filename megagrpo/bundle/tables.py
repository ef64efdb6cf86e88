"""Symbol tables recorded once from real wheels, as small JSON files, so that selection runs (and is tested)
without the wheels.

One file per wheel (format `megagrpo.symbols/1`):

    {"format": "megagrpo.symbols/1", "package": "transformer-engine-cu13", "version": "2.12.0",
     "wheel": "<file name>", "wheel_bytes": N, "wheel_sha256": "...", "reader": "<nm --version>",
     "libraries": {"<member path in the wheel>": {
         "soname": "libtransformer_engine.so", "needed": [DT_NEEDED...],
         "version_definitions": ["libcublasLt.so.13"],
         "defined": {"<tag>": [names]},   # default definitions (name@@tag); "" = unversioned
         "hidden": {"<tag>": [names]},    # name@tag definitions: only a reference with that tag binds them
         "undefined": {"<tag>": [names]}, # references; "" = unversioned
         "weak_undefined": ["name[@tag]"],  # may stay unresolved: the loader sets them to 0
         "dropped_undefined": {"GLIBC_2.2.5": 76, ...}}}}

References tagged by the C/C++ runtime (glibc, libstdc++, libgcc) are counted, not listed: whether they
resolve depends on the node's glibc and compiler runtime, not on the torch/CUDA libraries this selection is
about, and listing them would multiply the size of every table.
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from megagrpo.bundle.elf import DynamicInfo, read_dynamic
from megagrpo.bundle.files import read_json, sha256_file
from megagrpo.errors import MegagrpoError

FORMAT = "megagrpo.symbols/1"
UNVERSIONED = ""  # the key of unversioned symbols in the tag -> names maps
# Version tags of the C and C++ runtimes, resolved by the node's system libraries.
SYSTEM_TAG_PREFIXES = ("GLIBC_", "GLIBCXX_", "CXXABI_", "GCC_")
# Sonames the node's C/C++ runtime provides; never part of a bundle or of the target's recorded libraries.
SYSTEM_SONAMES = frozenset(
    {
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "libpthread.so.0",
        "librt.so.1",
        "libgcc_s.so.1",
        "libstdc++.so.6",
        "ld-linux-x86-64.so.2",
    }
)


def is_system_tag(tag: str) -> bool:
    return tag.startswith(SYSTEM_TAG_PREFIXES)


def _group(pairs) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tag, name in pairs:
        out.setdefault(tag, []).append(name)
    return {tag: sorted(set(names)) for tag, names in sorted(out.items())}


@dataclass
class LibraryTable:
    """The dynamic symbols of one shared library, as the loader sees them."""

    soname: str | None
    needed: list[str] = field(default_factory=list)
    version_definitions: list[str] = field(default_factory=list)
    defined: dict[str, list[str]] = field(default_factory=dict)
    hidden: dict[str, list[str]] = field(default_factory=dict)
    undefined: dict[str, list[str]] = field(default_factory=dict)
    weak_undefined: list[str] = field(default_factory=list)
    dropped_undefined: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dynamic(cls, info: DynamicInfo) -> LibraryTable:
        defined = [s for s in info.defined if s.default]
        hidden = [s for s in info.defined if not s.default]
        strong = [s for s in info.undefined if not s.weak]
        kept = [s for s in strong if s.version is None or not is_system_tag(s.version)]
        dropped = Counter(s.version for s in strong if s.version is not None and is_system_tag(s.version))
        return cls(
            soname=info.soname,
            needed=list(info.needed),
            version_definitions=sorted(set(info.version_definitions)),
            defined=_group((s.version or UNVERSIONED, s.name) for s in defined),
            hidden=_group((s.version or UNVERSIONED, s.name) for s in hidden),
            undefined=_group((s.version or UNVERSIONED, s.name) for s in kept),
            weak_undefined=sorted({str(s) for s in info.undefined if s.weak}),
            dropped_undefined=dict(sorted(dropped.items())),
        )

    def references(self) -> list[tuple[str, str | None]]:
        """Every listed (strong) reference as (name, tag or None)."""
        return [(name, tag or None) for tag, names in sorted(self.undefined.items()) for name in names]

    def to_json(self) -> dict:
        return {
            "soname": self.soname,
            "needed": self.needed,
            "version_definitions": self.version_definitions,
            "defined": self.defined,
            "hidden": self.hidden,
            "undefined": self.undefined,
            "weak_undefined": self.weak_undefined,
            "dropped_undefined": self.dropped_undefined,
        }

    @classmethod
    def from_json(cls, data: dict) -> LibraryTable:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class PackageTables:
    """A wheel's native libraries, keyed by their path inside the wheel."""

    package: str
    version: str
    libraries: dict[str, LibraryTable]
    wheel: str = ""
    wheel_bytes: int = 0
    wheel_sha256: str = ""
    reader: str = ""
    source: str = ""  # the file it was loaded from, for messages

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "package": self.package,
            "version": self.version,
            "wheel": self.wheel,
            "wheel_bytes": self.wheel_bytes,
            "wheel_sha256": self.wheel_sha256,
            "reader": self.reader,
            "libraries": {member: lib.to_json() for member, lib in sorted(self.libraries.items())},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")
        return path

    def referenced(self) -> set[str]:
        """Every name any library of this wheel references (tag ignored)."""
        return {name for lib in self.libraries.values() for names in lib.undefined.values() for name in names}

    def restricted(self, keep: set[str], *, references: bool = True) -> PackageTables:
        """The same tables with definitions limited to `keep` (and references dropped unless `references`).

        Sound for selection: a definition no candidate references can decide nothing. It is what makes
        torch's libraries recordable (libtorch_cpu.so alone exports over a hundred thousand C++ symbols)
        and a candidate's own table small (its exports matter only to its own references)."""
        libs = {}
        for member, lib in self.libraries.items():
            libs[member] = LibraryTable(
                soname=lib.soname,
                needed=lib.needed,
                version_definitions=lib.version_definitions,
                defined={t: kept for t, n in lib.defined.items() if (kept := [x for x in n if x in keep])},
                hidden={t: kept for t, n in lib.hidden.items() if (kept := [x for x in n if x in keep])},
                undefined=lib.undefined if references else {},
                weak_undefined=lib.weak_undefined if references else [],
                dropped_undefined=lib.dropped_undefined if references else {},
            )
        return PackageTables(self.package, self.version, libs, self.wheel, self.wheel_bytes, self.wheel_sha256,
                             self.reader)  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> PackageTables:
        path = Path(path)
        data = read_json(path, "no such symbol table; record one with `tools/gpu_bundle.py record WHEEL`")
        if data.get("format") != FORMAT:
            raise MegagrpoError(
                f"{path}: format {data.get('format')!r}, expected {FORMAT!r}; record it again "
                "with `tools/gpu_bundle.py record WHEEL`"
            )
        return cls(
            package=data["package"],
            version=data["version"],
            libraries={m: LibraryTable.from_json(lib) for m, lib in data["libraries"].items()},
            wheel=data.get("wheel", ""),
            wheel_bytes=data.get("wheel_bytes", 0),
            wheel_sha256=data.get("wheel_sha256", ""),
            reader=data.get("reader", ""),
            source=str(path),
        )


def _is_shared_library(member: str) -> bool:
    name = member.rsplit("/", 1)[-1]
    return name.endswith(".so") or ".so." in name


def _reader_version() -> str:
    out = subprocess.run(["nm", "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0].strip() if out else "nm"


def record_wheel(
    wheel: str | Path, members: list[str] | None = None, workdir: str | Path | None = None
) -> PackageTables:
    """The symbol tables of a wheel's shared libraries (or of those whose member path matches one of the
    `members` globs). Each library is extracted to a temporary directory, read, and removed: a CUDA
    library can be half a gigabyte unpacked."""
    wheel = Path(wheel)
    try:
        name, version, _, _ = parse_wheel_filename(wheel.name)
    except ValueError as e:
        raise MegagrpoError(f"{wheel}: not a wheel file name ({e})") from None
    libraries: dict[str, LibraryTable] = {}
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(dir=workdir) as tmp:
        chosen = [
            m
            for m in zf.namelist()
            if _is_shared_library(m) and (not members or any(fnmatch.fnmatch(m, g) for g in members))
        ]
        if not chosen:
            raise MegagrpoError(
                f"{wheel}: no shared library matches {members or '*.so*'}; list them with `unzip -l`"
            )
        for member in chosen:
            extracted = Path(zf.extract(member, tmp))
            libraries[member] = LibraryTable.from_dynamic(read_dynamic(extracted))
            extracted.unlink()
    return PackageTables(
        package=str(canonicalize_name(name)),
        version=str(version),
        libraries=libraries,
        wheel=wheel.name,
        wheel_bytes=wheel.stat().st_size,
        wheel_sha256=sha256_file(wheel),
        reader=_reader_version(),
    )
