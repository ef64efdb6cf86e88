"""Per-token KL(pi_theta || pi_ref) estimators, for the loss (`policy_loss(ref_logp=...)`) or the reward.

Samples y_t come from the policy, so with log r = log pi_ref(y_t) - log pi_theta(y_t) the estimators of
Schulman, "Approximating KL divergence" (2020) are k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.
`low_var_kl` is k3 with log r clamped to [-20, 20] and the result clamped to [-10, 10] so one wild token
cannot dominate a batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagrpo.algo import _checks

ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")

_LOW_VAR_LOG_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def _token_kl(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Unchecked core of `token_kl`; `logp`, `ref_logp` broadcastable float tensors."""
    return kl_from_log_ratio(ref_logp - logp, estimator)


def kl_from_log_ratio(log_r: Tensor, estimator: str) -> Tensor:
    """Schulman (2020) k1/k2/k3 from log r = log pi_ref - log pi_theta (any shape, unchecked)."""
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    log_r = log_r.clamp(-_LOW_VAR_LOG_CLAMP, _LOW_VAR_LOG_CLAMP)
    return (torch.expm1(log_r) - log_r).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


def token_kl(
    logp: Tensor, ref_logp: Tensor, estimator: str = "k3", loss_mask: Tensor | None = None
) -> Tensor:
    """Schulman (2020) k1/k2/k3 estimator of KL(pi_theta || pi_ref) per token; gradients flow through `logp`.

    logp, ref_logp: `[B, T]` log-probabilities of the sampled tokens. loss_mask: optional `[B, T]`; where it
    is false the result is 0 and the inputs may hold anything. Returns `[B, T]`.
    """
    _checks.choice("estimator", estimator, ESTIMATORS)
    logp = _checks.floating("logp", logp)
    ref_logp = _checks.floating("ref_logp", ref_logp)
    _checks.ndim("logp", logp, 2, "[B, T]")
    _checks.shape("ref_logp", ref_logp, tuple(logp.shape), "[B, T] like logp")
    if loss_mask is None:
        _checks.finite_where("logp", logp.detach(), None)
        _checks.finite_where("ref_logp", ref_logp, None)
        return _token_kl(logp, ref_logp, estimator)
    m = _checks.mask("loss_mask", loss_mask, logp)
    _checks.finite_where("logp", logp.detach(), m)
    _checks.finite_where("ref_logp", ref_logp, m)
    kl = _token_kl(torch.where(m, logp, 0.0), torch.where(m, ref_logp, 0.0), estimator)
    return torch.where(m, kl, 0.0)
