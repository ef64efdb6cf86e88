#!/usr/bin/env python
"""Per-phase time breakdown of a GRPO step on the demo model, and the share spent outside model compute.

Builds the demo's tiny Qwen3-MoE (hidden 128, on CUDA 512; 2 layers, 8 experts, top-2) in a temporary directory, loads
`configs/demo_qwen3_moe.yaml` with the model, checkpoint and log paths pointed there (no SFT: the random
model gets a length-parity reward so dynamic sampling keeps groups), starts `GRPOTrainer` (real SGLang
engine, real megatron learner) and runs --steps steps; the first --warmup steps are excluded.

Phases are the trainer's own `perf/<phase>_seconds` (rollout, reward, sleep, old_logp, train, sync) plus
`other` = `perf/step_seconds` minus their sum. Model compute is timed by wrapping, from this script only:
  generate          the SGLang engine's `async_generate` call inside `RolloutEngine.generate`
  forward_backward  the schedule returned by megatron's `get_forward_backward_func` (old-policy pass and
                    training; it includes the logprob/entropy head and the loss, which run inside it)
  optimizer         `learner.optimizer.step` (grad clipping + Adam)
  weight_load       the engine's `update_weights_from_tensor` calls during sync
Framework overhead = step seconds - model compute seconds (issue 9's goal: at most 15% of the step).
Metric logging (JSONL + TensorBoard) happens after `perf/step_seconds` is taken; it is reported separately.

    python tools/bench_step.py [--steps 4] [--warmup 1] [--prompts 16] [--group-size 8] [--out FILE]

`--families` (issue 37) times the rollout's model compute alone, the SGLang CPU engine's generation, for
Qwen3-MoE, DeepSeek-V3 (multi-latent attention, served through `megagrpo.compat.sglang_cpu`'s torch-native
MLA path) and GLM-4.5 at similar parameter counts (`tools/bench_families.py`): one engine per family, all
three started first and kept up, then `--rounds` rotated rounds; in each, every engine runs a prefill
call (`--prompts` random prompts of `--prompt-len` tokens, one new token) and a generation call (the same
prompts, `--new-tokens` tokens each, `ignore_eos`), each after a flush of its prefix cache. Prefill per
token = the first call over the prompt tokens; decode per token = (second - first) over the tokens decoded
after the first. Min over rounds; ratios of time per token to Qwen3-MoE's (goal: <= 1.5x). Figures:
docs/scaling.md, "Model families".

    python tools/bench_step.py --families [--rounds 3] [--prompts 16] [--prompt-len 128] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

try:
    from tools import bench_families as fam
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    import bench_families as fam
    from machine import describe, headline

REPO = Path(__file__).resolve().parents[1]

PHASES = ("rollout", "reward", "sleep", "old_logp", "train", "sync")
OTHER = "other"  # step time outside every named phase (batch building, mismatch metrics, broadcasts, ...)
COMPUTE_KINDS = ("generate", "forward_backward", "optimizer", "weight_load")
OVERHEAD_GOAL = 0.15


def parity_reward(prompt: str, completion: str, sample: dict) -> float:
    """1 for an even-length completion: a random model's samples differ in length, so groups keep a
    non-zero reward spread and dynamic sampling keeps them (the demo's exact-match reward would be 0)."""
    return float(len(completion) % 2 == 0)


# -- figures (pure) ---------------------------------------------------------------------------------


def step_record(metrics: Mapping[str, float], compute: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """One step's figures from the trainer's metrics and the compute seconds by {phase: {kind: s}}."""
    phases = {p: float(metrics.get(f"perf/{p}_seconds", 0.0)) for p in PHASES}
    return {
        "skipped": bool(metrics.get("rollout/skipped_step", 0.0)),
        "step_seconds": float(metrics["perf/step_seconds"]),
        "phases": phases,
        "compute": {ph: dict(kinds) for ph, kinds in compute.items()},
        "tokens_per_second": float(metrics.get("perf/tokens_per_second", 0.0)),
        "completions": float(metrics.get("rollout/completions", 0.0)),
        "dynamic_rounds": float(metrics.get("rollout/dynamic_rounds", 0.0)),
    }


def summarize(records: Sequence[Mapping[str, Any]], warmup: int = 1) -> dict[str, Any]:
    """Mean per-phase seconds, compute vs overhead, over the records after the first `warmup` ones.

    Skipped steps (no group kept, no update) are excluded: they have no learner phases. Shares are ratios
    of totals over the measured steps (sum of phase seconds / sum of step seconds), so long steps weigh
    more, as they do in a run. Raises ValueError when no step is left to measure.
    """
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    kept = [r for r in records[warmup:] if not r["skipped"]]
    if not kept:
        raise ValueError(
            f"no measured step: {len(records)} steps, warmup={warmup}, "
            f"{sum(r['skipped'] for r in records[warmup:])} skipped after warm-up"
        )
    n = len(kept)
    step = sum(r["step_seconds"] for r in kept) / n
    phase_s = {p: sum(r["phases"].get(p, 0.0) for r in kept) / n for p in PHASES}
    phase_s[OTHER] = step - sum(phase_s[p] for p in PHASES)
    compute_by_phase: dict[str, dict[str, float]] = {p: defaultdict(float) for p in (*PHASES, OTHER)}
    for r in kept:
        for ph, kinds in r["compute"].items():
            dest = compute_by_phase[ph if ph in compute_by_phase else OTHER]
            for kind, s in kinds.items():
                dest[kind] += s / n
    compute_kind = {k: sum(compute_by_phase[p].get(k, 0.0) for p in compute_by_phase) for k in COMPUTE_KINDS}
    compute = sum(compute_kind.values())
    overhead = step - compute
    share = (lambda s: s / step) if step > 0 else (lambda s: 0.0)
    phases = {}
    for p in (*PHASES, OTHER):
        c = sum(compute_by_phase[p].values())
        phases[p] = {
            "seconds": phase_s[p],
            "share": share(phase_s[p]),
            "compute_seconds": c,
            "overhead_seconds": phase_s[p] - c,
        }
    return {
        "steps_measured": n,
        "steps_skipped": sum(r["skipped"] for r in records[warmup:]),
        "step_seconds": step,
        "phases": phases,
        "compute_by_kind": compute_kind,
        "compute_seconds": compute,
        "overhead_seconds": overhead,
        "compute_share": share(compute),
        "overhead_share": share(overhead),
        "overhead_goal": OVERHEAD_GOAL,
        "meets_goal": share(overhead) <= OVERHEAD_GOAL,
        "tokens_per_second": sum(r["tokens_per_second"] for r in kept) / n,
        "completions_per_step": sum(r["completions"] for r in kept) / n,
    }


# -- instrumentation (wraps from here; production code is unchanged) -------------------------------


class ComputeClock:
    """Seconds of model compute by (current trainer phase, kind)."""

    def __init__(self) -> None:
        self.phase = OTHER
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def _add(self, kind: str, seconds: float) -> None:
        self.seconds[self.phase][kind] += seconds

    def take(self) -> dict[str, dict[str, float]]:
        out = {ph: dict(k) for ph, k in self.seconds.items()}
        self.seconds.clear()
        return out

    def timed(self, kind: str, fn: Callable) -> Callable:
        import torch

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():  # queued kernels belong to this call, not to what follows
                    torch.cuda.synchronize()
                self._add(kind, time.perf_counter() - t0)

        return wrapper

    def timed_async(self, kind: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self._add(kind, time.perf_counter() - t0)

        return wrapper


@contextmanager
def instrumented(trainer: Any, clock: ComputeClock) -> Iterator[None]:
    """Wrap the four compute calls and the trainer's PhaseTimer (to know the phase); undone on exit."""
    import megatron.core.pipeline_parallel as pp

    import megagrpo.trainer.grpo as grpo

    base_timer = grpo.PhaseTimer

    class TrackingPhaseTimer(base_timer):
        @contextmanager
        def __call__(self, name: str):
            prev, clock.phase = clock.phase, name
            try:
                with base_timer.__call__(self, name):
                    yield
            finally:
                clock.phase = prev

    orig_fbf = pp.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        return clock.timed("forward_backward", orig_fbf(*args, **kwargs))

    sgl = trainer.engine.engine  # the sglang.Engine inside RolloutEngine
    opt = trainer.learner.optimizer
    saved = [(grpo, "PhaseTimer", base_timer), (pp, "get_forward_backward_func", orig_fbf)]
    grpo.PhaseTimer = TrackingPhaseTimer
    pp.get_forward_backward_func = get_forward_backward_func
    for obj, attr, kind, is_async in (
        (sgl, "async_generate", "generate", True),
        (sgl, "update_weights_from_tensor", "weight_load", False),
        (opt, "step", "optimizer", False),
    ):
        orig = getattr(obj, attr)
        had_own = attr in vars(obj)
        saved.append((obj, attr, orig if had_own else None))
        setattr(obj, attr, (clock.timed_async if is_async else clock.timed)(kind, orig))
    try:
        yield
    finally:
        for obj, attr, orig in reversed(saved):
            if orig is None:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, orig)


# -- the run ----------------------------------------------------------------------------------------


def bench_overrides(tmp: Path, model: Path, args: argparse.Namespace) -> list[str]:
    return [
        f"model.hf_path={model}",
        f"checkpoint.dir={tmp / 'checkpoints'}",
        f"logging.out_dir={tmp / 'run'}",
        "checkpoint.resume=never",
        f"schedule.steps={args.steps}",
        "schedule.save_every=0",
        "schedule.eval_every=0",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        'rewards.functions=[{name: "tools.bench_step:parity_reward", weight: 1.0}]',
        *args.overrides,
    ]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from megagrpo.config.loader import load_config
    from megagrpo.tiny_model import make_tiny_model

    machine = describe()
    with tempfile.TemporaryDirectory(prefix="bench_step_") as td:
        tmp = Path(td)
        import torch

        # On CUDA, hidden 512 (head_dim 128): SGLang's CUDA engine refuses head_dim < 64 (docs/gpu.md).
        hidden = 512 if torch.cuda.is_available() else 128
        model = make_tiny_model(
            tmp / "model", "qwen3_moe", hidden=hidden, layers=2, experts=8, topk=2, seed=0
        )
        cfg = load_config(REPO / args.config, bench_overrides(tmp, Path(model), args))

        # As `megagrpo train` does (megagrpo/trainer/entry.py): CPU compat first, then the trainer.
        from megagrpo.compat import apply_cpu_compat

        apply_cpu_compat(megatron=True, sglang=True)
        from megagrpo.trainer.grpo import GRPOTrainer

        t0 = time.perf_counter()
        trainer = GRPOTrainer(cfg, resume="never")
        setup_s = time.perf_counter() - t0
        records: list[dict[str, Any]] = []
        log_s: list[float] = []
        clock = ComputeClock()
        try:
            with instrumented(trainer, clock):
                for i in range(args.steps):
                    trainer._calls = (
                        0  # engine calls within the step: part of the sampling seeds (Session.loop)
                    )
                    clock.take()
                    metrics = trainer.train_step()
                    trainer.step += 1
                    rec = step_record(metrics, clock.take())
                    t_log = time.perf_counter()
                    trainer.logger.log(trainer.step, metrics)
                    log_s.append(time.perf_counter() - t_log)
                    records.append(rec)
                    tag = "warm-up" if i < args.warmup else ("skipped" if rec["skipped"] else "measured")
                    print(
                        f"step {trainer.step}/{args.steps} ({tag}): {rec['step_seconds']:.2f} s, "
                        f"{int(rec['completions'])} completions",
                        flush=True,
                    )
        finally:
            trainer.close()
    summary = summarize(records, args.warmup)
    measured_log = log_s[args.warmup :] or [0.0]
    summary["metrics_log_seconds"] = sum(measured_log) / len(measured_log)
    summary["setup_seconds"] = setup_s
    summary["run"] = {
        "config": args.config,
        "steps": args.steps,
        "warmup": args.warmup,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "group_size": cfg.rollout.group_size,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "micro_batch_size": cfg.schedule.micro_batch_size,
        "variant": cfg.algo.variant,
        "replay": cfg.replay,
        "overrides": list(args.overrides),
        "machine": describe(machine),
    }
    summary["records"] = records
    return summary


def render(summary: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(headline(summary["run"]["machine"]))
    step = summary["step_seconds"]
    t = Table(
        title=f"GRPO step on the demo model: mean of {summary['steps_measured']} steps ({step:.2f} s/step)"
    )
    for col in ("phase", "mean s", "share of step", "model compute s", "overhead s"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for p, f in summary["phases"].items():
        t.add_row(
            p,
            f"{f['seconds']:.3f}",
            f"{100 * f['share']:.1f}%",
            f"{f['compute_seconds']:.3f}",
            f"{f['overhead_seconds']:.3f}",
        )
    t.add_section()
    t.add_row(
        "step",
        f"{step:.3f}",
        "100.0%",
        f"{summary['compute_seconds']:.3f}",
        f"{summary['overhead_seconds']:.3f}",
    )
    con.print(t)

    k = Table(title="model compute by kind")
    k.add_column("kind")
    k.add_column("mean s", justify="right")
    k.add_column("share of step", justify="right")
    for kind, s in summary["compute_by_kind"].items():
        k.add_row(kind, f"{s:.3f}", f"{100 * s / step:.1f}%" if step > 0 else "-")
    con.print(k)

    ok = summary["meets_goal"]
    con.print(
        f"model compute:      {summary['compute_seconds']:.3f} s/step ({100 * summary['compute_share']:.1f}%)"
    )
    con.print(
        f"framework overhead: {summary['overhead_seconds']:.3f} s/step "
        f"([{'green' if ok else 'red'}]{100 * summary['overhead_share']:.1f}%[/], goal <= "
        f"{100 * summary['overhead_goal']:.0f}%)"
    )
    con.print(f"outside the step:   metrics logging {summary['metrics_log_seconds']:.3f} s/step")
    con.print(f"setup:              learner + engine start {summary['setup_seconds']:.1f} s (once)")


# -- --families: the engine's generation per token ---------------------------------------------------


def family_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random token ids below `vocab` (the same for every family)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def generation_split(prefill_s: float, generate_s: float, prompts: int, prompt_len: int, new_tokens: int):
    """(prefill seconds, prompt tokens, decode seconds, decoded tokens) from the two calls of a round: the
    prefill call decodes one token per prompt, the generation call `new_tokens`, so the decode of the
    other `new_tokens - 1` is the difference of the two."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 to leave a decode step to time")
    return prefill_s, prompts * prompt_len, generate_s - prefill_s, prompts * (new_tokens - 1)


def run_families(args: argparse.Namespace) -> dict[str, Any]:
    import contextlib
    import os

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the engines' spawned processes at start
    import torch

    torch.set_num_threads(args.threads)
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from megagrpo.rollout import RolloutConfig, RolloutEngine, SamplingConfig

    try:
        from tools.bench_agentic import flush_prefix_cache
    except ModuleNotFoundError:
        from bench_agentic import flush_prefix_cache

    machine = describe()
    prompts = family_prompts(args.prompts, args.prompt_len, vocab=1000)
    first = SamplingConfig(temperature=1.0, max_new_tokens=1, seed=0, ignore_eos=True)
    full = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, seed=0, ignore_eos=True)
    kv_tokens = max(4096, 2 * args.prompts * (args.prompt_len + args.new_tokens))
    with tempfile.TemporaryDirectory(prefix="bench_step_families_") as tmp, contextlib.ExitStack() as stack:
        dirs = fam.build_family_models(tmp)
        params = {f: fam.param_count(d) for f, d in dirs.items()}
        engines = {}
        for f, d in dirs.items():
            t0 = time.perf_counter()
            cfg = RolloutConfig(str(d), dtype="float32", max_total_tokens=kv_tokens, seed=0)
            engines[f] = stack.enter_context(RolloutEngine(cfg))
            print(f"{f}: engine started in {time.perf_counter() - t0:.0f} s", flush=True)

        def once(f: str) -> dict[str, float]:
            out = {}
            for kind, sampling in (("prefill", first), ("generate", full)):
                flush_prefix_cache(engines[f])
                t0 = time.perf_counter()
                engines[f].generate(prompts, sampling)
                out[kind] = time.perf_counter() - t0
            return out

        times = fam.rotated_rounds(list(dirs), args.rounds, once)
    prefill, decode, p_tok, d_tok = {}, {}, {}, {}
    for f, t in times.items():
        prefill[f], p_tok[f], decode[f], d_tok[f] = generation_split(
            min(t["prefill"]), min(t["generate"]), args.prompts, args.prompt_len, args.new_tokens
        )
    rows = {"prefill": fam.per_token_rows(prefill, p_tok), "decode": fam.per_token_rows(decode, d_tok)}
    print(headline(describe(machine)))
    for kind, r in rows.items():
        print(
            fam.render_rows(
                f"SGLang CPU engine, {kind} ({args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new; "
                f"fp32, {args.threads} thread(s); min of {args.rounds} rotated rounds; ratio = time per token / "
                f"{fam.BASELINE}'s, goal <= {fam.GOAL_RATIO}x)",
                r,
                params,
            )
        )
    return {"machine": describe(machine), "params": params, "rows": rows, "times": times}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo_qwen3_moe.yaml", help="relative to the repository")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps to run, warm-up included")
    p.add_argument("--warmup", type=int, default=1, help="first steps excluded from the figures")
    p.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_step")
    p.add_argument("--group-size", type=int, default=8, help="rollout.group_size (G)")
    p.add_argument(
        "--out", default="outputs/bench_step.json", help="JSON figures (relative to the repository)"
    )
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides, e.g. replay=none")
    p.add_argument("--families", action="store_true", help="the engine's generation per token per family")
    p.add_argument("--rounds", type=int, default=3, help="--families: measured rotated rounds")
    p.add_argument("--prompt-len", type=int, default=128, help="--families: tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="--families: tokens generated per prompt")
    p.add_argument("--threads", type=int, default=1, help="--families: torch threads here and in the engines")
    args = p.parse_args(argv)
    if args.families:
        write_figures(args.out.replace("bench_step.json", "bench_step_families.json"), run_families(args))
        return 0
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} to leave a measured step")

    summary = run_bench(args)
    render(summary)
    write_figures(args.out, summary)
    return 0


def write_figures(out_arg: str, summary: Mapping[str, Any]) -> Path:
    """The figures as JSON at `out_arg` (relative to the repository unless absolute)."""
    out = Path(out_arg) if Path(out_arg).is_absolute() else REPO / out_arg
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"figures: {out}")
    return out


if __name__ == "__main__":
    sys.exit(main())
