#!/usr/bin/env python
"""Benchmark learner -> SGLang weight sync against a same-process state_dict copy of the same bytes.

For tiny Qwen3-MoE models with 8, 32 and 128 experts at one hidden size, start a CPU SGLang engine, sync the
model's own checkpoint tensors into it with `megagrpo.sync.sync_weights`, and time it (min over --reps runs)
against copying the same tensors into preallocated tensors in this process. Two transports are timed in the
same engine:

* `packed` (the default of `sync_weights`): tensors packed into SGLang's parameter layout, `load_format=direct`;
* `hf`: HF-named tensors through SGLang's own `load_weights` (`pack=False`, the transport before packing).

Every rep syncs fresh copies of the tensors (cloned outside the timed region), as a learner export would
yield, and the copy baseline is timed right before each sync rep (min over reps for both), so both see the
same machine load. `--threads` sets torch's intra-op threads in this process and in the engine's processes
(OMP_NUM_THREADS); default 1, because on a small shared CPU every torch op with 2+ OpenMP threads waits
at a barrier for a thread that another process has descheduled (measured here: 30x slower small ops).

For each, `engine_s` is the time the scheduler spent inside the model runner's `update_weights_from_tensor`
(SGLang's `load_weights` for `hf`, a `copy_` per parameter for `packed`), measured in the scheduler process
by a timing hook this script installs (`_timed_scheduler_entry`). Prints one JSON line per size with the
ratios sync/copy, then the scaling exponents (slope of log time vs log bytes; 1.0 = linear) of sync time
and engine load time per transport. Also reports the engine-vs-transformers logprob gap on fixed sequences.

    python tools/bench_sync.py [--experts 8 32 128] [--hidden 256] [--reps 3] [--dtype float32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline

_TIMING_DIR_ENV = "MEGAGRPO_BENCH_SYNC_TIMING_DIR"


def _timed_scheduler_entry(*args, **kwargs):
    """Scheduler process target: record the duration of every model-runner weight update, then run the
    megagrpo CPU scheduler entry (which applies the CPU patches and starts SGLang's scheduler)."""
    from megagrpo.compat import sglang_cpu

    sglang_cpu.apply()
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    upstream = WeightUpdater.update_weights_from_tensor
    path = Path(os.environ[_TIMING_DIR_ENV]) / f"{os.getpid()}.txt"

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return upstream(self, *a, **kw)
        finally:
            with open(path, "a") as f:
                f.write(f"{time.perf_counter() - t0}\n")

    WeightUpdater.update_weights_from_tensor = timed
    return sglang_cpu.scheduler_process_entry(*args, **kwargs)


def _engine_seconds(timing_dir: Path) -> float:
    """Sum of the update durations recorded since the last call (and clear them)."""
    total = 0.0
    for path in timing_dir.glob("*.txt"):
        total += sum(float(x) for x in path.read_text().split())
        path.unlink()
    return total


def _copy_seconds(tensors: list[tuple[str, torch.Tensor]], dst: dict[str, torch.Tensor]) -> float:
    """One state_dict-style copy of `tensors` into the preallocated (already touched) `dst`."""
    t0 = time.perf_counter()
    for n, t in tensors:
        dst[n].copy_(t)
    return time.perf_counter() - t0


def _logprob_gap(engine, model_dir: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = [[5, 17, 33, 2, 90, 14, 200, 7, 61, 8], [1, 307, 260, 202, 90, 301, 314, 224]]
    gap = 0.0
    for lp, s in zip(engine.score(seqs), seqs):
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        gap = max(gap, float((lp - ref).abs().max()))
    return gap


def _slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--transports", nargs="+", default=["packed", "hf"], choices=["packed", "hf"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads here and in the engine")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    machine = describe()
    print(headline(machine), flush=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # read by the engine's spawned processes at start

    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from safetensors.torch import load_file
    from sglang.srt.entrypoints.engine import Engine

    from megagrpo.rollout import RolloutConfig, RolloutEngine
    from megagrpo.sync import bucketize, sync_weights
    from megagrpo.tiny_model import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        timing_dir = Path(tmp) / "timing"
        timing_dir.mkdir()
        os.environ[_TIMING_DIR_ENV] = str(timing_dir)
        compat_entry = Engine.run_scheduler_process_func
        Engine.run_scheduler_process_func = staticmethod(_timed_scheduler_entry)  # instrumentation only
        try:
            for e in a.experts:
                model_dir = make_tiny_model(
                    Path(tmp) / f"moe{e}", "qwen3_moe", hidden=a.hidden, experts=e, topk=2
                )
                tensors = list(load_file(model_dir / "model.safetensors").items())
                cast = getattr(torch, a.dtype)
                tensors = [(n, t.to(cast)) for n, t in tensors]
                nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
                cfg = RolloutConfig(str(model_dir), dtype=a.dtype, max_total_tokens=1024, return_routes=False)
                row: dict = dict(
                    experts=e, bytes=nbytes, tensors=len(tensors), dtype=a.dtype, threads=a.threads
                )
                dst = {n: t.clone() for n, t in tensors}  # the copy baseline's destination, pages touched
                copy = math.inf
                with RolloutEngine(cfg) as engine:
                    row["logprob_gap_vs_hf"] = _logprob_gap(engine, str(model_dir))
                    for transport in a.transports:
                        pack = transport == "packed"
                        sync_weights(engine, bucketize(tensors), pack=pack)  # warm-up
                        _engine_seconds(timing_dir)
                        best, best_engine = math.inf, math.inf
                        for _ in range(a.reps):
                            fresh = [(n, t.clone()) for n, t in tensors]  # a new export every step
                            copy = min(copy, _copy_seconds(fresh, dst))
                            stats = sync_weights(engine, bucketize(fresh), pack=pack)
                            assert stats.packed == pack, f"{transport}: packed={stats.packed}"
                            best = min(best, stats.seconds)
                            best_engine = min(best_engine, _engine_seconds(timing_dir))
                        ok = sync_weights(engine, bucketize(tensors), checksum=True, pack=pack).checksum_ok
                        _engine_seconds(timing_dir)
                        row[f"{transport}_sync_s"] = round(best, 4)
                        row[f"{transport}_engine_s"] = round(best_engine, 4)
                        row[f"{transport}_checksum_ok"] = ok
                row["copy_s"] = round(copy, 5)
                for transport in a.transports:
                    row[f"{transport}_ratio"] = round(row[f"{transport}_sync_s"] / copy, 2)
                row["load_avg_1m"] = round(os.getloadavg()[0], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            Engine.run_scheduler_process_func = compat_entry
            os.environ.pop(_TIMING_DIR_ENV, None)
    if len(rows) >= 2:
        xs = [r["bytes"] for r in rows]
        out = {}
        for transport in a.transports:
            out[f"{transport}_sync_exponent"] = round(_slope(xs, [r[f"{transport}_sync_s"] for r in rows]), 3)
            out[f"{transport}_engine_exponent"] = round(
                _slope(xs, [r[f"{transport}_engine_s"] for r in rows]), 3
            )
        out["copy_exponent"] = round(_slope(xs, [r["copy_s"] for r in rows]), 3)
        print(json.dumps(out))
    print(json.dumps({"machine": describe(machine)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
