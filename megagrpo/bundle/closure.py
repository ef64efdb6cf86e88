"""The import closure of a workload: which installed distributions its processes import, minus what the
target node already has (docs/gpu.md, "Offline bundles").

A bundle holds what megagrpo's path on the node imports and the node lacks, no more: SGLang's declared
requirements pull in hundreds of megabytes it never imports on megagrpo's path (its router, FlashInfer,
DeepEP, the OpenAI harmony stack), which would not fit a 64 MiB transfer. So the closure is measured, not
declared: the workload runs here under a tracer, and every top-level module any of its processes finds
(the parent, SGLang's scheduler and detokenizer, spawned tool workers) imports is recorded. Names map to distributions through `importlib.metadata.packages_distributions()`.

What the workload does not run here is not traced: GPU-only imports (Transformer Engine, sglang-kernel's
CUDA modules, torch_memory_saver's hooks) are named in the target spec instead (`extra`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from megagrpo.errors import MegagrpoError

FORMAT = "megagrpo.closure/1"
TRACE_DIR_ENV = "MEGAGRPO_IMPORT_TRACE_DIR"

# Installed as `sitecustomize` on PYTHONPATH: every interpreter of the workload (spawned or exec'd) runs it
# first. It records what is in `sys.modules`, i.e. what was really imported: a meta-path hook would also
# count `importlib.util.find_spec` probes (transformers asks about dozens of optional packages it never
# imports). A daemon thread writes every 0.25 s, so a process SGLang SIGKILLs loses at most its last moments.
_SITECUSTOMIZE = """
import atexit, os, sys, threading, time
_dir = os.environ.get("MEGAGRPO_IMPORT_TRACE_DIR")
if _dir:
    _written = set()
    _path = os.path.join(_dir, "trace-%d.txt" % os.getpid())

    def _flush():
        new = {m.partition(".")[0] for m in list(sys.modules)} - _written
        if new:
            _written.update(new)
            with open(_path, "a") as f:
                f.write("\\n".join(sorted(new)) + "\\n")

    def _loop():
        while True:
            time.sleep(0.25)
            _flush()

    threading.Thread(target=_loop, name="megagrpo-import-trace", daemon=True).start()
    atexit.register(_flush)
"""

# Run by the traced interpreter itself: its site-packages decide which distribution a module belongs to.
_MAP = """
import importlib.metadata as m, json, sys
names = json.load(sys.stdin)
owners = m.packages_distributions()
out = {}
for n in names:
    for d in owners.get(n, []):
        dist = m.distribution(d)
        key = dist.metadata["Name"]
        out.setdefault(key, {"version": dist.version, "modules": [], "requires": dist.requires or []})
        out[key]["modules"].append(n)
print(json.dumps(out))
"""


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name: `Sglang_Kernel` and `sglang-kernel` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Closure:
    """Distributions a workload imported: name -> version, the modules seen, and its declared requirements."""

    workload: str
    python: str
    dists: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "workload": self.workload, "python": self.python, "dists": self.dists}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Closure:
        from megagrpo.bundle.files import read_json

        data = read_json(Path(path), "run `megagrpo bundle trace` to record it")
        if data.get("format") != FORMAT:
            raise MegagrpoError(
                f"{path}: not a closure record (format {data.get('format')!r}, want {FORMAT})"
            )
        return cls(data["workload"], data["python"], data["dists"])


def trace_imports(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout_s: float = 1800
) -> set[str]:
    """Run `cmd` under the import tracer and return every top-level module name any of its processes found.
    A workload that starts an engine can hang; `timeout_s` ends it with an error naming the command."""
    with tempfile.TemporaryDirectory(prefix="megagrpo-trace-") as tmp:
        site = Path(tmp, "site")
        out = Path(tmp, "out")
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        run_env = dict(os.environ if env is None else env)
        run_env[TRACE_DIR_ENV] = str(out)
        run_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), run_env.get("PYTHONPATH", "")) if p)
        try:
            proc = subprocess.run(
                cmd, env=run_env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise MegagrpoError(
                f"the traced workload {' '.join(cmd)!r} ran past {timeout_s:.0f} s; run it alone to see where "
                "it waits"
            ) from None
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise MegagrpoError(
                f"the traced workload {' '.join(cmd)!r} failed (exit {proc.returncode}):\n{tail}"
            )
        names: set[str] = set()
        for f in out.glob("trace-*.txt"):
            names.update(line.strip() for line in f.read_text().splitlines() if line.strip())
        if not names:
            raise MegagrpoError(
                f"the tracer saw no import in {' '.join(cmd)!r}: does the workload run a Python that honours "
                "PYTHONPATH (no -I / -E)?"
            )
        return names


def map_to_distributions(python: str, names: set[str], *, exclude: set[str] = frozenset()) -> dict[str, dict]:
    """Top-level module names -> {distribution: {version, modules, requires}} as `python` sees its packages.

    Standard-library modules map to no distribution and drop out; so do names found but never installed
    (the optional imports a library tries inside try/except)."""
    wanted = sorted(n for n in names if n not in sys.stdlib_module_names)
    proc = subprocess.run([python, "-c", _MAP], input=json.dumps(wanted), capture_output=True, text=True)
    if proc.returncode != 0:
        raise MegagrpoError(f"{python}: could not map modules to distributions:\n{proc.stderr[-2000:]}")
    dists = json.loads(proc.stdout)
    skip = {canonical(e) for e in exclude}
    return {k: v for k, v in sorted(dists.items()) if canonical(k) not in skip}


@dataclass(frozen=True)
class Need:
    """One distribution a bundle carries, and why the node's copy (if any) does not do."""

    name: str
    version: str
    reason: str


def subtract_node(
    dists: dict[str, dict],
    node: dict[str, str | None],
    fixed: set[str] = frozenset(),
) -> tuple[list[Need], list[str]]:
    """Split a closure into what the bundle must carry and what the node provides.

    The node provides a distribution when it has it and its version satisfies every requirement on it that
    the closure's own distributions declare (`transformers==5.19.0` from sglang rejects the node's 5.17.0).
    A node package recorded without a version is taken as satisfying (it is reported as unchecked). A
    `fixed` package (the site's torch and its CUDA libraries) is never carried: a requirement it breaks is
    reported, since replacing it is exactly what the node forbids."""
    from packaging.requirements import Requirement

    fixed_c = {canonical(f) for f in fixed}
    node_c = {canonical(k): v for k, v in node.items()}
    wants: dict[str, list[tuple[str, Requirement]]] = {}
    for owner, info in dists.items():
        for line in info.get("requires", []):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            wants.setdefault(canonical(req.name), []).append((owner, req))
    needs: list[Need] = []
    provided: list[str] = []
    for name, info in dists.items():
        c = canonical(name)
        version = info["version"]
        if c not in node_c:
            needs.append(Need(name, version, "not on the node"))
            continue
        have = node_c[c]
        if c in fixed_c:
            off = [
                f"{o} declares {r}"
                for o, r in wants.get(c, [])
                if have and not r.specifier.contains(have, prereleases=True)
            ]
            provided.append(
                f"{name} {have} (fixed by the site" + ("; " + ", ".join(off) if off else "") + ")"
            )
            continue
        if have is None:
            provided.append(f"{name} (node version not recorded: unchecked)")
            continue
        broken = [
            f"{o} needs {r}" for o, r in wants.get(c, []) if not r.specifier.contains(have, prereleases=True)
        ]
        if broken:
            needs.append(Need(name, version, f"node has {have}; " + ", ".join(broken)))
        else:
            provided.append(f"{name} {have}")
    return needs, provided
