"""End-of-run report: `report.png` (curves against the step) and `report.md` (a short summary)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megagrpo.trainer.metrics import read_jsonl

PANELS = (
    ("reward", ("reward/mean",)),
    ("held-out accuracy", ("eval/accuracy",)),
    ("response length", ("rollout/response_len_mean",)),
    ("entropy", ("loss/entropy",)),
    ("clip fractions", ("loss/clip_frac_low", "loss/clip_frac_high")),
    ("mismatch KL (k3)", ("mismatch/kl_sampler_learner_k3", "mismatch/kl_learner_sampler_k3")),
    ("MoE top-k agreement", ("moe/agreement_rollout_old", "moe/agreement_old_current")),
    (
        "RSPO router-shift gamma (old vs current)",
        ("moe/router_shift_gamma_mean", "moe/router_shift_gamma_p1"),
    ),
    (
        "multi-turn: turns and tool calls per trajectory",
        ("rollout/turns_mean", "rollout/tool_calls_per_traj"),
    ),
    (
        "multi-turn: tool outcomes per step",
        (
            "rollout/tool_errors",
            "rollout/tool_timeouts",
            "rollout/malformed_calls",
            "rollout/unknown_tools",
            "rollout/oversize_results",
        ),
    ),
    (
        "multi-turn: truncation and environment tokens",
        ("rollout/truncated_max_turns_frac", "rollout/truncated_max_tokens_frac", "rollout/env_token_frac"),
    ),
    (
        "TIS: token ratio quantiles and cap",
        ("mismatch/token_ratio_p001", "mismatch/token_ratio_p999", "mismatch/tis_cap"),
    ),
)
# Token ratios near 1 and a cap up to 10 (its value before the first measurement) share one panel: on a
# log axis both the departures from 1 and the distance to the cap stay readable.
LOG_Y = {"TIS: token ratio quantiles and cap"}


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if v is not None and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def lag_histogram(records: list[dict[str, Any]]) -> dict[int, float]:
    """Share of the run's trained completions by policy lag (async rollout's `rollout/lag_<d>_frac`,
    weighted by each step's `rollout/completions`); empty for a colocated run."""
    totals: dict[int, float] = {}
    for r in records:
        n = r.get("rollout/completions", 0.0)
        for key, v in r.items():
            if key.startswith("rollout/lag_") and key.endswith("_frac") and v is not None:
                d = int(key[len("rollout/lag_") : -len("_frac")])
                totals[d] = totals.get(d, 0.0) + v * n
    whole = sum(totals.values())
    return {d: totals[d] / whole for d in sorted(totals)} if whole > 0 else {}


def write_report(
    run_dir: str | Path, *, title: str = "megagrpo run", extra_md: str = ""
) -> tuple[Path, Path]:
    """Plot every panel that has data from `run_dir/metrics.jsonl`; return (png, md) paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    panels = [(name, keys) for name, keys in PANELS if any(_series(records, k)[0] for k in keys)]
    lags = lag_histogram(records)
    n = max(len(panels) + bool(lags), 1)
    cols = 2 if n > 1 else 1
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 2.8 * rows), squeeze=False)
    for ax, (name, keys) in zip(axes.flat, panels):
        for k in keys:
            xs, ys = _series(records, k)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=k)
        ax.set_title(name)
        ax.set_xlabel("step")
        if name in LOG_Y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
            ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if lags:
        ax = list(axes.flat)[len(panels)]
        ax.bar([str(d) for d in lags], list(lags.values()))
        ax.set_title("policy lag of trained completions (async rollout)")
        ax.set_xlabel("lag (learner steps)")
        ax.set_ylabel("share of completions")
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(panels) + bool(lags) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    png = run_dir / "report.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    lines = [
        f"# {title}",
        "",
        f"Steps logged: {len(records)}",
        "",
        "| metric | first | last |",
        "|---|---|---|",
    ]
    for _, keys in panels:
        for k in keys:
            _, ys = _series(records, k)
            if ys:
                lines.append(f"| `{k}` | {ys[0]:.4g} | {ys[-1]:.4g} |")
    if lags:
        lines += [
            "",
            "Policy lag of trained completions: " + ", ".join(f"{d}: {v:.1%}" for d, v in lags.items()),
        ]
    if extra_md:
        lines += ["", extra_md]
    lines += ["", "![curves](report.png)", ""]
    md = run_dir / "report.md"
    md.write_text("\n".join(lines))
    return png, md
