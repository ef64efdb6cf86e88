"""Trimming a native library to the target's SM architectures by zeroing the fatbin entries for other GPUs.

A CUDA library carries its device code in the ELF section `.nv_fatbin`: a run of fatbin containers, one
per translation unit, each holding one entry per target (an ELF cubin for an SM, or PTX for a virtual
architecture). The driver loads one entry per container, the best match for the GPU it runs on, so the
entries for other GPUs are dead weight: 395 of TE 2.12.0's 488 MB core library. Zeroing their payloads,
headers and every offset untouched, keeps the library's layout (its symbols, relocations and the
runtime's registration pointers into the section) byte-for-byte where it matters, and a run of zeros
compresses to almost nothing in the wheel.

The layout has no public spec; this is read from TE 2.12.0's library (CUDA 13) and sglang-kernel 0.4.6's,
little-endian:

- container header, 16 bytes: magic 0xBA55ED50 (u32), version (u16, 1), header size (u16, 16), size of the
  entries that follow (u64);
- entry header, `header_size` bytes (64, 80, 104 or 112 seen): kind (u16: 1 PTX, 2 cubin), u16 (0x0101),
  header size (u32), payload size (u64, padded to 8), compressed size (u32, 0 when not compressed),
  options offset (u32), version (u16 minor, u16 major), arch (u32: 75, 80, ... 120), name offset/length
  (u32, u32), flags (u64), u64, uncompressed size (u64); the payload follows the header. A container may
  hold two entries of one arch (sglang-kernel's sm90 module has two sm90 cubins per container, likely
  sm_90 and sm_90a); both are kept.

Flag 0x8000 marks a zstd-compressed payload (`28 b5 2f fd`): every PTX entry and 28 of 345 cubins in TE
2.12.0, every entry of sglang-kernel's. 0x2000 is taken to be older CUDA's LZ4 flag (not seen here). The
payload size is then the stored, compressed size, so zeroing is the same operation; compression is only
reported.

Which entries to zero: every entry whose arch is not kept, PTX included, and the PTX of a kept arch that
sits beside that arch's cubin (never JIT-compiled then), but only in a container that keeps some entry of
a kept arch. A container with none (say only sm_80 cubin and compute_80 PTX on an
sm_90 target) is left whole and counted (`containers_untouched`): there the driver JIT-compiles the PTX.

Checked on an H200 (driver 580.159.04) with a library built here by nvcc 13.0 (sm_80 cubin, compute_80
PTX, sm_90 and sm_100 cubins, zstd-compressed, beside a compute_80-only translation unit): trimmed to
[90], its kernel ran from the sm_90 cubin and the other one from the JIT-compiled compute_80 PTX, with
correct results. Zeroing the sm_90 cubin too made the launch fail ("unknown error"), and so did trimming
to [80]: the driver picks an entry by its header and does not fall back to PTX when its payload is zeros.
So `keep_sm` must hold the target GPU's own SM.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from megagrpo.errors import MegagrpoError

FATBIN_SECTION = ".nv_fatbin"
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_CUBIN = 2
_FLAG_COMPRESSED = 0x2000 | 0x8000  # LZ4 (CUDA 11.x to 12.x), zstd (CUDA 12.8 and later)

_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, entries size
_ENTRY = struct.Struct(
    "<HHIQIIHHI"
)  # kind, ?, header size, payload size, compressed size, options, minor, major, arch
_ENTRY_FLAGS_AT = 40  # u64 flags
_ENTRY_MIN_HEADER = 64
_SHT_NOBITS = 8
_SHN_XINDEX = 0xFFFF
_ZERO_CHUNK = 1 << 20


@dataclass(frozen=True)
class TrimRecord:
    """What trimming did to one file, for the manifest.

    For "zeroed-fatbin-entries" the file keeps its size: `bytes_after` is `bytes_before - bytes_zeroed`,
    the bytes still carrying content (zeros compress to nearly nothing). For "removed", `bytes_after` is 0.
    """

    package: str
    member: str  # path inside the wheel; for "removed", the glob of the members left out
    action: str  # "zeroed-fatbin-entries" or "removed"
    kept_sm: tuple[int, ...]
    removed_sm: tuple[int, ...]
    bytes_before: int
    bytes_after: int
    bytes_zeroed: int = 0
    entries_zeroed: int = 0
    entries_kept: int = 0
    containers: int = 0
    containers_untouched: int = 0  # no entry of a kept SM: left whole (the driver may JIT its PTX)
    members: int = 0  # "removed": how many members the glob matched

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FatbinEntry:
    offset: int  # file offset of the entry header
    header_size: int
    payload_size: int
    kind: int  # KIND_PTX or KIND_CUBIN
    sm: int
    compressed: bool

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_size


@dataclass(frozen=True)
class FatbinContainer:
    offset: int  # file offset of the container header
    entries: tuple[FatbinEntry, ...]


def _section(f, path: Path, name: str) -> tuple[int, int] | None:
    """(file offset, size) of ELF64 little-endian section `name`, or None when there is none."""
    ident = f.read(64)
    if len(ident) < 64 or ident[:4] != b"\x7fELF":
        raise MegagrpoError(f"{path}: not an ELF file; only shared libraries can be trimmed")
    if ident[4] != 2 or ident[5] != 1:
        raise MegagrpoError(
            f"{path}: not a 64-bit little-endian ELF; trimming reads only x86_64/aarch64 builds"
        )
    (shoff,) = struct.unpack_from("<Q", ident, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
    if shoff == 0:
        return None
    if shentsize != 64:
        raise MegagrpoError(f"{path}: ELF section header size {shentsize}, expected 64; the file is damaged")

    def header(i: int) -> tuple:
        f.seek(shoff + i * 64)
        raw = f.read(64)
        if len(raw) < 64:
            raise MegagrpoError(
                f"{path}: section header {i} runs past the end of the file; the file is damaged"
            )
        return struct.unpack(
            "<IIQQQQIIQQ", raw
        )  # name, type, flags, addr, offset, size, link, info, align, entsize

    if shnum == 0 or shstrndx == _SHN_XINDEX:  # more than 0xff00 sections: the real values sit in section 0
        first = header(0)
        shnum = shnum or first[5]
        shstrndx = first[6] if shstrndx == _SHN_XINDEX else shstrndx
    headers = [header(i) for i in range(shnum)]
    f.seek(headers[shstrndx][4])
    names = f.read(headers[shstrndx][5])
    wanted = name.encode()
    for sh_name, sh_type, _, _, offset, size, *_ in headers:
        if names[sh_name : names.find(b"\0", sh_name)] == wanted and sh_type != _SHT_NOBITS:
            return offset, size
    return None


def read_fatbin(path: str | Path) -> list[FatbinContainer] | None:
    """The fatbin containers of the library at `path`; None when it has no `.nv_fatbin` section.

    Reads only the headers (a few KB of a 460 MB section), seeking over the payloads.
    """
    path = Path(path)
    with path.open("rb") as f:
        found = _section(f, path, FATBIN_SECTION)
        if found is None:
            return None
        start, size = found
        end = start + size
        containers: list[FatbinContainer] = []
        pos = start
        while pos + _CONTAINER.size <= end:
            f.seek(pos)
            magic, _version, header_size, entries_size = _CONTAINER.unpack(f.read(_CONTAINER.size))
            if magic != FATBIN_MAGIC:
                if magic == 0:  # alignment padding between containers
                    pos += 8
                    continue
                raise MegagrpoError(
                    f"{path}: no fatbin container magic at section offset {pos - start:#x} ({magic:#010x}); "
                    "this fatbin layout is not one trimming knows, so ship the library untrimmed"
                )
            entries: list[FatbinEntry] = []
            entry, stop = pos + header_size, pos + header_size + entries_size
            if stop > end:
                raise MegagrpoError(
                    f"{path}: fatbin container at {pos:#x} runs past its section; the file is damaged"
                )
            while entry < stop:
                f.seek(entry)
                raw = f.read(_ENTRY_MIN_HEADER)
                kind, _, ehsize, payload, _, _, _, _, sm = _ENTRY.unpack_from(raw)
                (flags,) = struct.unpack_from("<Q", raw, _ENTRY_FLAGS_AT)
                if ehsize < _ENTRY_MIN_HEADER or entry + ehsize + payload > stop:
                    raise MegagrpoError(
                        f"{path}: fatbin entry at {entry:#x} (header {ehsize} bytes, payload {payload}) does not "
                        "fit its container; this fatbin layout is not one trimming knows, so ship it untrimmed"
                    )
                entries.append(FatbinEntry(entry, ehsize, payload, kind, sm, bool(flags & _FLAG_COMPRESSED)))
                entry += ehsize + payload
            containers.append(FatbinContainer(pos, tuple(entries)))
            pos = stop
    return containers


def _zero(f, offset: int, size: int) -> None:
    f.seek(offset)
    zeros = bytes(min(size, _ZERO_CHUNK))
    while size > 0:
        n = min(size, len(zeros))
        f.write(zeros[:n] if n < len(zeros) else zeros)
        size -= n


def trim_library(
    path: str | Path,
    keep_sm: list[int],
    *,
    package: str = "",
    member: str | None = None,
    covered_ptx: bool = False,
) -> TrimRecord:
    """Zero, in place, the payload of every fatbin entry of `path` whose SM is not in `keep_sm`, and (unless
    `covered_ptx`) the PTX of a kept SM in a container that also holds that SM's cubin: the driver runs a
    matching cubin and JIT-compiles PTX only when none matches, so that PTX is never read on the target.
    TE 2.12's core keeps 55 such PTX entries for sm_90 (10.8 MB, already zstd-compressed, so xz cannot
    shrink them): half of the trimmed learner bundle.

    Headers, offsets and the file size stay; a container with no entry of a kept SM is left whole (module
    docstring). `package` and `member` only label the record (`member` defaults to the file name).
    """
    path = Path(path)
    keep = tuple(sorted(set(keep_sm)))
    if not keep:
        raise MegagrpoError(f"trimming {path}: keep_sm is empty; name the target's SM, e.g. [90] for H100")
    if not path.is_file():
        raise MegagrpoError(f"{path}: library to trim not found; unpack it from its wheel first")
    containers = read_fatbin(path)
    if containers is None:
        raise MegagrpoError(
            f"{path}: has no {FATBIN_SECTION} section, so there is nothing to trim; leave it as is"
        )
    removed: set[int] = set()
    zeroed_bytes = zeroed = kept = untouched = 0
    with path.open("r+b") as f:
        for container in containers:
            if not any(e.sm in keep for e in container.entries):
                untouched += 1
                kept += len(container.entries)
                continue
            cubins = {e.sm for e in container.entries if e.kind == KIND_CUBIN}
            for e in container.entries:
                redundant = not covered_ptx and e.kind == KIND_PTX and e.sm in cubins
                if e.sm in keep and not redundant:
                    kept += 1
                    continue
                _zero(f, e.payload_offset, e.payload_size)
                if e.sm not in keep:
                    removed.add(e.sm)
                zeroed += 1
                zeroed_bytes += e.payload_size
    size = path.stat().st_size
    return TrimRecord(
        package=package,
        member=member if member is not None else path.name,
        action="zeroed-fatbin-entries",
        kept_sm=keep,
        removed_sm=tuple(sorted(removed)),
        bytes_before=size,
        bytes_after=size - zeroed_bytes,
        bytes_zeroed=zeroed_bytes,
        entries_zeroed=zeroed,
        entries_kept=kept,
        containers=len(containers),
        containers_untouched=untouched,
    )
