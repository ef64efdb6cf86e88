"""Issue 28: the bundle manifest (sizes, hashes, the 64 MiB limit, trimming records, selection checks)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from megagrpo.bundle.manifest import BundleEntry, Check, Manifest, PackageEntry, selection_checks
from megagrpo.bundle.resolve import Provided, select_newest
from megagrpo.bundle.target import MIB, Target
from megagrpo.bundle.trim import TrimRecord
from megagrpo.errors import MegagrpoError

TARGET = Path(__file__).parents[3] / "configs" / "bundles" / "torch-2.11.0-cu130-sm90" / "target.json"


def selection():
    target = Target.load(TARGET)
    provided = Provided(target.provided_tables())
    component = "transformer-engine-core"
    return target, [select_newest(component, target.candidate_tables(component), provided)]


def test_manifest_records_sizes_trimming_and_checks(tmp_path):
    target, selections = selection()
    blob = tmp_path / "learner.tar.xz"
    blob.write_bytes(b"x" * 1000)
    trimmed = TrimRecord(
        "transformer-engine-cu13", "transformer_engine/wheel_lib/libtransformer_engine.so",
        "zeroed-fatbin-entries", (90,), (75, 80), 2000, 1000,
    )  # fmt: skip
    entry = BundleEntry.from_file(
        "learner",
        blob,
        target.bundle_limit_bytes,
        packages=[PackageEntry("transformer-engine-cu13", "2.12.0", "added by the target spec", "trimmed")],
        trimmed=[trimmed],
        checks=[Check("import", True, "transformer_engine.pytorch imports")],
    )
    too_big = BundleEntry.from_file("engine", blob, limit_bytes=999)
    path = Manifest(target, selections, [entry, too_big]).write(tmp_path / "out" / "manifest.json")
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temporary left behind
    data = json.loads(path.read_text())
    assert data["format"] == "megagrpo.manifest/1"
    assert data["target"]["torch"] == "2.11.0+cu130" and data["target"]["sm"] == [90]
    assert data["checks"][0]["passed"] and data["selection"][0]["chosen"] == "2.12.0"
    learner, engine = data["bundles"]
    assert learner["bytes"] == 1000
    assert learner["sha256"] == hashlib.sha256(b"x" * 1000).hexdigest()
    assert learner["passed"] and [c["name"] for c in learner["checks"]] == ["size", "import"]
    assert f"limit {64 * MIB} bytes" in learner["checks"][0]["detail"]
    assert learner["trimmed"][0]["removed_sm"] == [75, 80]
    assert learner["packages"] == [
        {
            "name": "transformer-engine-cu13",
            "version": "2.12.0",
            "source": "trimmed",
            "reason": "added by the target spec",
        }
    ]
    # a failed check is kept, and the bundle is marked failed
    assert not engine["passed"] and engine["checks"][0] == {
        "name": "size",
        "passed": False,
        "detail": "1000 bytes (0.0 MiB), limit 999 bytes (0 MiB)",
    }


def test_selection_check_fails_when_nothing_loads():
    target, selections = selection()
    selections[0].chosen = None
    (c,) = selection_checks(selections)
    assert not c.passed and c.name == "symbols:transformer-engine-core"


def test_missing_bundle_file_is_a_user_error(tmp_path):
    with pytest.raises(MegagrpoError, match="bundle file not found"):
        BundleEntry.from_file("learner", tmp_path / "none.tar", 64 * MIB)
