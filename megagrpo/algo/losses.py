"""GRPO-family policy losses: `policy_loss(...) -> (loss, metrics)`.

Shapes: `logp`, `old_logp`, `loss_mask`, `importance_weights`, `token_weights`, `ref_logp`, `entropy` are
`[B, T]` (one row per sequence, right-padded; `loss_mask` true on response tokens). `advantages` is `[B]`
(one per sequence, broadcast over its tokens explicitly) or `[B, T]` (per token). Positions where
`loss_mask` is false may hold anything, including NaN or -inf: they never reach the loss or the gradient.

Each variant defines a per-token objective `J[i, t]` to maximise; the loss is
`-agg(J * importance_weights * token_weights) + kl_coef * agg(kl) - entropy_coef * agg(entropy)` with
`agg` and `normaliser` as in `megagrpo.algo.aggregation` (the distributed contract lives there). The
sequence-level variants (gspo, gmpo) put their sequence objective on every token of the sequence, so
`agg="seq-mean-token-mean"` reproduces their papers' 1/G sum over sequences exactly.

Parameters (all keyword-only after `loss_mask`):
- `variant`: one of `VARIANTS`. `clip_low`/`clip_high`: ratio bounds 1 - clip_low, 1 + clip_high (grpo,
  gspo, gspo_token, cispo); for gmpo they are bounds on the token LOG-ratio (-clip_low, clip_high), as in
  the GMPO paper (e.g. 0.4). sapo and reinforce ignore them. cispo uses only clip_high unless clip_low is
  given. `clip_ratio_c` (> 1): dual-clip lower bound for negative advantages (grpo, gspo, gspo_token).
- `importance_weights`: train/inference correction (`importance.train_inference_weights`); detached.
- `token_weights`: extra per-token weights (the MoE router-shift gamma of RSPO); detached.
- `ref_logp`, `kl_coef`, `kl_estimator`: KL(pi_theta || pi_ref) in the loss (`kl.ESTIMATORS`).
- `entropy`, `entropy_coef`: entropy bonus (entropy may carry gradients from the logits).
- `normaliser`: the global denominator from `aggregation.loss_normaliser` (None: local batch).
- `sapo_tau_pos`, `sapo_tau_neg`: SAPO gate temperatures for positive / negative advantages.

gmpo needs per-sequence advantages `[B]`. Log-ratios are capped at `MAX_LOG_RATIO` (20) before any exp.
The clip is one log-space clamp with a custom backward (once differentiable: no double backward). With
`variant="reinforce"` and advantages 1 the loss is the SFT NLL (`aggregation.nll_loss`).

Metrics: a dict of detached 0-dim float64 tensors (call `float()` to log). Reductions across micro-batches
and ranks are registered in `megagrpo.algo.metrics.REDUCTIONS`. One call costs one host sync (the check
that the inputs under the mask are finite rides on the metric reductions).
- `loss/total`, `loss/policy`, `loss/kl` (if `ref_logp`), `loss/entropy` (if `entropy`): the aggregated
  terms (kl and entropy without their coefficients); additive across micro-batches under a global
  normaliser.
- `loss/tokens`, `loss/seqs`: loss-token and non-empty-sequence counts of this call (0 tokens: the loss is
  exactly 0 and every mean metric is 0).
- token means over `loss/tokens`: `loss/clip_frac_low` (A < 0 and ratio < 1 - clip_low: the lower clip
  removed the gradient), `loss/clip_frac_high` (A > 0 and ratio > 1 + clip_high; for cispo: ratio above
  the cap, gradient kept), `loss/clip_frac_dual` (A < 0 and ratio > clip_ratio_c), `loss/ratio_mean`,
  `loss/approx_kl` (k3 estimate of KL(pi_old || pi_theta) from the token ratios), `loss/zero_grad_frac`
  (tokens whose gradient is exactly zero: clipped, A == 0, or a zero weight; for gspo/gmpo a token's
  gradient is shared with its sequence, so one zero-weight token alone does not zero it). For cispo the
  clip fractions count tokens whose IS weight was capped (high) or floored (low, only with clip_low).
- `loss/ratio_min`, `loss/ratio_max`. The "ratio" is the one the variant uses: the token ratio for
  grpo/cispo/sapo/reinforce, the sequence ratio s_i for gspo/gspo_token, the unclipped geometric-mean
  ratio for gmpo.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from megagrpo.algo import _checks
from megagrpo.algo.aggregation import _aggregate, _check_agg
from megagrpo.algo.kl import ESTIMATORS, kl_from_log_ratio

VARIANTS = ("grpo", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "reinforce")
_RATIO_CLIPPED = ("grpo", "gspo", "gspo_token")
_SEQUENCE_RATIO = ("gspo", "gspo_token", "gmpo")
# Log-ratios are capped before exp: e^20 is far outside any clip range, and an overflow to inf would turn
# into NaN gradients (0 * inf) even where the clip removes the gradient.
MAX_LOG_RATIO = 20.0
_INF = float("inf")


class Objective(NamedTuple):
    """What a variant hands back. `values` [B, T], or [B, 1] with `per_seq` (one value per sequence); it
    excludes the advantage when the advantages are per sequence (applied to the row sums instead)."""

    values: Tensor
    per_seq: bool
    clipped: Tensor | None  # bool [B, T] or [B, 1]: where the clamp bound was hit (None: no clamp)
    raw_log: Tensor | None  # the log-ratio that was clamped (same shape as `clipped`), detached


class _MaskedClamp(torch.autograd.Function):
    """clamp(x, lo, hi) -> (clamped, clipped mask). Backward is one masked_fill: autograd's own clamp backward
    with tensor bounds costs about ten full passes. The mask (x outside [lo, hi]) feeds the clip metrics.
    Gradient convention as torch.clamp: a value exactly on a bound keeps its gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, lo: Tensor, hi: Tensor):
        xc = torch.clamp(x, min=lo, max=hi)
        clipped = xc != x
        ctx.save_for_backward(clipped)
        ctx.mark_non_differentiable(clipped)
        return xc, clipped

    @staticmethod
    def backward(ctx, grad: Tensor, _unused: Tensor):
        (clipped,) = ctx.saved_tensors
        return grad.masked_fill(clipped, 0.0), None, None


def _sign_bounds(adv: Tensor, pos_hi: float, neg_lo: float, neg_hi: float) -> tuple[Tensor, Tensor]:
    """Per-row (or per-token) log-space clamp bounds: (-inf, pos_hi] where A > 0, [neg_lo, neg_hi] else."""
    pos = adv > 0
    lo = torch.where(pos, adv.new_tensor(-_INF), adv.new_tensor(neg_lo))
    hi = torch.where(pos, adv.new_tensor(pos_hi), adv.new_tensor(neg_hi))
    return lo, hi


def grpo_objective(log_ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual: float | None):
    """Clipped token surrogate of GRPO (DeepSeekMath 2402.03300 Eq. 3) / DAPO clip-higher (2503.14476 Eq. 8);
    dual clip (Ye et al. 1912.09729 Eq. 5).

    min(rA, clip(r, 1-el, 1+eh)A) = A * min(r, 1+eh) for A > 0 and A * max(r, 1-el) for A < 0, and the dual
    clip max(., cA) caps r at c for A < 0; so it is A * exp(clamp(log r, lo_A, hi_A)), one clamp in log
    space that cannot overflow and whose gradient is zero exactly where the clip removes it.
    """
    neg_hi = math.log(dual) if dual is not None else MAX_LOG_RATIO
    lo, hi = _sign_bounds(adv, math.log1p(clip_high), math.log1p(-clip_low), neg_hi)
    x, clipped = _MaskedClamp.apply(log_ratio, lo, hi)
    return Objective(torch.exp(x), False, clipped, log_ratio.detach())


def gspo_objective(log_ratio: Tensor, n: Tensor, adv: Tensor, clip_low, clip_high, dual, *, token: bool):
    """GSPO: s_i = exp(mean_t log r_{i,t}) clipped per sequence (GSPO 2507.18071 Eqs. 5-7); `token=True` is
    GSPO-token (same paper, Eqs. 13-14): s_{i,t} = sg[s_i] pi(y_t) / sg[pi(y_t)], value s_i, per-token grad."""
    seq_log = log_ratio.sum(dim=-1, keepdim=True) / n.clamp_min(1).unsqueeze(-1)
    neg_hi = math.log(dual) if dual is not None else MAX_LOG_RATIO
    lo, hi = _sign_bounds(adv, math.log1p(clip_high), math.log1p(-clip_low), neg_hi)
    x, clipped = _MaskedClamp.apply(seq_log, lo, hi)  # [B, 1], or [B, T] for per-token advantages
    if not token:
        return Objective(torch.exp(x), x.shape[-1] == 1, clipped, seq_log.detach())
    # value s_i (clipped), gradient s_i * d log pi(y_t) where unclipped: the sg[.] construction, no 2nd exp
    delta = torch.where(clipped, 0.0, log_ratio - log_ratio.detach())
    return Objective(torch.exp(x.detach()) * (1 + delta), False, clipped, seq_log.detach())


def gmpo_objective(log_ratio: Tensor, n: Tensor, adv: Tensor, clip_low: float, clip_high: float):
    """GMPO: A * exp(mean_t clip(log r_t)) with sign(A)-aware token clipping in log space (GMPO 2507.20673 Eq. 4).

    For A > 0 each token log-ratio is capped at clip_high, for A < 0 floored at -clip_low (the paper's
    min over |.| with sgn(A)). Padding has log r = 0, which the clamp keeps, so it adds nothing.
    """
    lo, hi = _sign_bounds(adv, clip_high, -clip_low, MAX_LOG_RATIO)
    x, clipped = _MaskedClamp.apply(log_ratio, lo, hi)
    seq = torch.exp((x.sum(dim=-1, keepdim=True) / n.clamp_min(1).unsqueeze(-1)).clamp(max=MAX_LOG_RATIO))
    return Objective(seq, True, clipped, log_ratio.detach())


def cispo_objective(logp: Tensor, log_ratio: Tensor, clip_low: float | None, clip_high: float):
    """CISPO: sg(clip(r, 1 - el, 1 + eh)) * A * log pi (MiniMax-M1 2506.13585 Eqs. 4-5); no token loses its
    gradient. Without clip_low only the upper cap applies, as in the paper's runs."""
    lo = math.log1p(-clip_low) if clip_low is not None else None
    x = log_ratio.detach().clamp(min=lo, max=math.log1p(clip_high))
    return Objective(torch.exp(x) * logp, False, None, None)


def sapo_objective(log_ratio: Tensor, adv: Tensor, tau_pos: float, tau_neg: float):
    """SAPO soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau with tau by sign(A) (SAPO 2511.20347 Eqs. 5-6).

    Its derivative in log r is r * 4 sigma (1 - sigma) = 1 at r = 1: on-policy it is plain REINFORCE.
    """
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
    return Objective(torch.sigmoid(tau * (ratio - 1)) * (4 / tau), False, None, None)


def reinforce_objective(logp: Tensor):
    """REINFORCE A * log pi (Williams 1992; the on-policy limit of GRPO, DeepSeekMath 2402.03300 Eq. 3)."""
    return Objective(logp, False, None, None)


def _check_clip(variant: str, clip_low, clip_high, clip_ratio_c, tau_pos, tau_neg) -> None:
    if variant in _RATIO_CLIPPED or variant == "gmpo":
        _checks.positive("clip_low", clip_low)
        _checks.positive("clip_high", clip_high)
        if variant != "gmpo" and clip_low >= 1:
            raise ValueError(f"clip_low={clip_low} must be < 1 (the lower ratio bound is 1 - clip_low)")
    if variant == "cispo":
        _checks.positive("clip_high", clip_high)
        _checks.positive("clip_low", clip_low, allow_none=True)
        if clip_low is not None and clip_low >= 1:
            raise ValueError(f"clip_low={clip_low} must be < 1 (the lower ratio bound is 1 - clip_low)")
    if clip_ratio_c is not None:
        if variant not in _RATIO_CLIPPED:
            raise ValueError(
                f"clip_ratio_c (dual clip) applies to grpo/gspo/gspo_token, not variant={variant!r}"
            )
        if not float(clip_ratio_c) > 1 + float(clip_high):
            raise ValueError(
                f"clip_ratio_c={clip_ratio_c} must be > 1 + clip_high = {1 + clip_high} (e.g. 3.0)"
            )
    if variant == "sapo":
        _checks.positive("sapo_tau_pos", tau_pos)
        _checks.positive("sapo_tau_neg", tau_neg)


def _optional(name: str, x: Tensor | None, like: Tensor) -> Tensor | None:
    if x is None:
        return None
    x = _checks.floating(name, x)
    return _checks.shape(name, x, tuple(like.shape), "[B, T] like logp")


def _finite_or_zero(name: str, x: Tensor, where: Tensor) -> Tensor:
    """Raises if `x` is non-finite where `where` is true; zeroes it elsewhere when needed (rare path)."""
    if bool(torch.isfinite(x).all()):
        return x
    _checks.finite_where(name, x, where)
    return torch.where(where, x, 0.0)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    variant: str,
    clip_low: float | None = None,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
    agg: str,
    agg_constant: float | None = None,
    importance_weights: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    normaliser: float | Tensor | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO-family policy loss (see the module docstring). Returns (scalar loss, metrics)."""
    _checks.choice("variant", variant, VARIANTS)
    _check_agg(agg, agg_constant)
    _checks.choice("kl_estimator", kl_estimator, ESTIMATORS)
    _check_clip(variant, clip_low, clip_high, clip_ratio_c, sapo_tau_pos, sapo_tau_neg)
    for name, v in (("kl_coef", kl_coef), ("entropy_coef", entropy_coef)):
        if not math.isfinite(float(v)):
            raise ValueError(f"{name}={v!r} must be finite")

    logp = _checks.floating("logp", logp)
    _checks.ndim("logp", logp, 2, "[B, T]")
    bt = tuple(logp.shape)
    old_logp = _checks.shape("old_logp", _checks.floating("old_logp", old_logp), bt, "[B, T] like logp")
    m = _checks.mask("loss_mask", loss_mask, logp)
    advantages = _checks.floating("advantages", advantages)
    row_adv = tuple(advantages.shape) == bt[:1]
    if not row_adv and tuple(advantages.shape) != bt:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected [B] = {bt[:1]} or [B, T] = {bt}"
        )
    if not row_adv and variant == "gmpo":
        raise ValueError(f"variant='gmpo' needs sequence advantages of shape [B] = {bt[:1]}, got {bt}")
    iw = _optional("importance_weights", importance_weights, logp)
    tw = _optional("token_weights", token_weights, logp)
    ref = _optional("ref_logp", ref_logp, logp)
    ent = _optional("entropy", entropy, logp)
    if ref is None and kl_coef != 0:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp")
    if ent is None and entropy_coef != 0:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")

    # Compute in at least fp32 (bf16 sums over a million tokens are too coarse).
    if logp.dtype in (torch.float16, torch.bfloat16):
        logp = logp.float()
    dt = logp.dtype
    # Padding may hold anything (NaN, -inf, 1e30): `where` selects it away before any arithmetic, because
    # a masked-out inf would still turn into NaN gradients through 0 * inf in backward.
    log_ratio = torch.where(m, logp - old_logp.detach().to(dt), 0.0)
    n = torch.count_nonzero(m, dim=-1)  # [B] loss tokens per sequence (int64)
    nf = n.to(dt)
    if row_adv:
        adv = advantages.detach().to(dt)
        adv = torch.where(n > 0, adv, 0.0)  # an empty row's advantage may be anything
        _checks.finite_where("advantages", adv, None)
        adv = adv.unsqueeze(-1)  # [B, 1]: explicit per-sequence broadcast
    else:
        adv = _finite_or_zero("advantages", advantages.detach().to(dt), m)
    iw = None if iw is None else _finite_or_zero("importance_weights", iw.detach().to(dt), m)
    tw = None if tw is None else _finite_or_zero("token_weights", tw.detach().to(dt), m)
    ent = None if ent is None else _finite_or_zero("entropy", ent.to(dt), m)

    if variant == "grpo":
        obj = grpo_objective(log_ratio, adv, clip_low, clip_high, clip_ratio_c)
    elif variant in ("gspo", "gspo_token"):
        obj = gspo_objective(
            log_ratio, nf, adv, clip_low, clip_high, clip_ratio_c, token=variant == "gspo_token"
        )
    elif variant == "gmpo":
        obj = gmpo_objective(log_ratio, nf, adv, clip_low, clip_high)
    elif variant == "cispo":
        obj = cispo_objective(logp, log_ratio, clip_low, clip_high)
    elif variant == "sapo":
        obj = sapo_objective(log_ratio, adv, sapo_tau_pos, sapo_tau_neg)
    else:
        obj = reinforce_objective(logp)

    values, per_seq = obj.values, obj.per_seq
    if not row_adv:
        values = values * adv
    for w in (iw, tw):
        if w is not None:
            values, per_seq = values * w, False
    row_scale = adv.squeeze(-1) if row_adv else None
    policy = -_aggregate(values, m, agg, agg_constant, normaliser, n=n, per_seq=per_seq, row_scale=row_scale)
    total = policy
    metrics: dict[str, Tensor] = {}
    if ref is not None:
        log_r = torch.where(m, ref.detach().to(dt) - logp, 0.0)
        kl = _aggregate(kl_from_log_ratio(log_r, kl_estimator), m, agg, agg_constant, normaliser, n=n)
        total = total + kl_coef * kl
        metrics["loss/kl"] = kl.detach().to(torch.float64)
    if ent is not None:
        ent_term = _aggregate(ent, m, agg, agg_constant, normaliser, n=n)
        total = total - entropy_coef * ent_term
        metrics["loss/entropy"] = ent_term.detach().to(torch.float64)
    with torch.no_grad():
        stats = _ratio_metrics(
            variant, obj, log_ratio.detach(), total.detach(), adv, m, n, row_adv, iw, tw, clip_low, clip_high,
            clip_ratio_c,
        )  # fmt: skip
    if stats is None:  # non-finite input under the mask: name it
        for name, t in (("logp", logp.detach()), ("old_logp", old_logp), ("ref_logp", ref)):
            if t is not None:
                _checks.finite_where(name, t, m)
        raise ValueError("the loss is not finite although every input is; report this with the inputs")
    metrics["loss/policy"] = policy.detach().to(torch.float64)
    metrics["loss/total"] = total.detach().to(torch.float64)
    metrics.update(stats)
    return total, metrics


def _ratio_metrics(
    variant, obj, lr, total, adv, m, n, row_adv, iw, tw, clip_low, clip_high, dual
) -> dict[str, Tensor] | None:
    """Token statistics (module docstring) from a few full-size reductions; None if an input is not finite.

    Padding has log r = 0 exactly (ratio 1, expm1 0), which no clip bound excludes, so the token sums below
    need no mask. `lr` [B, T] is the detached, padding-zeroed token log-ratio.
    """
    f64 = torch.float64
    tokens = n.sum().to(f64)
    denom = tokens.clamp_min(1)
    zero = torch.zeros((), dtype=f64, device=lr.device)
    lr_sum = lr.sum().to(f64)
    em1_sum = lr.clamp(max=MAX_LOG_RATIO).expm1_().sum().to(f64)
    if variant in _SEQUENCE_RATIO:  # the ratio is one per sequence: [B]
        present = n > 0
        s_log = lr.sum(dim=-1) / n.clamp_min(1).to(lr.dtype)
        mn = torch.where(present, s_log, _INF).min()
        mx = torch.where(present, s_log, -_INF).max()
        ratio_sum = (torch.exp(s_log.clamp(max=MAX_LOG_RATIO)).to(f64) * n).sum()
    else:
        mn, mx = torch.aminmax(lr)
        ratio_sum = em1_sum + tokens
    host = torch.stack([lr_sum, em1_sum, total.to(f64), mn.to(f64), mx.to(f64)]).tolist()
    if not all(math.isfinite(v) for v in host[:3]) or math.isnan(host[3]) or math.isnan(host[4]):
        return None
    full = int(tokens) == lr.numel()
    if variant not in _SEQUENCE_RATIO:  # padding holds 0: aminmax is exact unless the extreme is 0
        if not (host[3] < 0 or full):
            mn = torch.where(m, lr, _INF).min()
        if not (host[4] > 0 or full):
            mx = torch.where(m, lr, -_INF).max()
    has = tokens > 0
    high, low, dual_c, removed = _clip_counts(variant, obj, lr, adv, m, n, row_adv, clip_low, clip_high, dual)
    if row_adv and iw is None and tw is None:
        zero_grad = removed + (n * (adv.squeeze(-1) == 0)).sum().to(f64)
    else:
        zero_grad = _zero_grad_count(variant, obj, adv, m, n, iw, tw)
    return {
        "loss/tokens": tokens,
        "loss/seqs": (n > 0).sum().to(f64),
        "loss/clip_frac_low": low / denom,
        "loss/clip_frac_high": high / denom,
        "loss/clip_frac_dual": dual_c / denom,
        "loss/ratio_mean": torch.where(has, ratio_sum / denom, zero),
        "loss/ratio_min": torch.where(has, torch.exp(mn.to(f64)), zero),
        "loss/ratio_max": torch.where(has, torch.exp(mx.to(f64).clamp(max=MAX_LOG_RATIO)), zero),
        "loss/approx_kl": (em1_sum - lr_sum) / denom,  # k3 of KL(pi_old || pi_theta): (r - 1) - log r
        "loss/zero_grad_frac": zero_grad / denom,
    }


def _zero_grad_count(variant, obj, adv, m, n, iw, tw) -> Tensor:
    """Loss tokens whose gradient is exactly zero, by the variant's gradient structure (general path)."""
    w = None
    for x in (iw, tw):
        if x is not None:
            w = x if w is None else w * x
    clipped = obj.clipped if obj.clipped is not None else torch.zeros((), dtype=torch.bool, device=m.device)
    if variant == "gspo":  # one shared gradient per sequence: s_i / n_i * sum_t A_t w_t [t unclipped]
        coeff = adv.expand(m.shape) if w is None else adv * w
        row = torch.where(m & ~clipped, coeff, 0.0).sum(dim=-1)
        return (n * (row == 0)).sum().to(torch.float64)
    if variant == "gmpo":  # token t: A_i * seq_i / n_i * sum_t w_t * [t unclipped]
        row_zero = adv.squeeze(-1) == 0
        if w is not None:
            row_zero = row_zero | (torch.where(m, w, 0.0).sum(dim=-1) == 0)
        return torch.count_nonzero(m & (clipped | row_zero.unsqueeze(-1))).to(torch.float64)
    zg = adv == 0  # token-level gradients: A_t * w_t * (ratio term), zero where any factor is
    if w is not None:
        zg = zg | (w == 0)
    if variant != "cispo":
        zg = zg | clipped
    return torch.count_nonzero(zg & m).to(torch.float64)


def _clip_counts(variant, obj, lr, adv, m, n, row_adv, clip_low, clip_high, dual):
    """(high, low, dual, gradient-removing clips) token counts as 0-dim float64 tensors."""
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=lr.device)
    if variant == "cispo":  # the cap only reweights: nothing is removed
        high = torch.count_nonzero(lr > math.log1p(clip_high)).to(f64)
        low = torch.count_nonzero(lr < math.log1p(-clip_low)).to(f64) if clip_low is not None else zero
        return high, low, zero, zero
    if obj.clipped is None:
        return zero, zero, zero, zero
    clipped, raw = obj.clipped, obj.raw_log
    pos, neg = adv > 0, adv < 0
    dual_bound = math.log(dual) if dual is not None else None
    if row_adv:  # counts per row, split by the row's sign
        if clipped.shape[-1] == 1:  # sequence clip: the whole row
            changed = clipped.squeeze(-1).to(f64) * n
            over_dual = (raw > dual_bound).squeeze(-1).to(f64) * n if dual is not None else None
        else:
            changed = torch.count_nonzero(clipped, dim=-1).to(f64)
            over_dual = torch.count_nonzero(raw > dual_bound, dim=-1).to(f64) if dual is not None else None
        p, q = pos.squeeze(-1), neg.squeeze(-1)
        high = (changed * p).sum()
        dual_c = (over_dual * q).sum() if over_dual is not None else zero
        low = (changed * q).sum() - dual_c
        return high, low, dual_c, high + low + dual_c
    changed = clipped & m
    high = torch.count_nonzero(changed & pos).to(f64)
    dual_c = torch.count_nonzero(changed & neg & (raw > dual_bound)).to(f64) if dual is not None else zero
    low = torch.count_nonzero(changed & neg).to(f64) - dual_c
    return high, low, dual_c, high + low + dual_c
