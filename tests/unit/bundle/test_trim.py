"""Issue 28: trimming a CUDA library's fatbin to the target's SMs (`trim.py`) and rewriting a wheel around it
(`wheels.py`), on a synthetic ELF64 whose `.nv_fatbin` section is written here byte by byte."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import struct
import zipfile

import pytest

from megagrpo.bundle.trim import FATBIN_MAGIC, KIND_CUBIN, KIND_PTX, read_fatbin, trim_library
from megagrpo.bundle.wheels import trim_wheel, wheel_package
from megagrpo.errors import MegagrpoError

ZSTD = 0x8000


def entry(kind: int, sm: int, payload: bytes, flags: int = 0x11) -> bytes:
    """A 64-byte entry header (layout in trim.py's docstring) and its payload, padded to 8."""
    payload += bytes(-len(payload) % 8)
    compressed = len(payload) if flags & ZSTD else 0
    header = struct.pack(
        "<HHIQIIHHIIIQQQ", kind, 0x0101, 64, len(payload), compressed, 0, 8, 1, sm, 0, 0, flags, 0, 0
    )
    assert len(header) == 64
    return header + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(sections: dict[str, bytes]) -> bytes:
    """An ELF64 little-endian file holding `sections` (PROGBITS) and `.shstrtab`; no program headers."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    data, headers, offset = b"", [bytes(64)], 64
    for name, body in [*sections.items(), (".shstrtab", names)]:
        sh_type = 3 if name == ".shstrtab" else 1
        name_at = names.index(name.encode() + b"\0")
        headers.append(
            struct.pack("<IIQQQQIIQQ", name_at, sh_type, 0, 0, offset + len(data), len(body), 0, 0, 8, 0)
        )
        data += body + bytes(-len(body) % 8)
    shoff = 64 + len(data)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1
    )
    assert len(header) == 64
    return header + data + b"".join(headers)


PTX80, CUBIN80, CUBIN90 = b"P" * 40, b"\x7fELF" + b"8" * 60, b"\x7fELF" + b"9" * 52
LONE80, LONE_PTX80 = b"\x7fELF" + b"L" * 28, b"Q" * 24


def library() -> bytes:
    """Two containers: sm80 PTX (zstd-flagged) + sm80 cubin + sm90 cubin, and one with only sm80 entries."""
    fatbin = container(
        entry(KIND_PTX, 80, PTX80, 0x11 | ZSTD),
        entry(KIND_CUBIN, 80, CUBIN80),
        entry(KIND_CUBIN, 90, CUBIN90),
    )
    fatbin += container(entry(KIND_CUBIN, 80, LONE80), entry(KIND_PTX, 80, LONE_PTX80))
    return elf({".text": b"\x90" * 32, ".nv_fatbin": fatbin})


def test_reads_the_containers_and_entries(tmp_path):
    path = tmp_path / "lib.so"
    path.write_bytes(library())
    first, second = read_fatbin(path)
    assert [(e.kind, e.sm, e.compressed) for e in first.entries] == [
        (1, 80, True),
        (2, 80, False),
        (2, 90, False),
    ]
    assert [(e.kind, e.sm) for e in second.entries] == [(2, 80), (1, 80)]
    assert path.read_bytes()[first.entries[2].payload_offset :][: len(CUBIN90)] == CUBIN90


def test_zeroes_other_sms_only_where_a_kept_sm_remains(tmp_path):
    path = tmp_path / "lib.so"
    original = library()
    path.write_bytes(original)
    before = read_fatbin(path)
    record = trim_library(path, [90], package="pkg", member="pkg/lib.so")
    trimmed = path.read_bytes()
    assert len(trimmed) == len(original) and read_fatbin(path) == before  # headers and offsets unchanged
    (ptx80, cubin80, cubin90), lone = before[0].entries, before[1].entries
    payload = lambda data, e: data[e.payload_offset : e.payload_offset + e.payload_size]  # noqa: E731
    assert payload(trimmed, ptx80) == bytes(ptx80.payload_size)
    assert payload(trimmed, cubin80) == bytes(cubin80.payload_size)
    assert payload(trimmed, cubin90) == payload(original, cubin90)
    assert [payload(trimmed, e) for e in lone] == [payload(original, e) for e in lone]  # nothing else to run
    zeroed = [(e.payload_offset, e.payload_offset + e.payload_size) for e in (ptx80, cubin80)]
    outside = [i for i in range(len(original)) if not any(a <= i < b for a, b in zeroed)]
    assert all(trimmed[i] == original[i] for i in outside)
    assert record.kept_sm == (90,) and record.removed_sm == (80,)
    assert (record.entries_zeroed, record.entries_kept, record.containers, record.containers_untouched) == (
        2,
        3,
        2,
        1,
    )
    assert record.bytes_zeroed == ptx80.payload_size + cubin80.payload_size
    assert record.bytes_before == len(original) and record.bytes_after == len(original) - record.bytes_zeroed
    assert record.to_json()["member"] == "pkg/lib.so"


def test_refuses_what_it_cannot_trim(tmp_path):
    plain = tmp_path / "plain.so"
    plain.write_bytes(elf({".text": b"\x90" * 8}))
    with pytest.raises(MegagrpoError, match="no .nv_fatbin section"):
        trim_library(plain, [90])
    text = tmp_path / "script.so"
    text.write_text("INPUT(libfoo.so.1)\n")
    with pytest.raises(MegagrpoError, match="not an ELF"):
        trim_library(text, [90])
    with pytest.raises(MegagrpoError, match="keep_sm is empty"):
        trim_library(plain, [])
    broken = tmp_path / "broken.so"
    broken.write_bytes(elf({".nv_fatbin": b"\x01\x02\x03\x04" + bytes(28)}))
    with pytest.raises(MegagrpoError, match="not one trimming knows"):
        trim_library(broken, [90])


def make_wheel(path, members: dict[str, bytes]) -> None:
    record = "".join(f"{name},sha256=stale,1\n" for name in members) + "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr("pkg-1.0.dist-info/RECORD", record)


def test_trim_wheel_trims_drops_and_rewrites_record(tmp_path):
    src = tmp_path / "in" / "pkg-1.0-cp312-abi3-manylinux_2_28_x86_64.whl"
    src.parent.mkdir()
    members = {
        "pkg/__init__.py": b"x = 1\n",
        "pkg/lib.so": library(),
        "pkg/sm100/ops.so": b"\x7fELF" + bytes(100),
        "pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\n",
    }
    make_wheel(src, members)
    dst, records = trim_wheel(src, tmp_path / "out", [90], drop=["pkg/sm100/*"])
    assert dst == tmp_path / "out" / src.name and sorted(p.name for p in dst.parent.iterdir()) == [src.name]
    with zipfile.ZipFile(dst) as zf:
        names = zf.namelist()
        assert names == [
            "pkg/__init__.py",
            "pkg/lib.so",
            "pkg-1.0.dist-info/WHEEL",
            "pkg-1.0.dist-info/RECORD",
        ]
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in zf.infolist())
        rows = list(csv.reader(io.StringIO(zf.read("pkg-1.0.dist-info/RECORD").decode())))
        assert rows[-1] == ["pkg-1.0.dist-info/RECORD", "", ""]
        for name, digest, size in rows[:-1]:
            data = zf.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data)
        lib = zf.read("pkg/lib.so")
    assert lib != members["pkg/lib.so"] and CUBIN90 in lib and CUBIN80 not in lib and LONE80 in lib
    removed, zeroed = sorted(records, key=lambda r: r.action)
    assert (removed.member, removed.action, removed.bytes_before, removed.bytes_after, removed.members) == (
        "pkg/sm100/*",
        "removed",
        104,
        0,
        1,
    )
    assert (zeroed.package, zeroed.member, zeroed.entries_zeroed) == ("pkg", "pkg/lib.so", 2)


def test_trim_wheel_refuses_a_glob_that_matches_nothing(tmp_path):
    src = tmp_path / "pkg-1.0-py3-none-any.whl"
    make_wheel(src, {"pkg/__init__.py": b""})
    with pytest.raises(MegagrpoError, match=r"drop globs \['pkg/flash_ops\*'\] match no member"):
        trim_wheel(src, tmp_path / "out", [90], drop=["pkg/flash_ops*"])
    assert list((tmp_path / "out").iterdir()) == []  # no partial wheel left behind
    with pytest.raises(MegagrpoError, match="would overwrite it"):
        trim_wheel(src, tmp_path, [90])


def test_wheel_package_is_the_normalized_distribution_name(tmp_path):
    assert wheel_package(tmp_path / "transformer_engine_cu13-2.12.0-py3-none-manylinux_2_28_x86_64.whl") == (
        "transformer-engine-cu13"
    )


def test_ptx_of_a_kept_sm_goes_where_that_sms_cubin_is_there(tmp_path):
    """The driver JIT-compiles PTX only when no cubin matches: beside an sm_90 cubin, sm_90 PTX is dead
    weight (TE's: 10.8 MB, already compressed). `covered_ptx=True` keeps it."""
    ptx90 = b"R" * 48
    fat = container(entry(KIND_PTX, 90, ptx90, 0x11 | ZSTD), entry(KIND_CUBIN, 90, CUBIN90))
    fat += container(entry(KIND_PTX, 90, ptx90))  # PTX alone: the only code for sm_90 here, kept
    for covered_ptx, zeroed in ((False, 1), (True, 0)):
        path = tmp_path / f"lib{covered_ptx}.so"
        path.write_bytes(elf({".nv_fatbin": fat}))
        record = trim_library(path, [90], covered_ptx=covered_ptx)
        first, second = read_fatbin(path)
        data = path.read_bytes()
        ptx = data[first.entries[0].payload_offset :][: len(ptx90)]
        assert (ptx == bytes(len(ptx90))) is bool(zeroed) and record.entries_zeroed == zeroed
        assert data[second.entries[0].payload_offset :][: len(ptx90)] == ptx90
        assert data[first.entries[1].payload_offset :][: len(CUBIN90)] == CUBIN90
        assert record.removed_sm == ()
