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


def kl_penalised_rewards(
    rewards: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    response_mask: Tensor,
    coef: float,
    estimator: str = "k3",
) -> tuple[Tensor, Tensor]:
    """KL-shaped reward r - coef * sum_t KL_t (Ziegler et al. 1909.08593 Sec. 2.2; InstructGPT 2203.02155 Eq. 2).

    rewards: `[B]` sequence rewards. logp: `[B, T]` log-probabilities of the sampled tokens under the
    policy that sampled them; ref_logp: `[B, T]` under the reference. response_mask: `[B, T]` the response
    tokens (elsewhere the inputs may hold anything). Returns (penalised rewards `[B]`, penalty `[B]` =
    coef * sum_t KL_t), both in `rewards`' dtype (fp32 at least). No gradient flows: a reward is a constant.
    """
    rewards = _checks.floating("rewards", rewards)
    _checks.ndim("rewards", rewards, 1, "[B]")
    _checks.finite_where("rewards", rewards, None)
    _checks.positive("coef", coef, strict=False)
    logp = _checks.floating("logp", logp).detach()
    _checks.ndim("logp", logp, 2, "[B, T]")
    if logp.shape[0] != rewards.shape[0]:
        raise ValueError(f"logp has {logp.shape[0]} rows for {rewards.shape[0]} rewards")
    kl = token_kl(logp, ref_logp.detach(), estimator, response_mask)
    dt = torch.promote_types(rewards.dtype, torch.float32)
    penalty = coef * kl.to(dt).sum(dim=1)
    return rewards.to(dt) - penalty, penalty
