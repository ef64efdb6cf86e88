"""Group-relative advantages from rewards `[n_prompts, G]` (G completions per prompt).

Every function returns a tensor of the same `[n_prompts, G]` shape and dtype as its input (fp32 at least);
the trainer flattens it to the per-sequence `[B = n_prompts * G]` advantages that `policy_loss` takes.
A group size of 1 is rejected: a group-relative baseline needs at least two samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagrpo.algo import _checks

METHODS = ("grpo", "dr_grpo", "rloo", "batch_std", "rank")


def _check_rewards(
    rewards: object, name: str = "rewards", ndim: int = 2, desc: str = "[n_prompts, G]"
) -> Tensor:
    rewards = _checks.floating(name, rewards)
    _checks.ndim(name, rewards, ndim, desc)
    if rewards.shape[0] == 0:
        raise ValueError(f"{name} has no groups (shape {tuple(rewards.shape)})")
    if rewards.shape[1] < 2:
        raise ValueError(f"{name} has group size G={rewards.shape[1]}; group-relative advantages need G >= 2")
    _checks.finite_where(name, rewards, None)
    if rewards.dtype in (torch.float16, torch.bfloat16):
        rewards = rewards.float()
    return rewards


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage (r - mean_g) / (std_g + eps), unbiased std (DeepSeekMath 2402.03300, Sec. 4.1.2)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=1)
    return (rewards - mean) / (std + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO advantage r - mean_g, no std division (Understanding R1-Zero 2503.20783, Eq. 3 / Sec. 3.1)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO leave-one-out baseline r_i - mean_{j != i} r_j (Ahmadian et al. 2402.14740, Eq. 7)."""
    g = rewards.shape[1]
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    return rewards - others


def batch_std_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Group mean, batch std: (r - mean_g) / (std_batch + eps) (LitePPO 2508.08221 Sec. 4.1; ScaleRL 2510.13786)."""
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(correction=1) + eps)


def rank_advantages(rewards: Tensor) -> Tensor:
    """GOPO rank advantage: average rank within the group mapped linearly onto [-1, 1]; ties share a rank.

    The lowest reward gets -1, the highest +1; a group whose rewards are all equal gets 0 everywhere.
    """
    g = rewards.shape[1]
    below = (rewards.unsqueeze(2) > rewards.unsqueeze(1)).sum(dim=2)  # [n, G]: rewards strictly below r_i
    equal = (rewards.unsqueeze(2) == rewards.unsqueeze(1)).sum(dim=2)  # includes r_i itself
    rank = below.to(rewards.dtype) + (equal.to(rewards.dtype) - 1) / 2  # 0-based, average over ties
    return 2 * rank / (g - 1) - 1


def group_advantages(rewards: Tensor, method: str, eps: float = 1e-6) -> Tensor:
    """Advantages `[n_prompts, G]` from rewards `[n_prompts, G]` by `method` (see `METHODS`)."""
    _checks.choice("method", method, METHODS)
    _checks.positive("eps", eps, strict=False)
    rewards = _check_rewards(rewards)
    if method == "grpo":
        return grpo_advantages(rewards, eps)
    if method == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if method == "rloo":
        return rloo_advantages(rewards)
    if method == "batch_std":
        return batch_std_advantages(rewards, eps)
    return rank_advantages(rewards)


def gdpo(rewards: Tensor, weights: Tensor, eps: float = 1e-6, *, batch_normalise: bool = True) -> Tensor:
    """GDPO: z-score each reward in its group, weighted sum, then batch z-score (GDPO 2601.05242, Sec. 3).

    rewards: `[n_prompts, G, K]`, K reward components. weights: `[K]`. Returns `[n_prompts, G]`.
    `batch_normalise=False` stops after the weighted sum of the per-reward group z-scores.
    """
    rewards = _check_rewards(rewards, ndim=3, desc="[n_prompts, G, K]")
    weights = _checks.floating("weights", weights)
    _checks.shape("weights", weights, (rewards.shape[2],), "[K] (one weight per reward component)")
    _checks.finite_where("weights", weights, None)
    _checks.positive("eps", eps, strict=False)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=1)
    per_reward = (rewards - mean) / (std + eps)  # [n, G, K]
    combined = (per_reward * weights.to(per_reward.dtype)).sum(dim=2)
    if not batch_normalise:
        return combined
    return (combined - combined.mean()) / (combined.std(correction=1) + eps)


def advantage_metrics(advantages: Tensor) -> dict[str, Tensor]:
    """`adv/*` metrics (0-dim detached tensors) of the advantages of one global batch, any shape.

    adv/mean, adv/std (unbiased), adv/abs_max, adv/zero_frac (fraction exactly 0: no learning signal).
    """
    a = _checks.floating("advantages", advantages).detach().reshape(-1).to(torch.float64)
    if a.numel() == 0:
        raise ValueError("advantages is empty")
    return {
        "adv/mean": a.mean(),
        "adv/std": a.std(correction=1) if a.numel() > 1 else torch.zeros((), dtype=torch.float64),
        "adv/abs_max": a.abs().max(),
        "adv/zero_frac": (a == 0).to(torch.float64).mean(),
    }
