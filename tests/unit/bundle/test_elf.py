"""Issue 28: the ELF dynamic-symbol reader, on the system's libm, and on nm/readelf output given as text;
the wheel recorder on a wheel made here around that libm."""

from __future__ import annotations

import ctypes.util
import shutil
import zipfile
from pathlib import Path

import pytest

from megagrpo.bundle.elf import DynSymbol, parse_nm, parse_readelf_dynamic, read_dynamic, split_version
from megagrpo.bundle.tables import LibraryTable, PackageTables, record_wheel
from megagrpo.errors import MegagrpoError

LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib")


def find_libm() -> Path | None:
    name = ctypes.util.find_library("m")  # "libm.so.6" on glibc
    if name is None:
        return None
    return next((Path(d) / name for d in LIB_DIRS if (Path(d) / name).is_file()), None)


LIBM = find_libm()
needs_libm = pytest.mark.skipif(
    LIBM is None or shutil.which("nm") is None or shutil.which("readelf") is None,
    reason="needs a glibc libm.so.6 and binutils (nm, readelf)",
)


def test_split_version():
    assert split_version("exp@@GLIBC_2.29") == ("exp", "GLIBC_2.29", True)
    assert split_version("exp@GLIBC_2.2.5") == ("exp", "GLIBC_2.2.5", False)
    assert split_version("nvrtcGetPTX") == ("nvrtcGetPTX", None, True)


def test_parse_nm_text():
    text = """\
0000000000000000 A libcublasLt.so.13
00000000000fa770 T cublasLtMatmul@@libcublasLt.so.13
00000000000138b0 T exp@GLIBC_2.2.5
                 U cudaMalloc@libcudart.so.13
                 U nvrtcGetPTX
                 w __gmon_start__
"""
    symbols, markers = parse_nm(text)
    assert markers == ["libcublasLt.so.13"]
    assert symbols == [
        DynSymbol("cublasLtMatmul", "libcublasLt.so.13", True),
        DynSymbol("exp", "GLIBC_2.2.5", True, default=False),
        DynSymbol("cudaMalloc", "libcudart.so.13", False),
        DynSymbol("nvrtcGetPTX", None, False),
        DynSymbol("__gmon_start__", None, False, weak=True),
    ]
    assert [str(s) for s in symbols[:3]] == [
        "cublasLtMatmul@@libcublasLt.so.13",
        "exp@GLIBC_2.2.5",
        "cudaMalloc@libcudart.so.13",
    ]


def test_parse_readelf_dynamic_text():
    text = """\
 0x0000000000000001 (NEEDED)             Shared library: [libcublas.so.13]
 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]
 0x000000000000000e (SONAME)             Library soname: [libtransformer_engine.so]
 0x000000006ffffffe (VERNEED)            0x1f4e8
"""
    assert parse_readelf_dynamic(text) == ("libtransformer_engine.so", ["libcublas.so.13", "libc.so.6"], True)


@needs_libm
def test_read_libm():
    info = read_dynamic(LIBM)
    assert info.soname == "libm.so.6"
    assert "libc.so.6" in info.needed
    assert "GLIBC_2.2.5" in info.version_definitions
    by_name = {}
    for s in info.defined:
        by_name.setdefault(s.name, []).append(s)
    # cos has been in libm since the x86-64 ABI's first glibc version, as its default definition
    assert any(s.version == "GLIBC_2.2.5" and s.default for s in by_name["cos"])
    assert any(s.version == "GLIBC_2.2.5" for s in by_name["sin"])
    assert any(s.version and s.version.startswith("GLIBC_") for s in info.undefined)
    table = LibraryTable.from_dynamic(info)
    assert "cos" in table.defined["GLIBC_2.2.5"]
    # libm's references are all to glibc: counted, not listed
    assert table.undefined == {} and sum(table.dropped_undefined.values()) > 0


@needs_libm
def test_record_wheel_round_trip(tmp_path):
    wheel = tmp_path / "fake_math-1.0-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(LIBM, "fake_math/lib/libm.so.6")
        zf.writestr("fake_math/__init__.py", "")
    tables = record_wheel(wheel, workdir=tmp_path)
    assert (tables.package, tables.version) == ("fake-math", "1.0")
    assert list(tables.libraries) == ["fake_math/lib/libm.so.6"]
    assert tables.wheel_bytes == wheel.stat().st_size and len(tables.wheel_sha256) == 64
    assert list(tmp_path.iterdir()) == [wheel]  # the unpacked library is gone
    again = PackageTables.load(tables.save(tmp_path / "t.json"))
    assert again.to_json() == tables.to_json()
    with pytest.raises(MegagrpoError, match="no shared library matches"):
        record_wheel(wheel, ["*/libz*"], workdir=tmp_path)


def test_not_an_elf_file_is_a_user_error(tmp_path):
    if shutil.which("readelf") is None:
        pytest.skip("needs binutils")
    text = tmp_path / "notes.so"
    text.write_text("not a library\n")
    with pytest.raises(MegagrpoError, match="notes.so"):
        read_dynamic(text)
    with pytest.raises(MegagrpoError, match="no such file"):
        read_dynamic(tmp_path / "absent.so")
