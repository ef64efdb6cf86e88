#!/usr/bin/env python
"""Rollout throughput of data-parallel engines: N CPU SGLang engines, each on its own process and 1/N of
the threads, sampling 1/N of a round each (`rollout.groups.EngineGroups.share`), against one engine with
all the threads sampling the whole round. Same tiny Qwen3-MoE, same prompts, same seeds, same total thread
count; the ratio comes from one run (the two layouts alternate, min over --reps).

    python tools/bench_scale.py [--engines 2] [--threads 2] [--prompts 32] [--group 4] [--new-tokens 32]

Prints one JSON line: tokens/s of each layout and the ratio (goal >= 1.5x for 2 engines, issue 14).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline


def _engine_worker(
    model: str, threads: int, prompts: list, group: int, new_tokens: int, offset: int, start, out
):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from megagrpo.rollout import RolloutConfig, RolloutEngine, SamplingConfig

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=1234, ignore_eos=True)
    with RolloutEngine(RolloutConfig(model_path=model, dtype="float32", max_total_tokens=8192)) as eng:
        eng.generate(prompts[:1], sampling, 1)  # warm-up outside the timed region
        start.wait()
        t0 = time.perf_counter()
        groups = eng.generate(prompts, sampling, group, index_offset=offset)
        seconds = time.perf_counter() - t0
    out.put((sum(c.output_ids.numel() for g in groups for c in g), seconds))


def run_layout(model: str, n: int, threads: int, prompts: list, group: int, new_tokens: int) -> float:
    """Tokens per second of `n` engines sampling `prompts` together (wall time of the slowest)."""
    from megagrpo.rollout.groups import EngineGroups

    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n), ctx.Queue()
    layout = EngineGroups(world=n, rank=0, num_engines=n)
    procs = []
    for e in range(n):
        share = layout.share(len(prompts), e)
        args = (
            model,
            max(1, threads // n),
            prompts[share.start : share.stop],
            group,
            new_tokens,
            share.start * group,
        )
        procs.append(ctx.Process(target=_engine_worker, args=(*args, start, out)))
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return sum(t for t, _ in results) / max(s for _, s in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="total threads, split evenly over the engines")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args(argv)
    from megagrpo.tiny_model import make_tiny_model

    machine = describe()

    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            make_tiny_model(Path(tmp) / "m", "qwen3_moe", hidden=128, layers=2, experts=8, topk=2, seed=0)
        )
        prompts = [[1 + (7 * i + j) % 200 for j in range(12)] for i in range(a.prompts)]
        one, many = [], []
        for _ in range(a.reps):
            one.append(run_layout(model, 1, a.threads, prompts, a.group, a.new_tokens))
            many.append(run_layout(model, a.engines, a.threads, prompts, a.group, a.new_tokens))
    best_one, best_many = max(one), max(many)
    machine = describe(machine)
    print(headline(machine))
    print(
        json.dumps(
            {
                "engines": a.engines,
                "threads_total": a.threads,
                "requests": a.prompts * a.group,
                "tokens_per_s_1_engine": round(best_one, 1),
                f"tokens_per_s_{a.engines}_engines": round(best_many, 1),
                "ratio": round(best_many / best_one, 3),
                "machine": machine,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
