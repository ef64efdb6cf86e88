"""The family mode shared by `tools/bench_logprobs.py --families` and `tools/bench_step.py --families`.

Issue 37's goal: DeepSeek-V3 (multi-latent attention) and GLM-4.5 (`glm4_moe`) cost at most 1.5x Qwen3-MoE's
time per token on this CPU, at a similar parameter count, in the learner's logprob forward and in the
SGLang engine's generation (prefill and decode). This module holds what both benchmarks share:

  * the three tiny models (`FAMILIES`), sized so that their parameter counts agree within `PARAM_SPREAD`
    of Qwen3-MoE's: hidden 64, top-2. Qwen3-MoE: 2 MoE layers of 8 experts (353,664 parameters).
    deepseek_v3 and glm4_moe: the same 2 MoE layers behind their dense first layer (3 layers), 12 experts
    each, since their experts are half as wide (`moe_intermediate_size` = hidden / 2) and one shared expert
    sits beside them (about 355k parameters each; `tiny_model.make_config`);
  * the timing protocol of the other benchmarks: every round runs every family once, in a rotated order, so
    load from other processes on this shared machine hits all of them alike; round 0 warms up and is
    dropped; the figure is the minimum over rounds (the least noisy statistic here);
  * the per-token figures and their ratios to Qwen3-MoE, measured side by side in the same run.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

BASELINE = "qwen3_moe"
# make_tiny_model's keyword arguments per family (hidden 64 and top-2 for all)
FAMILIES: dict[str, dict[str, int]] = {
    "qwen3_moe": dict(layers=2, experts=8),
    "deepseek_v3": dict(layers=3, experts=12),
    "glm4_moe": dict(layers=3, experts=12),
}
HIDDEN, TOPK = 64, 2
GOAL_RATIO = 1.5  # a family's time per token / Qwen3-MoE's (issue 37)
PARAM_SPREAD = 0.10  # |params / Qwen3-MoE's params - 1| at most this


def param_count(model_dir: str | Path) -> int:
    """Parameters stored in a model directory's safetensors files, read from their headers only."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def check_param_spread(
    counts: Mapping[str, int], baseline: str = BASELINE, spread: float = PARAM_SPREAD
) -> None:
    """Raise ValueError when a family's parameter count is not within `spread` of the baseline's."""
    base = counts[baseline]
    off = {f: n / base - 1 for f, n in counts.items() if abs(n / base - 1) > spread}
    if off:
        detail = ", ".join(f"{f} {counts[f]:,} ({100 * d:+.1f}%)" for f, d in off.items())
        raise ValueError(
            f"parameter counts differ from {baseline}'s {base:,} by more than {100 * spread:.0f}%: {detail}"
        )


def build_family_models(root: str | Path, families: Sequence[str] = tuple(FAMILIES)) -> dict[str, Path]:
    """The tiny models of `families` under `root` (one directory each), after checking their sizes."""
    from megagrpo.tiny_model import make_tiny_model

    dirs = {
        f: make_tiny_model(Path(root) / f, f, hidden=HIDDEN, topk=TOPK, seed=0, **FAMILIES[f])
        for f in families
    }
    check_param_spread({f: param_count(d) for f, d in dirs.items()})
    return dirs


def rotated_rounds(
    names: Sequence[str], rounds: int, run_one: Callable[[str], Mapping[str, float]]
) -> dict[str, dict[str, list[float]]]:
    """`rounds` measured rounds after a warm-up round 0; round r runs every name once, starting at the
    r-th (mod len). `run_one(name)` returns seconds by kind (e.g. prefill, generate); the result holds them
    as lists, `{name: {kind: [s per measured round]}}`."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for r in range(rounds + 1):
        for k in range(len(names)):
            name = names[(k + r) % len(names)]
            seconds = run_one(name)
            if r:
                for kind, s in seconds.items():
                    times[name].setdefault(kind, []).append(s)
    return times


def per_token_rows(
    seconds: Mapping[str, float],
    tokens: Mapping[str, int],
    baseline: str = BASELINE,
    goal: float = GOAL_RATIO,
) -> list[dict[str, Any]]:
    """One row per family: seconds, tokens, microseconds per token, the ratio to the baseline's time per
    token and whether it is within `goal`. `seconds` and `tokens` are by family."""
    base = seconds[baseline] / tokens[baseline]
    rows = []
    for f, s in seconds.items():
        per = s / tokens[f]
        rows.append(
            {
                "family": f,
                "seconds": s,
                "tokens": tokens[f],
                "us_per_token": 1e6 * per,
                "ratio": per / base,
                "within_goal": per / base <= goal,
            }
        )
    return rows


def render_rows(title: str, rows: Sequence[Mapping[str, Any]], params: Mapping[str, int]) -> str:
    lines = [
        title,
        f"{'family':12s} {'params':>9s} {'min s':>8s} {'tokens':>7s} {'us/token':>9s} {'ratio':>6s}  goal",
    ]
    for r in rows:
        lines.append(
            f"{r['family']:12s} {params[r['family']]:9,d} {r['seconds']:8.3f} {r['tokens']:7d} "
            f"{r['us_per_token']:9.1f} {r['ratio']:5.2f}x  {'met' if r['within_goal'] else 'NOT met'}"
        )
    return "\n".join(lines)
