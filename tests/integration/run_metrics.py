"""Reading a run's metrics.jsonl and comparing two runs step by step (resume-equivalence tests)."""

from __future__ import annotations

import json
import math
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


# Engine-count comparisons (one engine against several). Not bit-equal, and why: each engine batches its own
# share of the requests, so the CPU engine's fp32 logprobs differ from the one-engine run's in their last
# bits (measured: |dlogp| ~ 1e-8). The mismatch metrics measure exactly those bits (values 1e-14 .. 1e-6
# when sampler and learner agree to round-off), and the policy loss of near-on-policy steps is ~0 plus TIS
# weights of 1 +- 1e-7, so those are compared at fp32 logprob round-off (absolute 1e-6); every other
# metric at relative 1e-6.
ENGINE_COUNT_REL = 1e-6
SAMPLER_LOGP_ROUNDOFF = ("mismatch/", "loss/policy", "loss/total")
ABS_LOGP = 1e-6
# Sequence-level mismatch (`mismatch/seq_*`: per-sequence sums of token log-ratios, and their exp) adds one
# token's round-off per token: a 100-token trajectory's reached 1.4e-6 between one colocated and two
# disaggregated engines (seen once in CI, 4.8e-7 against 1.9e-6), so it is compared at 1e-5.
ABS_SEQ_LOGP = 1e-5


def engine_count_differences(a: dict[int, dict], b: dict[int, dict]) -> dict[str, tuple]:
    """{"step:key": (a, b)} for every non-timing metric of two runs outside the engine-count tolerances
    above; asserts both runs logged the same keys at every step of `a`."""
    bad: dict[str, tuple] = {}
    for step in a:
        da, db = deterministic(a[step]), deterministic(b[step])
        assert da.keys() == db.keys(), f"step {step}: {sorted(da.keys() ^ db.keys())}"
        for k in da:
            abs_tol = ABS_LOGP if k.startswith(SAMPLER_LOGP_ROUNDOFF) else 0.0
            if k.startswith("mismatch/") and "/seq_" in k:
                abs_tol = ABS_SEQ_LOGP
            if not math.isclose(da[k], db[k], rel_tol=ENGINE_COUNT_REL, abs_tol=abs_tol):
                bad[f"{step}:{k}"] = (da[k], db[k])
    return bad
