"""Parallelism-mismatch probe: how far apart are the sampler's and the learner's token log-probabilities?

    megagrpo probe MODEL_DIR --prompts 8 --layouts 1,tp2,ep2 [--inject none,fp8] [--out DIR]
    python tools/mismatch_probe.py MODEL_DIR ...   (the same)

1. Samples completions with SGLang (fp32 engine; on a CPU machine the CPU engine). `--inject bf16|fp8`
   round-trips ALL the sampler's weights through bfloat16 or `torch.float8_e4m3fn` (per-tensor scale)
   before sampling (synced into the running engine, then the original weights are put back). Several
   comma-separated injections reuse one engine start.
2. Shuts the engine down (an idle SGLang scheduler busy-polls a core), then scores the same tokens with
   the megatron learner under every layout (`1`, `tpN`, `epN`, `ppN`, `etpN` and combinations such as
   `tp2ep2`), each in its own `torchrun --standalone` run over all injections.
   For MoE models each layout runs twice: free routing, and R3 (the sampler's routes replayed).
3. Writes `DIR/mismatch_table.md`, `DIR/mismatch_table.json` (pairwise `mismatch_metrics` between the
   sampler and all layouts, per injection, plus routing/numeric attribution) and `DIR/dlogp.png`
   (distributions of log pi - log mu over the valid tokens).

Attribution (per layout, MoE): total = KL_k3(sampler || learner free), routing = KL_k3(learner R3 ||
learner free) (the learner with and without the sampler's routes), numeric = KL_k3(sampler || learner R3)
(what is left once both use the same experts: precision, kernels, layout), fed to
`megagrpo.diagnostics.attribution_shares`.

Saved batches (`DIR/rollouts/<inject>.pt`): the `megagrpo.trainer.batch.rollout_batch` dict (input_ids
[B, T], seq_lens [B], loss_mask [B, T], sampler_logp [B, T], routes [B, T, L, K] for MoE). Learner results
(`DIR/learner/<layout>/<inject>.pt`): {"free": [B, T], "r3": [B, T] or absent} fp32 token-aligned logprobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from megagrpo.errors import MegagrpoError

INJECTIONS = ("none", "bf16", "fp8")
# Which sampler weights an injection perturbs. "post_router": only weights downstream of every router (the
# last layer's experts, the final norm, the output head): numeric noise that cannot move a single route.
TARGETS = ("all", "router", "non_router", "post_router")
SAMPLER = "sampler"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_LAYOUT_PART = re.compile(r"(etp|tp|pp|ep)(\d+)")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """A learner mesh named like `1`, `tp2`, `ep2`, `tp2ep2`, `pp2`; nproc = lcm(tp*pp, ep*etp*pp)."""

    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def nproc(self) -> int:
        return math.lcm(self.tp * self.pp, self.ep * self.etp * self.pp)

    def mesh_kwargs(self) -> dict[str, Any]:
        # megatron needs sequence parallelism for MoE with TP > 1; harmless for dense models
        return dict(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, sequence_parallel=self.tp > 1)


def parse_layout(text: str) -> Layout:
    name = text.strip()
    if name == "1":
        return Layout("1")
    parts = _LAYOUT_PART.findall(name)
    if not name or "".join(k + v for k, v in parts) != name:
        raise MegagrpoError(
            f"--layouts: {text!r} is not a layout; use 1, tpN, ppN, epN, etpN or a combination like tp2ep2"
        )
    sizes: dict[str, int] = {}
    for key, val in parts:
        if key in sizes:
            raise MegagrpoError(f"--layouts: {text!r} names {key} twice")
        if int(val) < 1:
            raise MegagrpoError(f"--layouts: {text!r}: {key}{val} must be >= 1")
        sizes[key] = int(val)
    return Layout(name, **sizes)


def parse_layouts(text: str) -> list[Layout]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise MegagrpoError("--layouts is empty; pass e.g. --layouts 1,tp2,ep2")
    if len(set(names)) != len(names):
        raise MegagrpoError(f"--layouts {text!r} repeats a layout; name each once")
    return [parse_layout(n) for n in names]


def parse_injections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in INJECTIONS]
    if not names or bad:
        raise MegagrpoError(
            f"--inject {text!r}: use one or more of {', '.join(INJECTIONS)} (comma-separated)"
        )
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------- prompts


def load_prompts(spec: str | int, *, vocab_size: int, seed: int = 0) -> list[Any]:
    """`spec` = N: N synthetic token-id prompts (4..12 ids, seeded). Else a file: `.jsonl` lines of token
    id lists, strings, or {"prompt": str} / {"messages": [...]}; any other file, one text prompt a line.
    Text prompts become a single user message (the tokenizer's chat template applies)."""
    if isinstance(spec, int) or str(spec).isdigit():
        n = int(spec)
        if n < 1:
            raise MegagrpoError(f"--prompts {spec}: need at least one prompt")
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(4, 13, (n,), generator=g)
        hi = max(3, min(vocab_size, 1000))
        return [torch.randint(3, hi, (int(k),), generator=g).tolist() for k in lens]
    path = Path(spec)
    if not path.is_file():
        raise MegagrpoError(f"--prompts {spec!r}: not a number and not a file; pass N or a prompt file")
    prompts: list[Any] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append([{"role": "user", "content": line}])
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise MegagrpoError(f"{path}:{i}: not valid JSON ({e.msg}); one prompt per line") from None
        if isinstance(item, str):
            prompts.append([{"role": "user", "content": item}])
        elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append([{"role": "user", "content": item["prompt"]}])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            prompts.append(item["messages"])
        else:
            raise MegagrpoError(
                f"{path}:{i}: a prompt must be a string, a list of token ids, {{'prompt': str}} or "
                "{'messages': [...]}"
            )
    if not prompts:
        raise MegagrpoError(f"--prompts {spec!r}: the file holds no prompt")
    return prompts


# ---------------------------------------------------------------------------------------------- sampler


def round_trip(w: torch.Tensor, inject: str) -> torch.Tensor:
    """w through the injected format and back to its dtype: bf16 cast, or fp8 e4m3 with a per-tensor scale."""
    if inject == "none" or not w.is_floating_point():
        return w
    if inject == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    if inject == "fp8":
        scale = w.abs().max().float().clamp_min(1e-12) / _FP8_MAX
        return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)
    raise MegagrpoError(f"--inject {inject!r}: use one of {', '.join(INJECTIONS)}")


def is_router(name: str) -> bool:
    """HF router (gate) weights of the supported MoE families (qwen3_moe `mlp.gate`, mixtral
    `block_sparse_moe.gate`); an expert's `gate_proj` is not a router."""
    return name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))


def hf_weights(model_dir: str | Path) -> list[tuple[str, torch.Tensor]]:
    from megagrpo.bridge.hf_io import read_safetensors

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise MegagrpoError(f"{model_dir}: no *.safetensors files; pass a Hugging Face model directory")
    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        out.extend(read_safetensors(f).items())
    return out


def perturbed(weights: Sequence[tuple[str, torch.Tensor]], inject: str, target: str = "all"):
    if target not in TARGETS:
        raise MegagrpoError(f"injection target {target!r}: use one of {', '.join(TARGETS)}")
    last = max((int(m.group(1)) for n, _ in weights if (m := _LAYER.match(n))), default=-1)

    def post_router(n: str) -> bool:
        if n.startswith("lm_head.") or n == "model.norm.weight":
            return True
        return n.startswith((f"model.layers.{last}.mlp.", f"model.layers.{last}.block_sparse_moe.")) and not (
            is_router(n)
        )

    keep = {
        "all": lambda n: True,
        "router": is_router,
        "non_router": lambda n: not is_router(n),
        "post_router": post_router,
    }[target]
    chosen = [(n, round_trip(t, inject)) for n, t in weights if keep(n)]
    if not chosen:
        raise MegagrpoError(f"injection target {target!r} selects no weight of this model (dense model?)")
    return chosen


def sample(
    engine: Any,
    model_dir: str | Path,
    prompts: Sequence[Any],
    sampling: Any,
    *,
    group_size: int = 1,
    inject: str = "none",
    target: str = "all",
) -> dict[str, torch.Tensor]:
    """Generate with `engine` (a started RolloutEngine on `model_dir`), its weights round-tripped through
    `inject` (restored afterwards). Returns the `rollout_batch` dict ([B, T] tensors, B = prompts * G)."""
    from megagrpo.sync import bucketize, sync_weights
    from megagrpo.trainer.batch import rollout_batch

    original = hf_weights(model_dir) if inject != "none" else []
    if inject != "none":
        sync_weights(engine, bucketize(perturbed(original, inject, target)), partial=True)
    try:
        groups = engine.generate(list(prompts), sampling, group_size)
    finally:
        if inject != "none":
            sync_weights(engine, bucketize(original), partial=True)
    pad = getattr(engine.tokenizer, "pad_token_id", None)
    n = sum(len(g) for g in groups)
    return rollout_batch(groups, torch.zeros(n), pad_id=int(pad) if pad is not None else 0)


# ---------------------------------------------------------------------------------------------- learner


def learner_logprobs(
    model_dir: str | Path,
    batches: dict[str, Path],
    layout: Layout,
    outdir: Path,
    *,
    timeout: float = 900,
) -> dict[str, dict[str, torch.Tensor]]:
    """Score every saved batch under `layout` in ONE `torchrun --standalone` run; returns, per batch name,
    {"free": [B, T]} plus {"r3": [B, T]} when the batch holds the sampler's routes."""
    outdir.mkdir(parents=True, exist_ok=True)
    spec = dict(model_dir=str(model_dir), batches={k: str(v) for k, v in batches.items()}, out=str(outdir))
    spec["layout"] = asdict(layout)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.nproc}",
        "-m", "megagrpo.probe", "_learner", json.dumps(spec),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log = outdir / "torchrun.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise MegagrpoError(
                f"layout {layout.name}: the learner run timed out after {timeout:.0f} s; see {log}"
            ) from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise MegagrpoError(f"layout {layout.name}: the learner run failed (exit {proc.returncode}):\n{tail}")
    return {name: torch.load(outdir / f"{name}.pt") for name in batches}


def _learner_main(spec: dict[str, Any]) -> None:
    """torchrun entry: every rank builds the learner on the layout, loads the HF weights, scores each batch."""
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=True, sglang=False)
    torch.set_num_threads(1)
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.learner.mesh import MeshConfig
    from megagrpo.moe.replay import StepReplay
    from megagrpo.trainer.weights import load_hf_into_learner

    layout = Layout(**spec["layout"])
    arch = arch_from_hf(spec["model_dir"])
    batches = {k: torch.load(v) for k, v in spec["batches"].items()}
    moe = any("routes" in b for b in batches.values())
    learner = Learner(arch, LearnerConfig(mesh=MeshConfig(**layout.mesh_kwargs()), routing_replay=moe))
    load_hf_into_learner(learner, spec["model_dir"])
    rank = torch.distributed.get_rank()
    for name, batch in batches.items():
        lb = {k: batch[k] for k in ("input_ids", "seq_lens")}
        res = {"free": learner.forward(lb, with_entropy=False)["logprobs"].float().cpu()}
        if "routes" in batch:
            rep = StepReplay.for_step("R3", learner, batch)
            res["r3"] = (
                learner.forward(lb, with_entropy=False, hooks=rep.old_pass_hooks())["logprobs"].float().cpu()
            )
            m = {**rep.old_pass_metrics(), **rep.step_metrics()}
            res["moe/agreement_rollout_old"] = float(m.get("moe/agreement_rollout_old", float("nan")))
        if rank == 0:
            torch.save(res, Path(spec["out"]) / f"{name}.pt")
    learner.close(process_group=True)


# ---------------------------------------------------------------------------------------------- metrics

TABLE_KEYS = (
    ("kl_sampler_learner_k3", "KL(a‖b) k3"),
    ("kl_learner_sampler_k3", "KL(b‖a) k3"),
    ("abs_dlogp_mean", "|Δlogp| mean"),
    ("abs_dlogp_max", "|Δlogp| max"),
    ("token_ratio_p999", "ratio p99.9"),
    ("ess_ratio", "ESS"),
)


def pair_metrics(a_logp: torch.Tensor, b_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`mismatch_metrics` with `a` in the sampler's role and `b` in the learner's ([B, T] each), plus
    |Δlogp| max; keys without the `mismatch/` prefix."""
    from megagrpo.diagnostics import mismatch_metrics

    m = {k.removeprefix("mismatch/"): v for k, v in mismatch_metrics(a_logp, b_logp, mask).metrics.items()}
    m["abs_dlogp_max"] = float((b_logp.double() - a_logp.double())[mask].abs().max()) if mask.any() else 0.0
    return m


def probe_results(
    batch: dict[str, torch.Tensor], learner: dict[str, dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """One injection: pairwise metrics between the sampler and every layout (upper triangle, sampler first),
    and attribution per layout for MoE. `learner`: layout name -> {"free": [B, T], "r3": [B, T]?}."""
    from megagrpo.diagnostics import attribution_shares

    mask = batch["loss_mask"].bool()
    passes = {SAMPLER: batch["sampler_logp"], **{name: r["free"] for name, r in learner.items()}}
    names = list(passes)
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pairs.append({"a": a, "b": b, **pair_metrics(passes[a], passes[b], mask)})
    attribution = {}
    for name, r in learner.items():
        if "r3" not in r:
            continue
        total = pair_metrics(passes[SAMPLER], r["free"], mask)["kl_sampler_learner_k3"]
        routing = pair_metrics(r["r3"], r["free"], mask)["kl_sampler_learner_k3"]
        numeric = pair_metrics(passes[SAMPLER], r["r3"], mask)["kl_sampler_learner_k3"]
        attribution[name] = {
            **{
                k.removeprefix("mismatch/"): v for k, v in attribution_shares(total, routing, numeric).items()
            },
            "routing_kl": routing,
            "numeric_kl": numeric,
            "agreement_rollout_old": r.get("moe/agreement_rollout_old"),
        }
    return {"n_tokens": int(mask.sum()), "pairs": pairs, "attribution": attribution}


_NEAR_ONE = ("token_ratio_p999", "ess_ratio")  # ratios near 1: fixed decimals show small departures


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3e}" if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4) else f"{v:.4f}"
    return str(v)


def markdown(results: dict[str, Any]) -> str:
    lines = []
    for inject, res in results["injections"].items():
        lines += [f"### inject = {inject} ({res['n_tokens']} tokens)", ""]
        lines.append("| a | b | " + " | ".join(h for _, h in TABLE_KEYS) + " |")
        lines.append("|" + "---|" * (2 + len(TABLE_KEYS)))
        for p in res["pairs"]:
            cells = [f"{p[k]:.6f}" if k in _NEAR_ONE else _fmt(p[k]) for k, _ in TABLE_KEYS]
            lines.append(f"| {p['a']} | {p['b']} | " + " | ".join(cells) + " |")
        if res["attribution"]:
            lines += [
                "",
                "| layout | routing_share | numeric_share | residual_share | top-k agreement |",
                "|---|---|---|---|---|",
            ]
            for name, a in res["attribution"].items():
                lines.append(
                    f"| {name} | {_fmt(a.get('routing_share'))} | {_fmt(a.get('numeric_share'))} | "
                    f"{_fmt(a['residual_share'])} | {_fmt(a['agreement_rollout_old'])} |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(
    batches: dict[str, dict[str, torch.Tensor]], learner: dict[str, dict[str, dict]], path: Path
) -> None:
    """Histogram of Δlogp = log pi - log mu over valid tokens, one panel per injection, one line a layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lin = 1e-7  # fp32 rounding of a log-probability; below it Δlogp is noise
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.6), squeeze=False)
    for ax, (inject, batch) in zip(axes[0], batches.items()):
        mask = batch["loss_mask"].bool()
        deltas = {
            layout: (per[inject]["free"].double() - batch["sampler_logp"].double())[mask].numpy()
            for layout, per in learner.items()
        }
        top = max([float(abs(d).max()) for d in deltas.values() if d.size] + [lin])
        # log-spaced bins on both sides and one bin for |Δ| < lin: fp32 noise (~1e-7) and fp8 errors
        # (~1e-2) show on one symlog axis
        pos = np.logspace(np.log10(lin), np.log10(top * 1.01), 25) if top > lin else np.array([lin])
        bins = np.concatenate([-pos[::-1], pos])
        for layout, d in deltas.items():
            ax.hist(d, bins=bins, histtype="step", label=layout)
        ax.set_xscale("symlog", linthresh=lin)
        ax.set_yscale("log")
        ax.set_title(f"Δlogp learner − sampler, inject={inject}")
        ax.set_xlabel("log π − log μ")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- driver


def _check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise MegagrpoError(f"--out {out}: the directory is not empty; pass a new or empty directory")


def sample_batches(
    engine: Any,
    model_dir: str | Path,
    prompts: Sequence[Any],
    out: str | Path,
    *,
    injections: Sequence[str] = ("none",),
    sampling: Any = None,
    group_size: int = 1,
    stall_report_s: float = 900.0,
) -> dict[str, dict[str, torch.Tensor]]:
    """Phase 1: one `rollout_batch` per injection with a started engine, each saved to
    `out/rollouts/<inject>.pt`. If the sampling has not finished after `stall_report_s` seconds, every
    thread's stack is written to stderr (the run goes on), so a stalled engine call says where it waits."""
    import faulthandler

    from megagrpo.rollout.config import SamplingConfig

    out = Path(out)
    sampling = sampling or SamplingConfig(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    (out / "rollouts").mkdir(parents=True, exist_ok=True)
    batches: dict[str, dict[str, torch.Tensor]] = {}
    faulthandler.dump_traceback_later(stall_report_s, repeat=True, file=sys.stderr)
    try:
        for inject in injections:
            batches[inject] = sample(
                engine, model_dir, prompts, sampling, group_size=group_size, inject=inject
            )
            torch.save(batches[inject], out / "rollouts" / f"{inject}.pt")
    finally:
        faulthandler.cancel_dump_traceback_later()
    return batches


def score_and_write(
    model_dir: str | Path,
    batches: dict[str, dict[str, torch.Tensor]],
    layouts: Sequence[Layout],
    out: str | Path,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Phase 2 (no engine needed; run it after the engine is shut down, since an idle SGLang scheduler
    busy-polls a core): score the saved batches under every layout, write the table (md + json) and
    the plot under `out`. Returns the JSON dict."""
    from rich.progress import Progress

    out = Path(out)
    if not layouts:
        raise MegagrpoError("--layouts is empty; pass e.g. --layouts 1,tp2,ep2")
    paths = {inject: out / "rollouts" / f"{inject}.pt" for inject in batches}
    learner: dict[str, dict[str, dict]] = {}
    with Progress(disable=not progress, transient=False) as bar:
        task = bar.add_task("learner", total=len(layouts))
        for layout in layouts:
            bar.update(task, description=f"learner layout {layout.name} ({layout.nproc} procs)")
            learner[layout.name] = learner_logprobs(model_dir, paths, layout, out / "learner" / layout.name)
            bar.advance(task)
    results = {
        "model_dir": str(model_dir),
        "layouts": [asdict(lo) for lo in layouts],
        "injections": {
            inj: probe_results(batches[inj], {lo: learner[lo][inj] for lo in learner}) for inj in batches
        },
    }
    (out / "mismatch_table.json").write_text(json.dumps(results, indent=1))
    (out / "mismatch_table.md").write_text(markdown(results))
    plot(batches, learner, out / "dlogp.png")
    return results


def run_probe(
    engine: Any,
    model_dir: str | Path,
    prompts: Sequence[Any],
    layouts: Sequence[Layout],
    out: str | Path,
    *,
    injections: Sequence[str] = ("none",),
    sampling: Any = None,
    group_size: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Both phases with a started engine that stays up (library use); the CLI shuts its engine down
    between them. Returns the JSON dict."""
    out = Path(out)
    _check_out(out)
    if not layouts:
        raise MegagrpoError("--layouts is empty; pass e.g. --layouts 1,tp2,ep2")
    batches = sample_batches(
        engine, model_dir, prompts, out, injections=injections, sampling=sampling, group_size=group_size
    )
    return score_and_write(model_dir, batches, layouts, out, progress=progress)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_learner"]:
        _learner_main(json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="Hugging Face model directory")
    p.add_argument("--prompts", default="8", help="N synthetic prompts, or a prompt file (.jsonl or text)")
    p.add_argument("--layouts", default="1", help="comma-separated learner layouts, e.g. 1,tp2,ep2,tp2ep2")
    p.add_argument("--inject", default="none", help="sampler weight round trip: none, bf16, fp8 (comma list)")
    p.add_argument("--out", default="mismatch_probe", help="output directory (new or empty)")
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        model_dir = Path(a.model_dir)
        if not (model_dir / "config.json").is_file():
            raise MegagrpoError(f"{model_dir}: no config.json; pass a Hugging Face model directory")
        layouts = parse_layouts(a.layouts)
        injections = parse_injections(a.inject)
        out = Path(a.out)
        _check_out(out)
        vocab = int(json.loads((model_dir / "config.json").read_text()).get("vocab_size", 1000))
        prompts = load_prompts(a.prompts, vocab_size=vocab, seed=a.seed)
        from megagrpo.compat import apply_cpu_compat

        apply_cpu_compat(megatron=False, sglang=True)
        from megagrpo.rollout import RolloutConfig, RolloutEngine
        from megagrpo.rollout.config import SamplingConfig

        sampling = SamplingConfig(
            max_new_tokens=a.max_new_tokens, temperature=a.temperature, ignore_eos=True, seed=a.seed
        )
        cfg = RolloutConfig(str(model_dir), dtype="float32", max_total_tokens=4096, seed=a.seed)
        with RolloutEngine(cfg) as engine:
            batches = sample_batches(
                engine, model_dir, prompts, out, injections=injections, sampling=sampling,
                group_size=a.group_size,
            )  # fmt: skip
        results = score_and_write(model_dir, batches, layouts, out, progress=not a.no_progress)
    except MegagrpoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(results))
    print(f"wrote {a.out}/mismatch_table.md, mismatch_table.json, dlogp.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
