"""Pure tensor math of the GRPO family: advantages, policy losses, KL, importance weights, filters.

Imports torch only. Modules: `advantages`, `losses`, `aggregation` (the distributed loss contract),
`kl`, `importance`, `filters`, `metrics` (how metrics merge across micro-batches and ranks).
"""

from megagrpo.algo.advantages import advantage_metrics, gdpo, group_advantages
from megagrpo.algo.aggregation import AGG_MODES, aggregate, loss_normaliser, masked_mean, nll_loss
from megagrpo.algo.filters import keep_groups, overlong_mask, soft_overlong_penalty
from megagrpo.algo.importance import ImportanceMasks, importance_masks, train_inference_weights
from megagrpo.algo.kl import token_kl
from megagrpo.algo.losses import VARIANTS, policy_loss
from megagrpo.algo.metrics import all_reduce_metrics, merge_metrics

__all__ = [
    "AGG_MODES",
    "VARIANTS",
    "ImportanceMasks",
    "advantage_metrics",
    "aggregate",
    "all_reduce_metrics",
    "gdpo",
    "group_advantages",
    "importance_masks",
    "keep_groups",
    "loss_normaliser",
    "masked_mean",
    "merge_metrics",
    "nll_loss",
    "overlong_mask",
    "policy_loss",
    "soft_overlong_penalty",
    "token_kl",
    "train_inference_weights",
]
