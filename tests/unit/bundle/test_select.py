"""Issue 28: version selection by symbol tables. On tables recorded from the real wheels (torch 2.11.0's
pinned nvidia-cublas 13.1.0.3, cuda-runtime 13.0.96, nvrtc 13.0.88, cudnn 9.19.0.56; TE core 2.12.0 and
2.13.0), TE 2.12.0 is picked and 2.13.0 is rejected for the cuBLASLt symbol cuBLAS 13.1 lacks; against torch
2.11.0's own libraries, sglang-kernel 0.4.6 is picked and 0.4.6.post1/0.4.9/0.4.10 are rejected for torch C++
symbols that 2.11 does not export. The loader's rules themselves are checked on small synthetic tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megagrpo.bundle.cli import main
from megagrpo.bundle.resolve import Provided, check, select_newest
from megagrpo.bundle.tables import LibraryTable, PackageTables
from megagrpo.bundle.target import Target
from megagrpo.errors import MegagrpoError

DATA = Path(__file__).parents[3] / "configs" / "bundles" / "torch-2.11.0-cu130-sm90"
TARGET = DATA / "target.json"
TE_LIB = "transformer_engine/wheel_lib/libtransformer_engine.so"
GROUPED = "cublasLtGroupedMatrixLayoutInit_internal@libcublasLt.so.13"


def recorded_selection():
    target = Target.load(TARGET)
    provided = Provided(target.provided_tables())
    return select_newest("te", target.candidate_tables("transformer-engine-core"), provided)


def test_recorded_tables_pick_te_2_12_and_name_the_missing_cublaslt_symbol():
    sel = recorded_selection()
    assert sel.chosen == "2.12.0"
    newest, older = sel.verdicts
    assert (newest.version, older.version) == ("2.13.0", "2.12.0")  # newest first
    assert not newest.resolves
    assert [str(m.symbol) for m in newest.missing] == [GROUPED]
    assert newest.first_missing.provider == "libcublasLt.so.13"
    assert newest.first_missing.library == TE_LIB
    assert GROUPED in newest.describe()
    # 2.12.0: every listed reference (cuBLAS, cuBLASLt, cudart, cuDNN, unversioned nvrtc) found
    assert older.proven and older.unchecked == {} and older.resolved == 85


def test_recorded_tables_pick_sglang_kernel_0_4_6_for_torch_2_11():
    target = Target.load(TARGET)
    sel = select_newest("sk", target.candidate_tables("sglang-kernel"), Provided(target.provided_tables()))
    assert sel.chosen == "0.4.6"
    by_version = {v.version: v for v in sel.verdicts}
    assert [v.version for v in sel.verdicts] == ["0.4.10", "0.4.9", "0.4.6.post1", "0.4.6"]
    for newer in ("0.4.10", "0.4.9", "0.4.6.post1"):
        v = by_version[newer]
        assert not v.resolves and all(
            m.symbol.startswith(("_ZN3c10", "_ZN2at", "_ZNK2at", "_ZNR5torch")) for m in v.missing
        )
    assert "_ZN2at4cuda24getCurrentCUDABlasHandleEb" in {m.symbol for m in by_version["0.4.6.post1"].missing}
    ok = by_version["0.4.6"]
    # the interpreter's and the driver's references are left to the node, not counted as proven or missing
    assert ok.proven and ok.resolved == 158 and ok.node_runtime == {"libcuda.so.1": 1, "python": 1}


def test_recorded_tables_are_what_they_claim():
    """The fixtures come from the pinned wheels, and the symbol that decides is really absent."""
    target = json.loads(TARGET.read_text())
    for name in target["provided"] + target["components"]["transformer-engine-core"]:
        t = PackageTables.load(DATA / name)
        assert t.wheel.endswith(".whl") and len(t.wheel_sha256) == 64 and t.wheel_bytes > 0
    cublas = PackageTables.load(DATA / "nvidia-cublas-13.1.0.3.json")
    lt = cublas.libraries["nvidia/cu13/lib/libcublasLt.so.13"]
    assert "cublasLtMatmul" in lt.defined["libcublasLt.so.13"]
    assert "cublasLtGroupedMatrixLayoutInit_internal" not in lt.defined["libcublasLt.so.13"]
    te212 = PackageTables.load(DATA / "transformer-engine-cu13-2.12.0.json").libraries[TE_LIB]
    assert "cublasLtGroupedMatrixLayoutInit_internal" not in te212.undefined["libcublasLt.so.13"]
    tables = target["provided"] + [t for c in target["components"].values() for t in c]
    assert sum((DATA / name).stat().st_size for name in tables) < 200_000  # small enough to commit


def lib(soname, defined=None, hidden=None, undefined=None, needed=(), weak=()):
    return LibraryTable(
        soname=soname,
        needed=list(needed),
        version_definitions=sorted({*(defined or {}), *(hidden or {})} - {""}),
        defined=defined or {},
        hidden=hidden or {},
        undefined=undefined or {},
        weak_undefined=list(weak),
    )


def pkg(name, version, **libs):
    return PackageTables(name, version, {f"{name}/{m}.so": t for m, t in libs.items()})


PROVIDER = pkg(
    "cuda",
    "1",
    liba=lib("liba.so.1", defined={"liba.so.1": ["f", "g"]}, hidden={"liba.so.1": ["old"]}),
    libu=lib("libu.so", defined={"": ["u"]}),
)


def test_loader_rules_on_synthetic_tables():
    provided = Provided([PROVIDER])
    ok = pkg("cand", "1.0", m=lib("m.so", undefined={"liba.so.1": ["f", "old"], "": ["g", "u"]}, weak=["w"]))
    v = check(ok, provided)
    # tagged refs bind hidden definitions too; unversioned refs bind default or unversioned ones
    assert v.proven and v.resolved == 4
    hidden_unversioned = pkg("cand", "1.1", m=lib("m.so", undefined={"": ["old"]}))
    assert [m.symbol for m in check(hidden_unversioned, provided).missing] == ["old"]
    wrong_tag = pkg("cand", "1.2", m=lib("m.so", undefined={"liba.so.1": ["h"]}))
    (miss,) = check(wrong_tag, provided).missing
    assert (miss.symbol, miss.provider) == ("h@liba.so.1", "liba.so.1")


def test_own_libraries_resolve_among_themselves():
    own = pkg(
        "cand",
        "1.0",
        core=lib("libcore.so", defined={"": ["nvte_x"]}),
        binding=lib("libbind.so", undefined={"": ["nvte_x", "f"]}, needed=["libcore.so", "libc.so.6"]),
    )
    v = check(own, Provided([PROVIDER]))
    assert v.proven and v.unrecorded_needed == []


def test_unrecorded_library_is_unproven_not_passed():
    cand = pkg("cand", "2.0", m=lib("m.so", undefined={"libcudnn.so.9": ["x"]}, needed=["libcudnn.so.9"]))
    older = pkg("cand", "1.0", m=lib("m.so", undefined={"liba.so.1": ["f"]}))
    provided = Provided([PROVIDER])
    v = check(cand, provided)
    assert v.resolves and not v.proven and v.unchecked == {"libcudnn.so.9": 1}
    assert v.unrecorded_needed == ["libcudnn.so.9"]
    assert select_newest("c", [cand, older], provided).chosen == "1.0"
    assert select_newest("c", [cand, older], provided, allow_unchecked=True).chosen == "2.0"


def test_no_candidate_and_duplicate_versions_are_user_errors():
    provided = Provided([PROVIDER])
    bad = pkg("cand", "1.0", m=lib("m.so", undefined={"liba.so.1": ["nope"]}))
    sel = select_newest("c", [bad], provided)
    assert sel.chosen is None and "no candidate" in sel.describe()
    with pytest.raises(MegagrpoError, match="given twice"):
        select_newest("c", [bad, pkg("cand", "1.0")], provided)
    with pytest.raises(MegagrpoError, match="no candidate symbol tables"):
        select_newest("c", [], provided)


def test_target_spec_errors_name_the_field(tmp_path):
    spec = json.loads(TARGET.read_text())
    spec["sm"] = "90"
    (tmp_path / "t.json").write_text(json.dumps(spec))
    with pytest.raises(MegagrpoError, match="'sm'"):
        Target.load(tmp_path / "t.json")
    spec["sm"], spec["cuda"] = [90], 13
    (tmp_path / "t.json").write_text(json.dumps(spec))
    with pytest.raises(MegagrpoError, match=r"unknown field\(s\) \['cuda'\]"):
        Target.load(tmp_path / "t.json")
    del spec["cuda"]
    (tmp_path / "t.json").write_text(json.dumps(spec))
    with pytest.raises(MegagrpoError, match="no such symbol table"):
        Target.load(tmp_path / "t.json").provided_tables()


def test_cli_select_prints_verdicts_and_writes_the_manifest(tmp_path, capsys):
    out = tmp_path / "manifest.json"
    assert main(["select", str(TARGET), "--manifest", str(out)]) == 0
    text = capsys.readouterr().out
    assert "-> 2.12.0" in text and GROUPED in text
    manifest = json.loads(out.read_text())
    assert manifest["selection"][0]["chosen"] == "2.12.0"
    assert manifest["checks"] == [
        {
            "name": "symbols:transformer-engine-core",
            "passed": True,
            "detail": "transformer-engine-cu13 2.12.0: 85 references resolve",
        },
        {
            "name": "symbols:sglang-kernel",
            "passed": True,
            "detail": "sglang-kernel 0.4.6: 158 references resolve; left to the node: libcuda.so.1 (1), python (1)",
        },
    ]
    assert manifest["bundles"] == []
    assert main(["select", str(tmp_path / "missing.json")]) == 2
    assert "no such target spec" in capsys.readouterr().err


def test_restricting_a_provider_to_what_candidates_reference_changes_no_verdict():
    """`record --provides-for`: torch's tables keep only the definitions some candidate references."""
    target = Target.load(TARGET)
    cands = target.candidate_tables("sglang-kernel")
    full = [lib("libtorch.so", defined={"": ["a", "b", "unrelated"]})]
    torch_full = PackageTables("torch", "2.11.0", {"torch/lib/libtorch.so": full[0]})
    cand = PackageTables("k", "1", {"k.so": lib("k.so", undefined={"": ["a", "b"]}, needed=("libtorch.so",))})
    cut = torch_full.restricted(cand.referenced(), references=False)
    assert cut.libraries["torch/lib/libtorch.so"].defined == {"": ["a", "b"]}
    assert check(cand, Provided([cut])).proven and check(cand, Provided([torch_full])).proven
    assert cands  # the shipped candidates are recorded this way
