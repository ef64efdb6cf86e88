"""Rewriting a wheel for the target GPU: its CUDA libraries trimmed to the target's SMs (`trim.py`), whole
members for other GPUs or unused features left out, and `RECORD` written anew so pip installs it.

Streaming: a member is copied through a temporary file only when it is a library to trim (sglang-kernel's
`flash_ops.abi3.so` is 1.1 GB unpacked), every other one straight from the old archive to the new, so at
most one member is ever on disk and none in memory.
"""

from __future__ import annotations

import base64
import csv
import fnmatch
import hashlib
import io
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from megagrpo.bundle.trim import TrimRecord, read_fatbin, trim_library
from megagrpo.errors import MegagrpoError

_LIBRARY = re.compile(r"\.so(\.\d+)*$")
_RECORD = re.compile(r"^[^/]+\.dist-info/RECORD$")
# Signatures of the old RECORD; they cannot hold for the new one.
_SIGNATURES = re.compile(r"^[^/]+\.dist-info/RECORD\.(jws|p7s)$")
_CHUNK = 1 << 20
_LEVEL = 9


def wheel_package(wheel: Path) -> str:
    """The distribution name of a wheel file, normalized (PEP 503): `transformer_engine_cu13-2.12.0-...`
    -> `transformer-engine-cu13`."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def _zipinfo(src: zipfile.ZipInfo) -> zipfile.ZipInfo:
    """A new entry keeping the member's name, date and permissions, deflated at level 9."""
    info = zipfile.ZipInfo(src.filename, date_time=src.date_time)
    info.external_attr = src.external_attr
    info.create_system = src.create_system
    info.compress_type = zipfile.ZIP_DEFLATED
    # ZipFile.open(info, "w") takes the level from the ZipInfo: a public attribute from Python 3.13 on.
    if hasattr(zipfile.ZipInfo, "compress_level"):
        info.compress_level = _LEVEL
    else:
        info._compresslevel = _LEVEL
    return info


def _copy(fin, out: zipfile.ZipFile, info: zipfile.ZipInfo, size_hint: int) -> tuple[str, int]:
    """Stream `fin` into `out` as `info`; the member's RECORD hash (urlsafe base64 sha256, unpadded) and size.
    `size_hint` (the unpacked size) decides ahead whether the entry needs zip64 headers."""
    digest, size = hashlib.sha256(), 0
    with out.open(info, "w", force_zip64=size_hint >= zipfile.ZIP64_LIMIT) as fout:
        for block in iter(lambda: fin.read(_CHUNK), b""):
            digest.update(block)
            fout.write(block)
            size += len(block)
    return "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode(), size


def trim_wheel(
    src_whl: str | Path, dst_dir: str | Path, keep_sm: list[int], drop: list[str] = ()
) -> tuple[Path, list[TrimRecord]]:
    """Write `dst_dir/<same name>`: `src_whl` with every library that has a `.nv_fatbin` section trimmed to
    `keep_sm`, the members matching a glob of `drop` (fnmatch on the path inside the wheel; `*` spans `/`)
    left out, and `*.dist-info/RECORD` recomputed. Returns the new wheel and a record per library trimmed
    or member dropped. A glob that matches nothing is an error: a misspelt one would silently keep the
    member it was meant to remove.
    """
    src, dst_dir = Path(src_whl), Path(dst_dir)
    if not src.is_file():
        raise MegagrpoError(f"{src}: wheel not found; download it with `pip download --no-deps`")
    if not keep_sm:
        raise MegagrpoError(f"trimming {src}: keep_sm is empty; name the target's SM, e.g. [90] for H100")
    dst = dst_dir / src.name
    if dst.resolve() == src.resolve():
        raise MegagrpoError(f"{src}: the trimmed wheel would overwrite it; choose another dst_dir")
    dst_dir.mkdir(parents=True, exist_ok=True)
    package = wheel_package(src)
    records: list[TrimRecord] = []
    rows: list[tuple[str, str, str | int]] = []
    matched = {glob: False for glob in drop}
    dropped: dict[str, tuple[int, int]] = {}  # glob -> (members, bytes)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{src.name}.", suffix=".tmp", dir=dst_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with (
            zipfile.ZipFile(src) as zin,
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=_LEVEL) as zout,
        ):
            members = zin.infolist()
            records_at = [m.filename for m in members if _RECORD.match(m.filename)]
            if len(records_at) != 1:
                raise MegagrpoError(
                    f"{src}: {len(records_at)} `*.dist-info/RECORD` members, expected one; not a wheel"
                )
            for member in members:
                name = member.filename
                if member.is_dir() or name == records_at[0] or _SIGNATURES.match(name):
                    continue
                globs = [g for g in drop if fnmatch.fnmatchcase(name, g)]
                if globs:
                    for g in globs:
                        matched[g] = True
                    # one record per glob: pycountry's locales are a thousand files
                    count, size = dropped.get(globs[0], (0, 0))
                    dropped[globs[0]] = (count + 1, size + member.file_size)
                    continue
                if _LIBRARY.search(name):
                    hashed, record = _trim_member(zin, member, zout, keep_sm, package, dst_dir)
                    if record is not None:
                        records.append(record)
                else:
                    with zin.open(member) as fin:
                        hashed = _copy(fin, zout, _zipinfo(member), member.file_size)
                rows.append((name, *hashed))
            for glob, (count, size) in dropped.items():
                records.append(TrimRecord(package, glob, "removed", (), (), size, 0, members=count))
            unmatched = [g for g, hit in matched.items() if not hit]
            if unmatched:
                raise MegagrpoError(
                    f"{src}: drop globs {unmatched} match no member; fix them (members: "
                    f"{', '.join(m.filename for m in members if _LIBRARY.search(m.filename))} among others)"
                )
            text = io.StringIO()
            writer = csv.writer(text, lineterminator="\n")
            writer.writerows(rows)
            writer.writerow((records_at[0], "", ""))
            info = _zipinfo(zin.getinfo(records_at[0]))
            zout.writestr(info, text.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=_LEVEL)
        tmp.chmod(0o644)  # mkstemp's 0600 would make the wheel unreadable to whoever installs it
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst, records


def _trim_member(
    zin: zipfile.ZipFile,
    member: zipfile.ZipInfo,
    zout: zipfile.ZipFile,
    keep_sm: list[int],
    package: str,
    work_dir: Path,
) -> tuple[tuple[str, int], TrimRecord | None]:
    """Copy one library through a temporary file, trimmed when it has a `.nv_fatbin` section."""
    with tempfile.NamedTemporaryFile(prefix=".member.", dir=work_dir) as tmp:
        with zin.open(member) as fin:
            shutil.copyfileobj(fin, tmp, _CHUNK)
        tmp.flush()
        record = None
        tmp.seek(0)
        # A `.so` member may be a linker script; only an ELF can carry a fatbin.
        if tmp.read(4) == b"\x7fELF" and read_fatbin(tmp.name) is not None:
            record = trim_library(tmp.name, keep_sm, package=package, member=member.filename)
        with open(tmp.name, "rb") as fin:
            return _copy(fin, zout, _zipinfo(member), member.file_size), record
