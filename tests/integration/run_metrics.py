"""Reading a run's metrics.jsonl and comparing two runs step by step (resume-equivalence tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

# Wall-clock figures differ between any two runs; everything else a seeded run logs must repeat.
_TIMING = re.compile(r"(^perf/|seconds|_per_s|per_second|gbps|gb_s|_time|elapsed)")


def last_record_per_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """The last record of every step in metrics.jsonl (a resumed run rewrites the steps after its checkpoint)."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[int(rec["step"])] = rec
    return out


def deterministic(rec: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in rec.items() if not _TIMING.search(k)}


def step_differences(a: dict[int, dict], b: dict[int, dict], steps) -> dict[int, dict]:
    """{step: {"only_in_one_run": [...], "changed": {key: (a, b)}}} for every step where the runs differ;
    values must be equal exactly (both runs are seeded and every reduction is in a fixed order)."""
    diffs: dict[int, dict] = {}
    for step in steps:
        da, db = deterministic(a[step]), deterministic(b[step])
        only = sorted(da.keys() ^ db.keys())
        changed = {k: (da[k], db[k]) for k in sorted(da.keys() & db.keys()) if da[k] != db[k]}
        if only or changed:
            diffs[step] = {"only_in_one_run": only, "changed": changed}
    return diffs
