"""Sampler-vs-learner mismatch metrics (`mismatch/` names), per sequence and over the whole batch.

Inputs (per-token, padded layout):
- `sampler_logp` [B, T]: log mu(y_t), the sampler's log-probability of the token it sampled.
- `learner_logp` [B, T]: log pi(y_t), the learner's log-probability of the same token.
- `loss_mask` [B, T]: bool or 0/1; True marks a response token that counts. Padded positions may hold any
  value (even NaN/inf); they are never read into a result.

Every token was sampled from the sampler mu, so the per-token log-ratio delta = log pi - log mu and the
ratio w = pi/mu = exp(delta) give single-sample Monte Carlo estimators (Schulman's k1/k3) under mu:

- KL(mu||pi) = E_mu[-delta]:            k1 = -delta,              k3 = (w - 1) - delta      (no weighting)
- KL(pi||mu) = E_pi[delta] = E_mu[w·delta]:
                                        k1 = w·delta,             k3 = 1 - w + w·delta      (weighted by w)
  (k3 for KL(pi||mu) is the k3 estimator under pi, (1/w - 1) + delta, importance-weighted by w.)
- chi^2(pi||mu) = E_mu[(w - 1)^2]; N/ESS ~ 1 + chi^2 for token weights w.

k1 is unbiased but can be negative per batch; k3 is unbiased (E_mu[w] = 1) and >= 0 per token. All
arithmetic is fp64; ratios are exponentiated only after quantiles/means are taken in log space, so nothing
overflows unless a single |delta| exceeds ~709 (a probability ratio beyond e^709), where the affected
quantity is +inf, never NaN.

Defined values (never NaN): with no valid token in the (global) batch every divergence, |dp| and fraction
is 0, every ratio quantile is 1, ESS ratios are 1, the correlation is 1, and `mismatch/n_tokens` is 0.
A sequence with no valid token is excluded from sequence quantiles, `seq_valid` is False for it and its
per-sequence values are the same neutral defaults. Mismatched shapes, non-finite log-probabilities at
valid positions, or a mask that is not 0/1 raise ValueError naming the argument.

Quantiles (token and sequence ratios) come from fixed log-spaced histograms of the log-ratios
(`megagrpo.algo.quantiles`): each is the bin edge on the outward side of the exact type-7 quantile, so an
upper quantile (p50 and above) is never below the exact one and a lower one (p001) never above, and the
ratio is within a factor exp(1.09%·|log w| + 2^-23) of the order statistic w it brackets (0.76% at w = 2).

Distributed: pass `reducer=DistReducer(dp_group)`; sums, counts, maxima and the quantile histograms are
all-reduced (a fixed 123 KB of histograms per call, whatever the batch), so the metrics equal those of the
concatenated batch, bit for bit whatever the DP size.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megagrpo.algo.importance import ImportanceMasks
from megagrpo.algo.quantiles import summarize
from megagrpo.diagnostics.reduce import LocalReducer, Reducer

PREFIX = "mismatch/"
# Token-ratio quantiles (name suffix -> q). p001 is the lower tail that an MIS floor needs.
TOKEN_RATIO_QUANTILES = {"p001": 0.001, "p50": 0.5, "p99": 0.99, "p999": 0.999}
SEQ_RATIO_QUANTILES = {"p50": 0.5, "p99": 0.99}
_FLOAT_MAX_LOG = math.log(sys.float_info.max)


def token_ratio_metric_name(q: float) -> str:
    """Metric name of the token-ratio quantile q: the standard names for 0.001/0.5/0.99/0.999, else
    `mismatch/token_ratio_q{q}` (computed when q is passed in `extra_token_quantiles`)."""
    for name, std in TOKEN_RATIO_QUANTILES.items():
        if q == std:
            return f"{PREFIX}token_ratio_{name}"
    return f"{PREFIX}token_ratio_q{q:g}"


@dataclass
class MismatchResult:
    """`metrics`: global scalars keyed `mismatch/...`. `per_sequence`: local [B] fp64 tensors keyed by the
    same suffixes (see `PER_SEQUENCE_KEYS`). `seq_valid` [B] bool: sequence has at least one valid token."""

    metrics: dict[str, float]
    per_sequence: dict[str, torch.Tensor]
    seq_valid: torch.Tensor


PER_SEQUENCE_KEYS = (
    "n_tokens",
    "abs_dp_mean",
    "abs_dp_max",
    "abs_dlogp_mean",
    "kl_sampler_learner_k1",
    "kl_sampler_learner_k3",
    "kl_learner_sampler_k1",
    "kl_learner_sampler_k3",
    "chi2",
    "seq_log_ratio_prod",
    "seq_log_ratio_geo",
    "ess_ratio",
)


def _check_inputs(sampler_logp, learner_logp, loss_mask) -> torch.Tensor:
    for name, t in (("sampler_logp", sampler_logp), ("learner_logp", learner_logp), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be [B, T], got shape {tuple(t.shape)}")
    if sampler_logp.shape != learner_logp.shape:
        raise ValueError(
            f"learner_logp shape {tuple(learner_logp.shape)} != sampler_logp shape {tuple(sampler_logp.shape)}; "
            "both must be [B, T] over the same tokens"
        )
    if loss_mask.shape != sampler_logp.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} != sampler_logp shape {tuple(sampler_logp.shape)}"
        )
    for name, t in (("sampler_logp", sampler_logp), ("learner_logp", learner_logp)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    if loss_mask.dtype == torch.bool:
        valid = loss_mask
    else:
        if not ((loss_mask == 0) | (loss_mask == 1)).all():
            raise ValueError("loss_mask must be bool or hold only 0 and 1")
        valid = loss_mask != 0
    for name, t in (("sampler_logp", sampler_logp), ("learner_logp", learner_logp)):
        bad = valid & ~torch.isfinite(t)
        if bad.any():
            b, s = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} is not finite at a valid token (batch {b}, position {s}): {float(t[b, s])}"
            )
    return valid


def _check_importance(masks: ImportanceMasks, shape: torch.Size) -> list[torch.Tensor]:
    out = []
    for name in _IS_TOKEN_FIELDS + _IS_SEQ_FIELDS:
        want = shape if name in _IS_TOKEN_FIELDS else shape[:1]
        t = getattr(masks, name, None)
        if not isinstance(t, torch.Tensor) or t.shape != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"importance.{name} must be a tensor of shape {tuple(want)}, got {got}")
        out.append(t.bool())
    return out


def _exp_capped(log_value: float) -> float:
    """exp for reporting: saturates at the largest float instead of overflowing."""
    return math.exp(min(log_value, _FLOAT_MAX_LOG))


def token_ratio_quantiles(
    sampler_logp: torch.Tensor,
    learner_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    quantiles: Sequence[float],
    *,
    reducer: Reducer | None = None,
) -> dict[str, float]:
    """Only the token-ratio quantiles q of w = pi/mu (named by `token_ratio_metric_name`) and
    `mismatch/n_tokens`: what `tis.cap: auto` needs when the full set (`diagnostics.mismatch`) is off.
    Same definitions, validation and histogram quantiles as `mismatch_metrics`; all quantiles are 1 when
    no token is valid. Per rank with a `DistReducer`, whatever B×T and the DP size: one all-reduce of a
    41 KB histogram and one of 2 fp64 extremes (`megagrpo.algo.quantiles.summarize`)."""
    _check_quantiles(quantiles)
    valid = _check_inputs(sampler_logp, learner_logp, loss_mask)
    red = reducer if reducer is not None else LocalReducer()
    delta = learner_logp[valid].to(torch.float64) - sampler_logp[valid].to(torch.float64)
    (d_sum,) = summarize([delta], red)
    out = {f"{PREFIX}n_tokens": float(d_sum.n)}
    for q in quantiles:
        out[token_ratio_metric_name(q)] = _exp_capped(d_sum.quantile(float(q))) if d_sum.n else 1.0
    return out


def _check_quantiles(quantiles: Sequence[float]) -> None:
    for q in quantiles:
        if not 0.0 <= float(q) <= 1.0:
            raise ValueError(f"extra_token_quantiles: {q} is not in [0, 1]")


def mismatch_metrics(
    sampler_logp: torch.Tensor,
    learner_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    importance: ImportanceMasks | None = None,
    extra_token_quantiles: tuple[float, ...] = (),
    reducer: Reducer | None = None,
) -> MismatchResult:
    """One metric set comparing sampler and learner token log-probabilities (definitions in the module doc
    and docs/metrics.md). Token-level metrics weight every valid token of the global batch equally.

    importance: the `megagrpo.algo.importance.importance_masks` result of the TIS/MIS rule on this batch;
    adds the `mismatch/is_frac_*` fractions by cause (same names and definitions as
    `algo.importance.importance_metrics`, but exact over the global batch with `reducer`).
    extra_token_quantiles: further token-ratio quantiles q in [0, 1] (named by `token_ratio_metric_name`),
    e.g. the `tis.auto.quantile` of the config.

    Per rank with a `DistReducer`, whatever B×T and the DP size: all-reduces of 24 fp64 sums and 3 maxima
    and of three 41 KB quantile histograms plus their 6 fp64 extremes; nothing is gathered.
    """
    _check_quantiles(extra_token_quantiles)
    valid = _check_inputs(sampler_logp, learner_logp, loss_mask)
    red = reducer if reducer is not None else LocalReducer()
    dev = sampler_logp.device
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=dev)
    neg_inf = torch.full((), -math.inf, dtype=f64, device=dev)

    # Work on the valid tokens only, flattened to [n]; `rows` [n] is each token's sequence index.
    B = valid.shape[0]
    rows = valid.nonzero(as_tuple=True)[0]
    ls = sampler_logp[valid].to(f64)
    ll = learner_logp[valid].to(f64)
    delta = ll - ls
    ps, pl = ls.exp(), ll.exp()
    abs_dp = (pl - ps).abs()
    w = delta.exp()
    em1 = torch.expm1(delta)
    k3_sl = em1 - delta
    k1_ls = w * delta
    # delta·w - expm1(delta) keeps precision near 0; the other form avoids inf - inf for huge delta.
    k3_ls = torch.where(delta > 1.0, w * (delta - 1.0) + 1.0, delta * w - em1)
    chi2 = em1 * em1

    def seq_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(B, dtype=f64, device=dev).index_add_(0, rows, x)

    def seq_max(x: torch.Tensor, init: float) -> torch.Tensor:
        return torch.full((B,), init, dtype=f64, device=dev).scatter_reduce_(0, rows, x, "amax")

    n_seq_tok = valid.sum(1).to(f64)  # [B]
    seq_valid = n_seq_tok > 0
    denom = n_seq_tok.clamp_min(1.0)
    seq_log_prod = seq_sum(delta)
    seq_log_geo = seq_log_prod / denom

    # ---------------- per sequence (local) ----------------
    per_seq: dict[str, torch.Tensor] = {"n_tokens": n_seq_tok}
    for key, x in (
        ("abs_dp_mean", abs_dp),
        ("abs_dlogp_mean", delta.abs()),
        ("kl_sampler_learner_k1", -delta),
        ("kl_sampler_learner_k3", k3_sl),
        ("kl_learner_sampler_k1", k1_ls),
        ("kl_learner_sampler_k3", k3_ls),
        ("chi2", chi2),
    ):
        per_seq[key] = seq_sum(x) / denom
    per_seq["abs_dp_max"] = seq_max(abs_dp, 0.0)
    per_seq["seq_log_ratio_prod"] = seq_log_prod
    per_seq["seq_log_ratio_geo"] = seq_log_geo
    # ESS within a sequence, shifted by the sequence's max log-ratio so no exp overflows.
    shift = delta - torch.where(seq_valid, seq_max(delta, -math.inf), zero)[rows]
    s1, s2 = seq_sum(shift.exp()), seq_sum((2.0 * shift).exp())
    per_seq["ess_ratio"] = torch.where(seq_valid, s1 * s1 / (denom * s2.clamp_min(1e-300)), 1.0)

    # ---------------- global: maxima ----------------
    has_tok = delta.numel() > 0
    local_max = torch.stack(
        [
            abs_dp.max() if has_tok else zero,
            delta.max() if has_tok else neg_inf,
            seq_log_prod[seq_valid].max() if has_tok else neg_inf,
        ]
    )
    gmax = red.max(local_max)
    d_max = gmax[1] if torch.isfinite(gmax[1]) else zero
    s_max = gmax[2] if torch.isfinite(gmax[2]) else zero

    # ---------------- global: sums ----------------
    if importance is not None:
        ta, tb, zw, sa, sb, sv = _check_importance(importance, sampler_logp.shape)
        cause_sums = [t[valid].to(f64).sum() for t in (ta, tb, zw)]
        cause_sums += [(t & seq_valid).to(f64).sum() for t in (sa, sb, sv)]
    else:
        cause_sums = [zero] * 6
    d_shift = delta - d_max
    s_shift = seq_log_prod[seq_valid] - s_max
    local_sums = torch.stack(
        [
            torch.tensor(float(delta.numel()), dtype=f64, device=dev),
            seq_valid.to(f64).sum(),
            abs_dp.sum(),
            delta.abs().sum(),
            -delta.sum(),
            k3_sl.sum(),
            k1_ls.sum(),
            k3_ls.sum(),
            chi2.sum(),
            d_shift.exp().sum(),  # sum w / e^max
            (2.0 * d_shift).exp().sum(),  # sum w^2 / e^(2 max)
            s_shift.exp().sum(),
            (2.0 * s_shift).exp().sum(),
            ps.sum(),
            pl.sum(),
            *cause_sums,
        ]
    )
    g = red.sum(local_sums)
    n_tok, n_seq = float(g[0]), float(g[1])

    # Centred second moments for the correlation (a second pass keeps them accurate near p ~ 1).
    if n_tok > 0:
        cs, cl = ps - g[13] / g[0], pl - g[14] / g[0]
        local_c = torch.stack([(cs * cs).sum(), (cl * cl).sum(), (cs * cl).sum()])
    else:
        local_c = torch.zeros(3, dtype=f64, device=dev)
    gc = red.sum(local_c)

    m: dict[str, float] = {"n_tokens": n_tok, "n_seqs": n_seq}
    if n_tok == 0:
        m.update({k: 0.0 for k in _TOKEN_MEAN_KEYS})
        m["abs_dp_max"] = 0.0
        for name in TOKEN_RATIO_QUANTILES:
            m[f"token_ratio_{name}"] = 1.0
        for name in SEQ_RATIO_QUANTILES:
            m[f"seq_ratio_prod_{name}"] = 1.0
            m[f"seq_log_ratio_prod_{name}"] = 0.0
            m[f"seq_ratio_geo_{name}"] = 1.0
        m.update(ess_ratio=1.0, seq_ess_ratio=1.0, prob_corr=1.0)
        if importance is not None:
            m.update({k: 0.0 for k in _IS_KEYS})
        for q in extra_token_quantiles:
            m[token_ratio_metric_name(q)[len(PREFIX) :]] = 1.0
        return MismatchResult({PREFIX + k: v for k, v in m.items()}, per_seq, seq_valid)

    for i, key in enumerate(_TOKEN_MEAN_KEYS, start=2):
        m[key] = float(g[i]) / n_tok
    m["abs_dp_max"] = float(gmax[0])
    m["ess_ratio"] = float(g[9] * g[9] / (g[0] * g[10]))
    m["seq_ess_ratio"] = float(g[11] * g[11] / (g[1] * g[12]))
    var_s, var_l, cov = (float(x) for x in gc)
    if var_s > 0.0 and var_l > 0.0:
        m["prob_corr"] = max(-1.0, min(1.0, cov / math.sqrt(var_s * var_l)))
    else:
        # Constant probabilities: correlation is undefined; 1 when the two agree exactly, else 0.
        m["prob_corr"] = 1.0 if float(gmax[0]) == 0.0 else 0.0
    if importance is not None:
        for j, key in enumerate(_IS_KEYS):
            m[key] = float(g[15 + j]) / (n_tok if j < 3 else n_seq)

    # ---------------- global: quantiles (histograms, see the module doc) ----------------
    d_sum, lp_sum, lg_sum = summarize([delta, seq_log_prod[seq_valid], seq_log_geo[seq_valid]], red)
    for name, q in TOKEN_RATIO_QUANTILES.items():
        m[f"token_ratio_{name}"] = _exp_capped(d_sum.quantile(q))
    for q in extra_token_quantiles:
        m[token_ratio_metric_name(q)[len(PREFIX) :]] = _exp_capped(d_sum.quantile(float(q)))
    for name, q in SEQ_RATIO_QUANTILES.items():
        lq = lp_sum.quantile(q)
        m[f"seq_log_ratio_prod_{name}"] = lq
        m[f"seq_ratio_prod_{name}"] = _exp_capped(lq)
        m[f"seq_ratio_geo_{name}"] = _exp_capped(lg_sum.quantile(q))
    return MismatchResult({PREFIX + k: v for k, v in m.items()}, per_seq, seq_valid)


_TOKEN_MEAN_KEYS = (
    "abs_dp_mean",
    "abs_dlogp_mean",
    "kl_sampler_learner_k1",
    "kl_sampler_learner_k3",
    "kl_learner_sampler_k1",
    "kl_learner_sampler_k3",
    "chi2",
)
# algo.importance.ImportanceMasks fields, and the metric each one feeds (token fractions, then sequence ones).
_IS_TOKEN_FIELDS = ("token_above_cap", "token_below_floor", "zero_weight")
_IS_SEQ_FIELDS = ("seq_above_cap", "seq_below_floor", "seq_veto")
_IS_KEYS = (
    "is_frac_token_above_cap",
    "is_frac_token_below_floor",
    "is_frac_zero_weight",
    "is_frac_seq_above_cap",
    "is_frac_seq_below_floor",
    "is_frac_seq_veto",
)
