#!/usr/bin/env python
"""Steps per minute of async rollout (`rollout.mode: async`, max_staleness k) against colocated mode, on
this CPU, side by side in one process.

Both runs: the demo config on the same tiny Qwen3-MoE (hidden 128, 2 layers, 8 experts, top-2), a
length-parity reward, dynamic sampling off (the same samples every step), and the same placement: the
engine's processes on one core, the learner on the others (`rollout.placement.engine_cores`). Each run
goes through `megagrpo train`'s own path (`trainer.entry.run`); the figures are the runs' own
`perf/step_seconds`, leaving out the first step (warm-up, sampled synchronously in both modes) and the
last (async has nothing left to overlap with it).

Model of the gain: with rollout time R (generation + rewards) and the rest of a colocated step T, an
overlapped step costs max(R, T) + the wait for the engine, so the ratio is at most (R + T) / max(R, T):
2x at a rollout share R / (R + T) of 1/2, and 1 / share (or 1 / (1 - share)) away from it. The run
prints the measured share and this bound beside the measured ratio.

    python -m tools.bench_async [--steps 8] [--k 1] [--prompts 8] [--group-size 8] [--new-tokens 48]

(`-m` from the repository root: the runs' reward is `tools.bench_step:parity_reward`.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("sleep", "old_logp", "train", "sync")


def run_mode(tmp: Path, model: Path, name: str, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    from megagrpo.config.loader import load_config
    from megagrpo.trainer.entry import run

    over = [
        f"model.hf_path={model}",
        f"checkpoint.dir={tmp / name / 'ckpt'}",
        f"logging.out_dir={tmp / name / 'run'}",
        "checkpoint.resume=never",
        f"schedule.steps={args.steps}",
        "schedule.save_every=0",
        "schedule.eval_every=0",
        "logging.console=false",
        "algo.dynamic_sampling=false",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"rollout.placement.engine_cores=[{args.engine_core}]",
        'rewards.functions=[{name: "tools.bench_step:parity_reward", weight: 1.0}]',
        *extra,
    ]
    code = run("train", load_config(REPO / args.config, over), resume="never")
    if code:
        raise SystemExit(f"{name} run exited with {code}")
    lines = (tmp / name / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def figures(records: list[dict]) -> dict[str, float]:
    """Means over the measured steps (the first and the last left out)."""
    steps = [r for r in records if r.get("step", 0) >= 1][1:-1]
    step_s = mean(r["perf/step_seconds"] for r in steps)
    return {
        "measured_steps": len(steps),
        "step_seconds": step_s,
        "steps_per_minute": 60.0 / step_s,
        "rollout_seconds": mean(r.get("perf/rollout_seconds", 0.0) for r in steps),
        "learner_idle_seconds": mean(r["perf/learner_idle_seconds"] for r in steps),
        "sampler_idle_seconds": mean(r["perf/sampler_idle_seconds"] for r in steps),
        "completions": mean(r["rollout/completions"] for r in steps),
        # where the rest of the step goes: colocated mode also swaps the engine's memory (sleep, and the
        # resumes inside sync), which async mode does not do at all
        **{f"{p}_seconds": mean(r.get(f"perf/{p}_seconds", 0.0) for r in steps) for p in PHASES},
        "staleness_mean": mean(r["rollout/staleness_mean"] for r in steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo_qwen3_moe.yaml", help="relative to the repository")
    p.add_argument("--steps", type=int, default=8, help="steps per mode, the first and last not measured")
    p.add_argument("--k", type=int, default=1, help="rollout.max_staleness of the async run")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--engine-core", type=int, default=None, help="default: the last available core")
    p.add_argument("--out", default="outputs/bench_async.json")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps must be at least 4: the first and the last step are not measured")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        p.error(f"this process may use {len(cores)} core(s); the benchmark needs 2 (engine and learner)")
    if args.engine_core is None:
        args.engine_core = cores[-1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from megagrpo.tiny_model import make_tiny_model
    from tools.bench_step import write_figures
    from tools.machine import describe, headline

    machine = describe()

    with tempfile.TemporaryDirectory(prefix="bench_async_") as td:
        tmp = Path(td)
        model = make_tiny_model(tmp / "model", "qwen3_moe", hidden=128, layers=2, experts=8, topk=2, seed=0)
        colo = figures(run_mode(tmp, Path(model), "colocated", args, []))
        asyn = figures(
            run_mode(
                tmp, Path(model), "async", args, ["rollout.mode=async", f"rollout.max_staleness={args.k}"]
            )
        )
    R = colo["rollout_seconds"]
    T = colo["step_seconds"] - R  # the colocated step's rest, memory swaps included
    summary: dict[str, Any] = {
        "colocated": colo,
        "async": asyn,
        "ratio_steps_per_minute": asyn["steps_per_minute"] / colo["steps_per_minute"],
        "rollout_share_colocated": R / colo["step_seconds"],
        "bound_from_share": (R + T) / max(R, T),
        "run": {
            "k": args.k,
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.new_tokens,
            "engine_core": args.engine_core,
            "cores": cores,
        },
        "machine": describe(machine),
    }
    print(headline(summary["machine"]))
    print(
        f"colocated: {colo['steps_per_minute']:.1f} steps/min (rollout share {summary['rollout_share_colocated']:.2f})\n"
        f"async k={args.k}: {asyn['steps_per_minute']:.1f} steps/min (mean lag {asyn['staleness_mean']:.2f}, "
        f"learner idle {asyn['learner_idle_seconds']:.2f} s/step, sampler idle {asyn['sampler_idle_seconds']:.2f} s/step)\n"
        f"ratio {summary['ratio_steps_per_minute']:.2f}x (bound from the rollout share: "
        f"{summary['bound_from_share']:.2f}x)"
    )
    write_figures(args.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
