"""Attribution of the sampler-learner mismatch to routing and to numeric precision.

Passes (all score the same sampled tokens, [B, T] log-probabilities):
- full comparison: sampler vs the learner as configured (dtype, replay mode) -> divergence `total`;
- routing shadow: the configured learner without routing replay vs the same learner with R3 (the sampler's
  routes replayed); the two differ only in which experts the tokens go to -> divergence `routing`;
- precision shadow: the learner in the configured dtype vs the learner in fp32, both on the same routes
  (replay the learner's own recorded routes so only arithmetic differs) -> divergence `numeric`.

Shares (each in [0, 1], `routing_share + numeric_share + residual_share` = 1 unless all are 0):

    denom          = max(total, routing + numeric)
    routing_share  = routing / denom
    numeric_share  = numeric / denom
    residual_share = max(total - (routing + numeric), 0) / denom   # kernels, layout, anything else

Divergences are not additive, so the parts rarely sum to the total. When they fall short the remainder is
the residual; when they overshoot (the sources interact, or estimator noise) the parts are rescaled to
their own sum and the residual is 0, which keeps their ratio. Negative inputs (k1 estimates can be
slightly negative) are clamped to 0. When `denom <= eps` there is nothing to attribute: all shares are 0,
never NaN, and `mismatch/attribution_total` (logged alongside) says why.

The default divergence is k3 KL(first pass || second pass) on the sampled tokens (the same estimator as
`mismatch/kl_sampler_learner_k3`). For small mismatch it equals E[delta^2]/2, and squared log-ratios of
independent sources add, which is what makes the shares meaningful.
"""

from __future__ import annotations

import math

import torch

from megagrpo.diagnostics.mismatch import mismatch_metrics
from megagrpo.diagnostics.reduce import Reducer

DEFAULT_EPS = 1e-12


def attribution_shares(
    total: float, routing: float | None = None, numeric: float | None = None, *, eps: float = DEFAULT_EPS
) -> dict[str, float]:
    """Shares of `total` mismatch explained by routing and by precision (definition in the module doc).

    A part that was not measured (None) is treated as 0 and its share metric is omitted.
    """
    vals = {"total": total, "routing": routing, "numeric": numeric}
    for name, v in vals.items():
        if v is not None and not math.isfinite(float(v)):
            raise ValueError(f"attribution_shares: {name} must be finite, got {v}")
    if eps < 0:
        raise ValueError(f"attribution_shares: eps must be >= 0, got {eps}")
    t = max(float(total), 0.0)
    r = max(float(routing), 0.0) if routing is not None else 0.0
    n = max(float(numeric), 0.0) if numeric is not None else 0.0
    denom = max(t, r + n)
    out = {"mismatch/attribution_total": t}
    if denom <= eps:
        r_share = n_share = res_share = 0.0
    else:
        r_share, n_share = r / denom, n / denom
        res_share = max(0.0, t - (r + n)) / denom
    if routing is not None:
        out["mismatch/routing_share"] = r_share
    if numeric is not None:
        out["mismatch/numeric_share"] = n_share
    out["mismatch/residual_share"] = res_share
    return out


def pass_divergence(
    ref_logp: torch.Tensor,
    other_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    measure: str = "kl_sampler_learner_k3",
    reducer: Reducer | None = None,
) -> float:
    """Divergence between two passes over the same tokens ([B, T] each), as a `mismatch/` token mean with
    `ref_logp` in the sampler's role. `measure`: a token-mean key of `mismatch_metrics` without prefix."""
    res = mismatch_metrics(ref_logp, other_logp, loss_mask, reducer=reducer)
    key = "mismatch/" + measure
    if key not in res.metrics:
        raise ValueError(f"measure {measure!r} is not a mismatch metric; e.g. 'kl_sampler_learner_k3'")
    return res.metrics[key]


def attribute_mismatch(
    sampler_logp: torch.Tensor,
    learner_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    learner_no_replay_logp: torch.Tensor | None = None,
    learner_r3_logp: torch.Tensor | None = None,
    learner_fp32_logp: torch.Tensor | None = None,
    measure: str = "kl_sampler_learner_k3",
    reducer: Reducer | None = None,
    eps: float = DEFAULT_EPS,
) -> dict[str, float]:
    """Routing and numeric shares from the passes' log-probabilities ([B, T] each, same tokens).

    Routing needs both `learner_no_replay_logp` and `learner_r3_logp` (one of them is usually
    `learner_logp` itself); numeric needs `learner_fp32_logp`, compared with `learner_logp`.
    """
    total = pass_divergence(sampler_logp, learner_logp, loss_mask, measure=measure, reducer=reducer)
    routing = None
    if (learner_no_replay_logp is None) != (learner_r3_logp is None):
        raise ValueError("routing attribution needs both learner_no_replay_logp and learner_r3_logp")
    if learner_r3_logp is not None:
        routing = pass_divergence(
            learner_r3_logp, learner_no_replay_logp, loss_mask, measure=measure, reducer=reducer
        )
    numeric = None
    if learner_fp32_logp is not None:
        numeric = pass_divergence(
            learner_fp32_logp, learner_logp, loss_mask, measure=measure, reducer=reducer
        )
    return attribution_shares(total, routing, numeric, eps=eps)
