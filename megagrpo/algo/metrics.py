"""How the metrics of `policy_loss` and `train_inference_weights` combine across micro-batches and ranks.

Every metric those functions return is a detached 0-dim tensor (never a python float, so producing
metrics never forces a device sync; call `float()` when logging). Each name has one reduction:

- `sum`: additive. The `loss/*` terms are contributions `sum / normaliser`, so with the GLOBAL normaliser
  (see `aggregation`) their sum over micro-batches and ranks is the full-batch value. Counts (`*/tokens`,
  `*/seqs`) are sums too.
- `mean`: a mean over the count named in `REDUCTIONS` (e.g. `loss/clip_frac_high` over `loss/tokens`);
  merged as `sum(value * count) / sum(count)`, so the result equals the full-batch mean.
- `min` / `max`: parts whose count is 0 are ignored (their value is a placeholder 0).

`merge_metrics(parts)` merges micro-batches on one rank, `all_reduce_metrics(m)` merges across a
torch.distributed group with three collectives (SUM, MIN, MAX). Both give the full-batch numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

# name -> (reduction, count name for mean/min/max)
REDUCTIONS: dict[str, tuple[str, str | None]] = {
    "loss/total": ("sum", None),
    "loss/policy": ("sum", None),
    "loss/kl": ("sum", None),
    "loss/entropy": ("sum", None),
    "loss/tokens": ("sum", None),
    "loss/seqs": ("sum", None),
    "loss/clip_frac_low": ("mean", "loss/tokens"),
    "loss/clip_frac_high": ("mean", "loss/tokens"),
    "loss/clip_frac_dual": ("mean", "loss/tokens"),
    "loss/ratio_mean": ("mean", "loss/tokens"),
    "loss/approx_kl": ("mean", "loss/tokens"),
    "loss/zero_grad_frac": ("mean", "loss/tokens"),
    "loss/ratio_min": ("min", "loss/tokens"),
    "loss/ratio_max": ("max", "loss/tokens"),
    "mismatch/is_tokens": ("sum", None),
    "mismatch/is_seqs": ("sum", None),
    "mismatch/is_frac_token_above_cap": ("mean", "mismatch/is_tokens"),
    "mismatch/is_frac_token_below_floor": ("mean", "mismatch/is_tokens"),
    "mismatch/is_frac_zero_weight": ("mean", "mismatch/is_tokens"),
    "mismatch/is_weight_mean": ("mean", "mismatch/is_tokens"),
    "mismatch/is_frac_seq_above_cap": ("mean", "mismatch/is_seqs"),
    "mismatch/is_frac_seq_below_floor": ("mean", "mismatch/is_seqs"),
    "mismatch/is_frac_seq_veto": ("mean", "mismatch/is_seqs"),
    "mismatch/is_weight_min": ("min", "mismatch/is_tokens"),
    "mismatch/is_weight_max": ("max", "mismatch/is_tokens"),
}


def _reduction(name: str) -> tuple[str, str | None]:
    if name not in REDUCTIONS:
        raise ValueError(f"metric {name!r} has no registered reduction in megagrpo.algo.metrics.REDUCTIONS")
    return REDUCTIONS[name]


def _as_tensor(v: Tensor | float) -> Tensor:
    return (
        v.detach().to(torch.float64).reshape(())
        if isinstance(v, Tensor)
        else torch.tensor(float(v), dtype=torch.float64)
    )


def merge_metrics(parts: Sequence[Mapping[str, Tensor | float]]) -> dict[str, Tensor]:
    """Merges metric dicts of several micro-batches (same keys) into the full-batch metrics (float64, 0-dim)."""
    if not parts:
        raise ValueError("parts must hold at least one metrics dict")
    keys = list(parts[0])
    for i, p in enumerate(parts):
        if list(p) != keys:
            raise ValueError(f"parts[{i}] has keys {sorted(p)}, expected {sorted(keys)}")
    out: dict[str, Tensor] = {}
    for k in keys:
        op, count = _reduction(k)
        vals = torch.stack([_as_tensor(p[k]) for p in parts])
        if op == "sum":
            out[k] = vals.sum()
            continue
        if count not in parts[0]:
            raise ValueError(f"metric {k!r} needs its count {count!r} in the same dict")
        counts = torch.stack([_as_tensor(p[count]) for p in parts])
        if op == "mean":
            total = counts.sum()
            out[k] = (vals * counts).sum() / total if total > 0 else torch.zeros((), dtype=torch.float64)
        else:
            present = vals[counts > 0]
            if present.numel() == 0:
                out[k] = torch.zeros((), dtype=torch.float64)
            else:
                out[k] = present.min() if op == "min" else present.max()
    return out


def all_reduce_metrics(metrics: Mapping[str, Tensor | float], group=None) -> dict[str, Tensor]:
    """Merges `metrics` across the ranks of a torch.distributed `group` (every rank must call it with the same
    keys). Returns float64 0-dim tensors on the device of the first tensor metric, identical on all ranks."""
    import torch.distributed as dist

    keys = sorted(metrics)
    device = next((v.device for v in metrics.values() if isinstance(v, Tensor)), torch.device("cpu"))
    if dist.get_backend(group) == "nccl" and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())
    val = {k: _as_tensor(metrics[k]).to(device) for k in keys}
    sums, mins, maxs = [], [], []
    for k in keys:
        op, count = _reduction(k)
        if op == "sum":
            sums.append(val[k])
        elif op == "mean":
            if count not in val:
                raise ValueError(f"metric {k!r} needs its count {count!r} in the same dict")
            sums.append(val[k] * val[count])
        else:
            empty = val[count] <= 0
            ident = torch.full(
                (), float("inf") if op == "min" else float("-inf"), dtype=torch.float64, device=device
            )
            (mins if op == "min" else maxs).append(torch.where(empty, ident, val[k]))
    reduced: dict[str, list[Tensor]] = {}
    for name, vec, op in (
        ("sum", sums, dist.ReduceOp.SUM),
        ("min", mins, dist.ReduceOp.MIN),
        ("max", maxs, dist.ReduceOp.MAX),
    ):
        if vec:
            t = torch.stack(vec)
            dist.all_reduce(t, op=op, group=group)
            reduced[name] = list(t.unbind())
    summed: dict[str, Tensor] = {}
    i = 0
    for k in keys:
        if _reduction(k)[0] in ("sum", "mean"):
            summed[k] = reduced["sum"][i]
            i += 1
    out: dict[str, Tensor] = {}
    it_min, it_max = iter(reduced.get("min", [])), iter(reduced.get("max", []))
    for k in keys:
        op, count = _reduction(k)
        if op == "sum":
            out[k] = summed[k]
        elif op == "mean":
            total = summed[count]
            out[k] = torch.where(total > 0, summed[k] / total.clamp_min(1e-300), torch.zeros_like(total))
        else:
            v = next(it_min) if op == "min" else next(it_max)
            out[k] = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    return out
