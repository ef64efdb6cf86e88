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

With `--placement disaggregated` a third run follows, async with the same k on the placement of
docs/disaggregated.md (issue 27's benchmark: async disaggregated against colocated, the same total cores and
samples per step). It is launched as a user launches it, `python -m megagrpo.cli train CONFIG --nproc 2
<the same overrides> rollout.placement.kind=disaggregated rollout.mode=async rollout.max_staleness=k`, in a
subprocess: one learner rank and one engine rank (SGLang's HTTP server), on the same two cores as the
pinned runs, and its figures are its own metrics.jsonl's, with the same steps left out. What differs from
the in-process async run:
- the weights go over HTTP and a gloo broadcast group per sync (`sync/broadcast.py`), not through shared
  memory inside one process, and every request crosses HTTP;
- the learner is a process of its own (a torchrun rank), pinned like the other roles: the engine rank
  and its server's processes to `rollout.placement.engine_cores`, the learner rank to the other core,
  each process one thread (OMP_NUM_THREADS=1, as in the pinned runs); unpinned, the OS shared both cores
  between them, which, not HTTP or gloo, made most of the gap to the pinned async run (docs/scaling.md);
- the launch itself (torchrun, the rendezvous, the server's start) is outside every measured step.

    python -m tools.bench_async [--steps 8] [--k 1] [--prompts 8] [--group-size 8] [--new-tokens 48]
                                [--placement disaggregated]

(`-m` from the repository root: the runs' reward is `tools.bench_step:parity_reward`.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from statistics import mean
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("sleep", "old_logp", "train", "sync")


# the disaggregated launch: 1 learner rank + 1 engine rank, the pinned runs' two cores
DISAGG_NPROC = 2
DISAGG_TIMEOUT_S = 1800  # a hung launch ends the bench instead of holding the machine


class LaunchFailed(Exception):
    """The disaggregated launch exited non-zero or hung: the message carries its log's end."""


def overrides(tmp: Path, model: Path, name: str, args: argparse.Namespace) -> list[str]:
    """The overrides every run shares: the same model, samples per step and reward, dynamic sampling off,
    the paths of run `name` under `tmp`."""
    return [
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
        'rewards.functions=[{name: "tools.bench_step:parity_reward", weight: 1.0}]',
    ]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_mode(tmp: Path, model: Path, name: str, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    from megagrpo.config.loader import load_config
    from megagrpo.trainer.entry import run

    over = [
        *overrides(tmp, model, name, args),
        f"rollout.placement.engine_cores=[{args.engine_core}]",
        *extra,
    ]
    code = run("train", load_config(REPO / args.config, over), resume="never")
    if code:
        raise SystemExit(f"{name} run exited with {code}")
    return read_records(tmp / name / "run" / "metrics.jsonl")


def disaggregated_command(config: Path, over: list[str], k: int) -> list[str]:
    """The user's launch of the async disaggregated run: `megagrpo train CONFIG --nproc 2`, the last rank
    an engine (`rollout.num_engines=1`, the default on the CPU, written out)."""
    return [
        sys.executable,
        "-m",
        "megagrpo.cli",
        "train",
        str(config),
        "--nproc",
        str(DISAGG_NPROC),
        *over,
        "rollout.placement.kind=disaggregated",
        "rollout.num_engines=1",
        "rollout.mode=async",
        f"rollout.max_staleness={k}",
    ]


def run_disaggregated(tmp: Path, model: Path, args: argparse.Namespace, log: Path) -> list[dict]:
    """The async disaggregated run as a subprocess, its output in `log`; LaunchFailed with the log's end
    when it fails."""
    name = "async_disaggregated"
    cmd = disaggregated_command(REPO / args.config, overrides(tmp, model, name, args), args.k)
    # the ranks import the reward from tools/, and run one thread each, as the pinned runs do
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        # a session of its own: on a timeout the whole launch (torchrun, its ranks, the server) is ended
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = f"exit status {proc.wait(timeout=DISAGG_TIMEOUT_S)}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"no exit within {DISAGG_TIMEOUT_S} s, killed"
    if proc.returncode != 0:
        raise LaunchFailed(
            f"{name} run: {status}; the end of its log {log}:\n{log.read_text()[-8000:]}\n"
            f"command: {' '.join(cmd)}"
        )
    return read_records(tmp / name / "run" / "metrics.jsonl")


def ratios(colocated: Mapping[str, float], runs: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Each run's steps per minute over the colocated run's."""
    return {name: r["steps_per_minute"] / colocated["steps_per_minute"] for name, r in runs.items()}


def figures(records: list[dict]) -> dict[str, float]:
    """Means over the measured steps (the first and the last left out)."""
    steps = [r for r in records if r.get("step", 0) >= 1][1:-1]
    step_s = mean(r["perf/step_seconds"] for r in steps)
    rollout = mean(r.get("perf/rollout_seconds", 0.0) for r in steps)
    learner_idle = mean(r["perf/learner_idle_seconds"] for r in steps)
    return {
        "measured_steps": len(steps),
        "step_seconds": step_s,
        "steps_per_minute": 60.0 / step_s,
        "rollout_seconds": rollout,
        "learner_idle_seconds": learner_idle,
        # async: the wait for the engine's round before the weight sync, inside perf/sync_seconds (the
        # trainer logs idle = rollout + that wait; exact with one learner rank, the bench's layout)
        "sync_wait_seconds": learner_idle - rollout,
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
    p.add_argument(
        "--placement",
        choices=("colocated", "disaggregated"),
        default="colocated",
        help="disaggregated: also an async run with engine and learner in processes of their own",
    )
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
    load_before: dict[str, float] = {}  # the 1-minute load at each run's start: the machine is shared

    with tempfile.TemporaryDirectory(prefix="bench_async_") as td:
        tmp = Path(td)
        model = Path(
            make_tiny_model(tmp / "model", "qwen3_moe", hidden=128, layers=2, experts=8, topk=2, seed=0)
        )
        load_before["colocated"] = os.getloadavg()[0]
        colo = figures(run_mode(tmp, model, "colocated", args, []))
        load_before["async"] = os.getloadavg()[0]
        asyn = figures(
            run_mode(tmp, model, "async", args, ["rollout.mode=async", f"rollout.max_staleness={args.k}"])
        )
        disagg, failed = None, None
        if args.placement == "disaggregated":
            load_before["async_disaggregated"] = os.getloadavg()[0]
            log = Path(args.out if Path(args.out).is_absolute() else REPO / args.out).with_suffix(
                ".disagg.log"
            )
            try:
                disagg = figures(run_disaggregated(tmp, model, args, log))
            except LaunchFailed as e:  # the two runs in this process still report
                failed = str(e)
    R = colo["rollout_seconds"]
    T = colo["step_seconds"] - R  # the colocated step's rest, memory swaps included
    runs = {"async": asyn, **({"async_disaggregated": disagg} if disagg else {})}
    against = ratios(colo, runs)
    summary: dict[str, Any] = {
        "colocated": colo,
        **runs,
        "ratio_steps_per_minute": against["async"],
        **({"ratio_steps_per_minute_disaggregated": against["async_disaggregated"]} if disagg else {}),
        **({"async_disaggregated_failed": failed} if failed else {}),
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
            "placement": args.placement,
            "load_1m_before_run": load_before,
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
    if disagg:
        print(
            f"async disaggregated k={args.k} (1 learner rank + 1 engine rank): "
            f"{disagg['steps_per_minute']:.1f} steps/min (mean lag {disagg['staleness_mean']:.2f}, "
            f"sync {disagg['sync_seconds']:.2f} s/step of which {disagg['sync_wait_seconds']:.2f} waiting for "
            f"the engine, learner idle {disagg['learner_idle_seconds']:.2f} s/step), "
            f"ratio {against['async_disaggregated']:.2f}x against colocated"
        )
    write_figures(args.out, summary)
    if failed:
        print(failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
