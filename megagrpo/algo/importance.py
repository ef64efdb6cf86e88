"""Train/inference mismatch correction: importance weights pi_learner / pi_sampler for `policy_loss`.

The sampler (SGLang) and the learner (Megatron) compute different probabilities for the same tokens
(kernels, precision, MoE routing). The rollout is therefore slightly off-policy, and these weights
correct or filter it. Everything is computed in log space (a sequence product of ratios never
overflows) and returned detached.

Shapes: `learner_logp`, `sampler_logp`, `loss_mask` are `[B, T]`; weights are `[B, T]` (0 at padding);
sequence cause masks are `[B]`.

Levels: `token` (r_t), `sequence` (prod_t r_t, i.e. exp of the summed log-ratio), `geometric`
(exp of the mean log-ratio). Modes:
- `truncate` (TIS): min(w, cap_high); with `cap_low` also max(w, cap_low).
- `mask` (MIS): w where cap_low <= w <= cap_high, else 0 (no lower bound without `cap_low`). At the
  sequence and geometric levels this removes whole sequences: a "sequence veto".
- `icepop`: the two-sided token mask of IcePop; needs `cap_low` and `level="token"`.
`veto_low` (any mode or level) removes every sequence that holds a token whose ratio is below it.
Two corrections at once (`combine_corrections`): the truncating one gives the weight, the other its mask.

Causes (`ImportanceMasks`, and the `mismatch/is_*` metrics, see `megagrpo.algo.metrics.REDUCTIONS`):
token above cap / below floor (token level; truncated or masked per `mode`), sequence above cap / below
floor (sequence and geometric levels), sequence veto (sequences whose weight is 0 on every token:
sequence-level masking or `veto_low`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megagrpo.algo import _checks

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "icepop")


@dataclass(frozen=True)
class ImportanceMasks:
    """Per-cause masks of one `importance_masks` call. All bool masks are false at padding."""

    log_ratio: Tensor  # [B, T] token log(pi_learner / pi_sampler); 0 at padding
    log_weight: Tensor  # [B, T] log of the raw weight at the chosen level, on every token of its sequence
    weights: Tensor  # [B, T] final corrected weights (detached, 0 at padding)
    token_above_cap: Tensor  # [B, T] bool: level token and r_t > cap_high
    token_below_floor: Tensor  # [B, T] bool: level token and r_t < cap_low
    seq_above_cap: Tensor  # [B] bool: level sequence/geometric and w_i > cap_high
    seq_below_floor: Tensor  # [B] bool: level sequence/geometric and w_i < cap_low
    seq_veto: Tensor  # [B] bool: the whole sequence gets weight 0 (sequence-level mask or veto_low)
    zero_weight: Tensor  # [B, T] bool: loss tokens whose final weight is 0, whatever the cause


def _check_args(
    level: str, mode: str, cap_high: float, cap_low: float | None, veto_low: float | None
) -> None:
    _checks.choice("level", level, LEVELS)
    _checks.choice("mode", mode, MODES)
    _checks.positive("cap_high", cap_high)
    _checks.positive("cap_low", cap_low, allow_none=True)
    _checks.positive("veto_low", veto_low, allow_none=True)
    if cap_low is not None and not cap_low < cap_high:
        raise ValueError(f"cap_low={cap_low} must be < cap_high={cap_high}")
    if mode == "icepop":
        if level != "token":
            raise ValueError(f"mode='icepop' is a token mask; use level='token', not {level!r}")
        if cap_low is None:
            raise ValueError("mode='icepop' is two-sided and needs cap_low (e.g. 0.5 with cap_high=2.0)")


def importance_masks(
    learner_logp: Tensor,
    sampler_logp: Tensor,
    loss_mask: Tensor,
    *,
    level: str,
    mode: str,
    cap_high: float,
    cap_low: float | None = None,
    veto_low: float | None = None,
) -> ImportanceMasks:
    """Weights and per-cause masks: TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training", truncated-IS objective), MIS and veto ("When speed kills stability", token/sequence
    masked IS), IcePop (Ring-1T 2510.18855, IcePop objective with the two-sided mask M(k; alpha, beta))."""
    _check_args(level, mode, cap_high, cap_low, veto_low)
    learner_logp = _checks.floating("learner_logp", learner_logp)
    _checks.ndim("learner_logp", learner_logp, 2, "[B, T]")
    bt = tuple(learner_logp.shape)
    sampler_logp = _checks.shape(
        "sampler_logp", _checks.floating("sampler_logp", sampler_logp), bt, "[B, T] like learner_logp"
    )
    m = _checks.mask("loss_mask", loss_mask, learner_logp)
    dt = torch.promote_types(learner_logp.dtype, torch.float32)
    lp = torch.where(m, learner_logp.detach().to(dt), 0.0)
    sp = torch.where(m, sampler_logp.detach().to(dt), 0.0)
    _checks.finite_where("learner_logp", lp, None)
    _checks.finite_where("sampler_logp", sp, None)
    log_ratio = lp - sp

    hi = math.log(cap_high)
    lo = math.log(cap_low) if cap_low is not None else None
    n = m.sum(dim=-1)
    no_seq = torch.zeros(bt[0], dtype=torch.bool, device=m.device)
    if level == "token":
        log_w = log_ratio
        above, below = log_ratio > hi, (log_ratio < lo) if lo is not None else torch.zeros_like(m)
        above, below = above & m, below & m
        seq_above = seq_below = no_seq
        seq_masked = no_seq
    else:
        seq_log = log_ratio.sum(dim=-1)
        if level == "geometric":
            seq_log = seq_log / n.clamp_min(1).to(dt)
        log_w = seq_log.unsqueeze(-1).expand(bt)
        present = n > 0
        seq_above = (seq_log > hi) & present
        seq_below = ((seq_log < lo) & present) if lo is not None else no_seq
        above = below = torch.zeros_like(m)
        seq_masked = (seq_above | seq_below) if mode != "truncate" else no_seq

    # exp(log(cap)) may round to just above cap; the final clamp makes "never above the cap" exact.
    if mode == "truncate":
        w = torch.exp(log_w.clamp(max=hi)).clamp(max=cap_high)
        if cap_low is not None:
            w = w.clamp(min=cap_low)
    else:
        keep = ~(above | below) if level == "token" else ~seq_masked.unsqueeze(-1)
        w = torch.where(keep, torch.exp(log_w.clamp(max=hi)).clamp(max=cap_high), 0.0)

    veto = seq_masked
    if veto_low is not None:
        veto = veto | ((log_ratio < math.log(veto_low)) & m).any(dim=-1)
        w = torch.where(veto.unsqueeze(-1), 0.0, w)
    w = torch.where(m, w, 0.0)
    return ImportanceMasks(
        log_ratio=log_ratio,
        log_weight=torch.where(m, log_w, 0.0),
        weights=w,
        token_above_cap=above,
        token_below_floor=below,
        seq_above_cap=seq_above,
        seq_below_floor=seq_below,
        seq_veto=veto & (n > 0),
        zero_weight=(w == 0) & m,
    )


def importance_metrics(masks: ImportanceMasks, loss_mask: Tensor, reducer=None) -> dict[str, Tensor]:
    """`mismatch/is_*` metrics (detached 0-dim float64 tensors) of `importance_masks`' result.

    `reducer` (a `diagnostics.reduce` reducer, or None for one process): combines the partial sums and
    extremes of ranks that hold different rows, so the metrics are those of the whole batch."""
    m = loss_mask.bool()
    f64 = torch.float64
    w = masks.weights.to(f64)
    sums = torch.stack(
        [
            m.sum().to(f64),
            m.any(dim=-1).sum().to(f64),
            masks.token_above_cap.sum().to(f64),
            masks.token_below_floor.sum().to(f64),
            masks.seq_above_cap.sum().to(f64),
            masks.seq_below_floor.sum().to(f64),
            masks.seq_veto.sum().to(f64),
            masks.zero_weight.sum().to(f64),
            torch.where(m, w, 0.0).sum(),
        ]
    )
    # -min as a max, so one all-reduce takes both extremes
    ext = torch.stack([torch.where(m, -w, float("-inf")).max(), torch.where(m, w, float("-inf")).max()])
    if reducer is not None:
        sums, ext = reducer.sum(sums), reducer.max(ext)
    tokens, seqs = sums[0], sums[1]
    t_den, s_den = tokens.clamp_min(1), seqs.clamp_min(1)
    has = tokens > 0
    zero = torch.zeros((), dtype=f64, device=w.device)
    return {
        "mismatch/is_tokens": tokens,
        "mismatch/is_seqs": seqs,
        "mismatch/is_frac_token_above_cap": sums[2] / t_den,
        "mismatch/is_frac_token_below_floor": sums[3] / t_den,
        "mismatch/is_frac_seq_above_cap": sums[4] / s_den,
        "mismatch/is_frac_seq_below_floor": sums[5] / s_den,
        "mismatch/is_frac_seq_veto": sums[6] / s_den,
        "mismatch/is_frac_zero_weight": sums[7] / t_den,
        "mismatch/is_weight_mean": sums[8] / t_den,
        "mismatch/is_weight_min": torch.where(has, -ext[0], zero),
        "mismatch/is_weight_max": torch.where(has, ext[1], zero),
    }


def combine_corrections(sections: list[tuple[str, ImportanceMasks]]) -> Tensor:
    """One weight `[B, T]` from several corrections `[(mode, masks), ...]` of the same tokens (the
    trainer's `algo.tis` then `algo.mis`); TIS with rejection sampling, as in Yao et al. 2025 ("Your
    efficient RL framework secretly brings you off-policy RL training", truncated IS) with the masks of
    "When speed kills stability" (masked IS): w = min(r, C) * 1[kept].

    The ratio enters once: a masking section's weight (mode mask or icepop) is the ratio itself where it
    keeps a token, so the product of two sections' weights would give a kept token min(r, C) * r, above
    the cap. The weight is the first truncating section's (the first section's when none truncates), and
    every other section contributes its mask only. Two truncating sections are refused: the result would
    be one of two caps, or a doubled ratio."""
    if not sections:
        raise ValueError("combine_corrections needs at least one section")
    for mode, _ in sections:
        _checks.choice("mode", mode, MODES)
    truncating = [m for mode, m in sections if mode == "truncate"]
    if len(truncating) > 1:
        raise ValueError("two truncating corrections: keep one truncate and make the others mask or icepop")
    lead = truncating[0] if truncating else sections[0][1]
    w = lead.weights
    for _, m in sections:
        if m is not lead:
            w = torch.where(m.zero_weight, 0.0, w)
    return w


def train_inference_weights(
    learner_logp: Tensor,
    sampler_logp: Tensor,
    loss_mask: Tensor,
    *,
    level: str,
    mode: str,
    cap_high: float,
    cap_low: float | None = None,
    veto_low: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TIS / MIS / IcePop weights `[B, T]` (detached) and `mismatch/is_*` metrics; see `importance_masks`."""
    masks = importance_masks(
        learner_logp,
        sampler_logp,
        loss_mask,
        level=level,
        mode=mode,
        cap_high=cap_high,
        cap_low=cap_low,
        veto_low=veto_low,
    )
    return masks.weights, importance_metrics(masks, loss_mask)
