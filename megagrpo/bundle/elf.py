"""The dynamic symbols of an ELF shared library, with their version tags, read with GNU binutils.

A versioned reference `cublasLtMatmul@libcublasLt.so.13` binds only to a definition carrying that tag, so
whether a library loads beside another is a question its symbol tables answer without loading it. `nm -D
--with-symbol-versions` prints each dynamic symbol with its tag (`@@` marks a default definition, `@` a
hidden one or a reference); `readelf -d` gives the soname and DT_NEEDED.

pyelftools would avoid the binutils dependency; it is not installed in this environment, so binutils it is.
An `nm` too old to print the tags of undefined symbols would make every reference look unversioned: that is
detected (the library has a version-needs table but no reference carries a tag) and refused.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from megagrpo.errors import MegagrpoError

# nm's types with no address: U undefined, w/v weak undefined (an absent weak symbol resolves to 0).
_UNDEFINED_TYPES = frozenset("Uwv")
_WEAK_TYPES = frozenset("wv")
# "A": the name of a version definition (e.g. `libcublasLt.so.13`), an absolute symbol of value 0.
_VERSION_MARKER = "A"


@dataclass(frozen=True)
class DynSymbol:
    """One entry of `.dynsym`."""

    name: str
    version: str | None  # the version tag; None when unversioned
    defined: bool
    weak: bool = False
    default: bool = True  # a definition `name@@tag`; False for `name@tag`, which only tagged references bind

    def __str__(self) -> str:
        if self.version is None:
            return self.name
        sep = "@@" if self.defined and self.default else "@"
        return f"{self.name}{sep}{self.version}"


@dataclass(frozen=True)
class DynamicInfo:
    """What the dynamic loader reads from a shared library."""

    path: str
    soname: str | None
    needed: tuple[str, ...]
    version_definitions: tuple[str, ...]
    symbols: tuple[DynSymbol, ...]

    @property
    def defined(self) -> tuple[DynSymbol, ...]:
        return tuple(s for s in self.symbols if s.defined)

    @property
    def undefined(self) -> tuple[DynSymbol, ...]:
        return tuple(s for s in self.symbols if not s.defined)


def split_version(text: str) -> tuple[str, str | None, bool]:
    """`name@@tag` -> (name, tag, True); `name@tag` -> (name, tag, False); `name` -> (name, None, True)."""
    name, sep, version = text.partition("@")
    if not sep:
        return name, None, True
    if version.startswith("@"):
        return name, version[1:], True
    return name, version, False


def parse_nm(text: str) -> tuple[list[DynSymbol], list[str]]:
    """The symbols and the version-definition names in `nm -D --with-symbol-versions` output."""
    symbols: list[DynSymbol] = []
    markers: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3:
            _, kind, raw = fields
        elif len(fields) == 2:
            kind, raw = fields
        else:
            continue  # blank lines, "nm: ... no symbols"
        name, version, default = split_version(raw)
        if kind == _VERSION_MARKER:
            markers.append(name)
            continue
        defined = kind not in _UNDEFINED_TYPES
        # `@` vs `@@` only distinguishes definitions; a reference is printed with `@` either way
        default = default or not defined
        symbols.append(DynSymbol(name, version, defined, weak=kind in _WEAK_TYPES, default=default))
    return symbols, markers


_DYNAMIC_RE = re.compile(r"\((NEEDED|SONAME)\)\s+[^\[]*\[([^\]]+)\]")


def parse_readelf_dynamic(text: str) -> tuple[str | None, list[str], bool]:
    """(soname, DT_NEEDED in order, whether a version-needs table exists) from `readelf -d` output."""
    soname = None
    needed: list[str] = []
    for tag, value in _DYNAMIC_RE.findall(text):
        if tag == "SONAME":
            soname = value
        else:
            needed.append(value)
    return soname, needed, "(VERNEED)" in text


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise MegagrpoError(
            f"`{name}` (GNU binutils) is not on PATH; reading symbol tables needs it. "
            "Install binutils (e.g. `apt-get install binutils`)."
        )
    return path


def _run(cmd: list[str], path: Path) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MegagrpoError(
            f"{path}: `{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}` failed "
            f"({result.stderr.strip() or f'exit {result.returncode}'}); is it an ELF shared library?"
        )
    return result.stdout


def read_dynamic(path: str | Path) -> DynamicInfo:
    """The soname, DT_NEEDED, version definitions and dynamic symbols of the shared library at `path`."""
    path = Path(path)
    if not path.is_file():
        raise MegagrpoError(f"{path}: no such file; give the path of a shared library (.so)")
    dynamic = _run([_tool("readelf"), "-d", "--wide", str(path)], path)
    soname, needed, has_verneed = parse_readelf_dynamic(dynamic)
    symbols, markers = parse_nm(_run([_tool("nm"), "-D", "--with-symbol-versions", str(path)], path))
    tagged_refs = any(s.version is not None for s in symbols if not s.defined)
    if has_verneed and not tagged_refs:
        raise MegagrpoError(
            f"{path} needs versioned symbols, but `nm` printed no version on any undefined symbol: this "
            "binutils is too old to read references' versions. Use a newer binutils (this was written against 2.40)."
        )
    return DynamicInfo(str(path), soname, tuple(needed), tuple(markers), tuple(symbols))
