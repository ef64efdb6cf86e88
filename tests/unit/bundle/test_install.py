"""Installing a bundle over an earlier one replaces it whole (issue 36, item 9): no stale file of the older
bundle stays importable, a bundle that cannot be unpacked leaves the earlier installation as it was, and a
folder that is no installation is never replaced."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from megagrpo.bundle.install import ENV_FILE, InstallError, install, main


def _bundle(folder, name, files: dict[str, str], *, truncate: bool = False):
    """A fake bundle `name.tar.xz` of `files` and its manifest, as `bundle build` writes them."""
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    if truncate:  # damaged at the source: the manifest's size and hash are of the damaged file
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    blob = path.read_bytes()
    entry = {"file": path.name, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    entry["environment"] = {"BUNDLE": name}
    (folder / "manifest.json").write_text(json.dumps({"bundles": [entry]}))
    return path, folder / "manifest.json"


def _files(into):
    return sorted(str(p.relative_to(into)) for p in into.rglob("*") if p.is_file())


OLD = {"pkg/__init__.py": "", "pkg/gone.py": "STALE = True\n", "old_dist-1.0.dist-info/METADATA": "1.0"}
NEW = {"pkg/__init__.py": "", "pkg/new.py": "FRESH = True\n", "new_dist-2.0.dist-info/METADATA": "2.0"}
NEW["pkg/data.py"] = "".join(f"X{i} = {i * 7919 % 10007}\n" for i in range(2000))  # a stream worth cutting


def test_installing_over_an_earlier_bundle_leaves_no_stale_file(tmp_path):
    into = tmp_path / "site" / "engine"
    install(*_bundle(tmp_path / "v1", "engine", OLD), into)
    assert _files(into) == sorted([*OLD, ENV_FILE])
    report = install(*_bundle(tmp_path / "v2", "engine", NEW), into)
    assert _files(into) == sorted([*NEW, ENV_FILE])  # pkg/gone.py and the old dist-info are gone
    assert "export BUNDLE=engine" in (into / ENV_FILE).read_text()
    assert report["into"] == str(into)
    assert sorted(p.name for p in into.parent.iterdir()) == ["engine"]  # no staging folder left behind


def test_a_bundle_that_cannot_be_unpacked_leaves_the_earlier_installation(tmp_path, capsys):
    into = tmp_path / "site" / "engine"
    install(*_bundle(tmp_path / "v1", "engine", OLD), into)
    bundle, manifest = _bundle(tmp_path / "v2", "engine", NEW, truncate=True)
    assert main([str(bundle), "--manifest", str(manifest), "--into", str(into)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megagrpo.bundle.install: error: {bundle}: cannot unpack it (")
    assert err.rstrip().endswith(f"{into} is left as it was") and "Traceback" not in err
    assert _files(into) == sorted([*OLD, ENV_FILE])
    assert sorted(p.name for p in into.parent.iterdir()) == ["engine"]


def test_a_folder_that_is_no_installation_is_refused_not_replaced(tmp_path):
    into = tmp_path / "home"
    into.mkdir()
    (into / "notes.txt").write_text("mine")
    with pytest.raises(InstallError, match=f"a folder with files and no {ENV_FILE}"):
        install(*_bundle(tmp_path / "v1", "engine", OLD), into)
    assert _files(into) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    install(*_bundle(tmp_path / "v1", "engine", OLD), empty)
    assert _files(empty) == sorted([*OLD, ENV_FILE])
