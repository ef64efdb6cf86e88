"""Issue 28: the engine bundle's contents are measured (the traced import closure) and reduced by what the
node has, and a bundle installs on the node from its file and manifest alone."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest

from megagrpo.bundle.closure import canonical, map_to_distributions, subtract_node, trace_imports
from megagrpo.bundle.install import ENV_FILE, InstallError, install
from megagrpo.bundle.pack import pack_tree, platforms
from megagrpo.errors import MegagrpoError


def test_trace_sees_imports_of_child_processes_only_when_really_imported(tmp_path):
    # the parent probes `yaml` with find_spec (not an import) and starts a child that imports `packaging`
    code = (
        "import importlib.util, subprocess, sys; importlib.util.find_spec('yaml'); "
        "subprocess.run([sys.executable, '-c', 'import packaging.version'], check=True)"
    )
    names = trace_imports([sys.executable, "-c", code])
    assert "packaging" in names and "subprocess" in names
    assert "yaml" not in names
    dists = map_to_distributions(sys.executable, names)
    assert "packaging" in {canonical(d) for d in dists}
    assert not {"subprocess", "json"} & set(dists)  # the standard library maps to nothing


def test_trace_failure_names_the_workload():
    with pytest.raises(MegagrpoError, match="failed \\(exit 3\\)"):
        trace_imports([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_node_packages_are_subtracted_unless_a_requirement_rejects_their_version():
    dists = {
        "sglang": {"version": "0.5.23", "requires": ["transformers==5.19.0", "torch==2.14.1", "orjson"]},
        "transformers": {"version": "5.19.0", "requires": ["tokenizers>=0.22"]},
        "tokenizers": {"version": "0.23.2", "requires": []},
        "orjson": {"version": "3.13.0", "requires": []},
        "torch": {"version": "2.14.1", "requires": []},
        "rich": {"version": "15.0.0", "requires": []},
    }
    node = {"transformers": "5.17.0", "tokenizers": "0.23.2", "torch": "2.11.0", "rich": None}
    needs, provided = subtract_node(dists, node, fixed={"torch"})
    carried = {n.name: n.reason for n in needs}
    assert set(carried) == {"sglang", "transformers", "orjson"}
    assert carried["transformers"] == "node has 5.17.0; sglang needs transformers==5.19.0"
    assert carried["orjson"] == "not on the node"
    # the site's torch is never replaced, the conflict is reported; an unversioned node package is unchecked
    assert "torch 2.11.0 (fixed by the site; sglang declares torch==2.14.1)" in provided
    assert "rich (node version not recorded: unchecked)" in provided


def test_platform_tags_follow_the_node_glibc():
    tags = platforms("2.35")
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_34_x86_64" in tags
    assert "manylinux_2_36_x86_64" not in tags and "manylinux2014_x86_64" in tags
    with pytest.raises(MegagrpoError, match="glibc"):
        platforms("2.5")


def _bundle(tmp_path):
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("VALUE = 7\n")
    bundle = pack_tree(tree, tmp_path / "engine.tar.xz")
    import hashlib

    entry = {
        "name": "engine",
        "file": bundle.name,
        "bytes": bundle.stat().st_size,
        "sha256": hashlib.sha256(bundle.read_bytes()).hexdigest(),
        "environment": {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"},
    }
    (tmp_path / "manifest.json").write_text(json.dumps({"bundles": [entry]}))
    return bundle


def test_install_unpacks_and_writes_the_env_file(tmp_path):
    bundle = _bundle(tmp_path)
    with tarfile.open(bundle) as tar:
        assert tar.getnames() == ["pkg", "pkg/__init__.py"]
    into = tmp_path / "site"
    install(bundle, tmp_path / "manifest.json", into)
    env = (into / ENV_FILE).read_text()
    assert "export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1" in env
    out = subprocess.run(
        ["bash", "-c", f"source {into / ENV_FILE} && {sys.executable} -c 'import pkg; print(pkg.VALUE)'"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "7"


def test_install_refuses_a_damaged_transfer(tmp_path):
    bundle = _bundle(tmp_path)
    data = bytearray(bundle.read_bytes())
    data[-5] ^= 0xFF
    bundle.write_bytes(bytes(data))
    with pytest.raises(InstallError, match="sha256 differs"):
        install(bundle, tmp_path / "manifest.json", tmp_path / "site")
    assert not (tmp_path / "site").exists()
    bundle.write_bytes(bytes(data[:-10]))
    with pytest.raises(InstallError, match="copy it again"):
        install(bundle, tmp_path / "manifest.json", tmp_path / "site")
    with pytest.raises(InstallError, match="lists no bundle named 'other.tar.xz'"):
        install(tmp_path / "other.tar.xz", tmp_path / "manifest.json", tmp_path / "site")


def test_the_shipped_target_plans_both_bundles_from_its_recorded_closures():
    """configs/bundles/torch-2.11.0-cu130-sm90: what each bundle carries, and why, before any download."""
    from pathlib import Path

    from megagrpo.bundle.build import bundle_specs, plan_bundle
    from megagrpo.bundle.resolve import Provided, select_newest
    from megagrpo.bundle.target import Target

    target = Target.load(Path(__file__).parents[3] / "configs/bundles/torch-2.11.0-cu130-sm90/target.json")
    provided = Provided(target.provided_tables())
    selections = [select_newest(c, target.candidate_tables(c), provided) for c in target.components]
    planned = {}
    for spec in bundle_specs(target):
        planned[spec.name] = plan_bundle(spec, target, selections, planned)[0]
    engine = {canonical(n.name): n for n in planned["engine"]}
    learner = {canonical(n.name): n.version for n in planned["learner"]}
    assert engine["sglang"].version == "0.5.23" and engine["sglang-kernel"].version == "0.4.6"
    assert engine["transformers"].reason == "node has 5.17.0; sglang needs transformers==5.19.0"
    assert not {"torch", "triton", "numpy", "wandb"} & set(engine)  # fixed by the site, or excluded
    assert not any(n.startswith(("nvidia-", "cuda-")) for n in engine)
    # the TE version follows the symbol-table selection; megatron-core comes with the engine bundle
    assert learner == {"transformer-engine": "2.12.0", "transformer-engine-cu13": "2.12.0",
                       "transformer-engine-torch": "2.12.0"}  # fmt: skip


def test_declared_requirements_of_added_packages_are_met_or_waived(tmp_path):
    """A package the spec adds (not traced) must have its declared requirements on the node or in a bundle;
    one the spec excludes needs its reason."""
    import zipfile

    from megagrpo.bundle.build import BundleSpec, requirements_check
    from megagrpo.bundle.closure import Need
    from megagrpo.bundle.target import Target

    wheel = tmp_path / "te-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        meta = "Name: te\nRequires-Dist: pydantic\nRequires-Dist: onnxscript\nRequires-Dist: inspect-tool\n"
        meta += 'Requires-Dist: torch>=2.1\nRequires-Dist: pytest; extra == "test"\n'
        zf.writestr("te-1.0.dist-info/METADATA", meta)
    target = Target(
        "t", "2.11.0", 13, "3.12", [90], [], {}, node_packages={"onnxscript": None}, fixed=["torch"]
    )
    needs = [Need("te", "1.0", "added")]
    spec = BundleSpec("learner", tmp_path / "c.json", add={"te": "1.0"})
    check = requirements_check(spec, target, needs, {"te": wheel}, {"pydantic": "2.14.3"})
    assert not check.passed and check.detail == "te needs inspect-tool: not on the node and in no bundle"
    spec.exclude = {"inspect-tool": "only te.debug imports it"}
    assert requirements_check(spec, target, needs, {"te": wheel}, {"pydantic": "2.14.3"}).passed
    assert not requirements_check(spec, target, needs, {"te": wheel}, {}).passed  # pydantic from nowhere


def test_a_dropped_member_needs_its_reason(tmp_path):
    from megagrpo.bundle.build import BundleSpec

    data = {"closure": "c.json", "drop": {"pycountry": ["pycountry/locales/*"]}}
    with pytest.raises(MegagrpoError, match=r"bundles.engine.why.*\['pycountry'\]"):
        BundleSpec.parse("engine", data, tmp_path, "target.json")
    spec = BundleSpec.parse(
        "engine", {**data, "why": {"pycountry": "unused locales"}}, tmp_path, "target.json"
    )
    assert spec.why == {"pycountry": "unused locales"}


def _wheel(dirpath, name: str, version: str, files: dict[str, str], requires: list[str] = ()) -> object:
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    path = dirpath / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    members = {
        **files,
        f"{dist}/METADATA": meta,
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in members.items():
            zf.writestr(member, text)
        zf.writestr(f"{dist}/RECORD", "")
    return path


def test_build_bundle_trims_installs_packs_and_checks(tmp_path, monkeypatch):
    """The whole build of one bundle from local wheels (the download is the only part replaced)."""
    import megagrpo.bundle.build as build
    from megagrpo.bundle.build import BundleSpec, build_bundle
    from megagrpo.bundle.closure import Need
    from megagrpo.bundle.install import install
    from megagrpo.bundle.manifest import Manifest
    from megagrpo.bundle.target import Target

    src = tmp_path / "wheels"
    src.mkdir()
    wheels = {
        "pycountry": _wheel(src, "pycountry", "1.0", {"pycountry/__init__.py": "X = 1\n", "pycountry/locales/de.mo": "x" * 999}),
        "kernel": _wheel(
            src, "kernel", "0.4.6", {"kernel/__init__.py": "", "kernel/fa3.txt": "big"},
            requires=["pycountry", "absent-dep"],
        ),
    }  # fmt: skip
    monkeypatch.setattr(build, "download", lambda pins, cache, python, glibc: {k: wheels[k] for k in pins})
    target = Target("t", "2.11.0", 13, "3.12", [90], [], {}, source=str(tmp_path / "target.json"))
    spec = BundleSpec(
        "engine", tmp_path / "c.json", add={"kernel": "0.4.6"},
        drop={"pycountry": ["pycountry/locales/*"], "kernel": ["kernel/fa3*"]},
        why={"pycountry": "unused locales", "kernel": "no FA3"}, environment={"K": "1"}, smoke=["kernel"],
    )  # fmt: skip
    needs = [Need("pycountry", "1.0", "not on the node"), Need("kernel", "0.4.6", "added by the target spec")]
    entry = build_bundle(spec, target, needs, tmp_path, tmp_path / "cache", {})
    checks = {c.name: c for c in entry.checks}
    assert checks["size"].passed and checks["installed"].passed
    assert not checks["requirements"].passed and "kernel needs absent-dep" in checks["requirements"].detail
    assert {(p.name, p.source) for p in entry.packages} == {("pycountry", "trimmed"), ("kernel", "trimmed")}
    assert "members left out: unused locales" in next(
        p.reason for p in entry.packages if p.name == "pycountry"
    )
    Manifest(target, [], [entry]).write(tmp_path / "manifest.json")
    install(tmp_path / "engine.tar.xz", tmp_path / "manifest.json", tmp_path / "site")
    assert (tmp_path / "site/pycountry/__init__.py").is_file() and (tmp_path / "site/kernel").is_dir()
    assert (
        not (tmp_path / "site/pycountry/locales").exists() and not (tmp_path / "site/kernel/fa3.txt").exists()
    )
    assert "export K=1" in (tmp_path / "site/megagrpo-bundle.env").read_text()
