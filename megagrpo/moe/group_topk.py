"""Group-limited top-k as DeepSeek-V3 and GLM-4.5 compute it, for megatron-core's `TopKRouter`.

The model (DeepSeek-V3 paper, arXiv 2412.19437 section 2.1.2; transformers' `DeepseekV3TopkRouter.
get_topk_indices`; SGLang's `biased_grouped_topk`) scores a group by the sum of its top-2 bias-corrected
expert scores, keeps the best `topk_group` groups and takes the top-k experts among them. megatron-core's
`group_limited_topk` sums the top `topk // group_topk` instead, which agrees only when that ratio is 2
(DeepSeek-V3's 8 / 4). `GroupScoredRouter` gives megatron's own routing code the model's rule through the
one seam that code has for choosing experts (the `router_replay` object it hands its top-k function), so
that every path (own routing, R2's RECORD, R3's REPLAY_FORWARD/BACKWARD) keeps megatron's score function,
bias, renormalisation and scaling unchanged, and only the group score is the model's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

# experts whose scores make a group's score: DeepSeek-V3's "sum of the highest 2 affinity scores"
EXPERTS_PER_GROUP_SCORE = 2


def group_limited_topk(scores: Tensor, topk: int, num_groups: int, group_topk: int) -> tuple[Tensor, Tensor]:
    """(values, indices) `[n, topk]` of the experts the model chooses from its routing scores `[n, E]`:
    the best `group_topk` groups by the sum of their top-2 scores, then the top-k within them.

    Source: transformers `DeepseekV3TopkRouter.get_topk_indices` (= SGLang `biased_grouped_topk_impl`).
    Experts outside the kept groups are masked with -inf, as transformers 5.x, SGLang and megatron do
    (transformers 4.x and DeepSeek's own code fill 0.0: the same unless a kept expert scores below 0).
    """
    n, experts = scores.shape
    grouped = scores.view(n, num_groups, experts // num_groups)
    group_scores = grouped.topk(EXPERTS_PER_GROUP_SCORE, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    masked = scores.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(n, experts), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


class ModelGroupRule:
    """What megatron's `topk_routing_with_score_function` calls as `router_replay.get_replay_topk`: the
    router's real `RouterReplay` (or none) with the model's group rule in place of megatron's default."""

    def __init__(self, replay: Any = None):
        self.replay = replay

    def get_replay_topk(
        self,
        scores: Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[Tensor, Tensor]:
        def compute(s: Tensor, k: int, num_groups: int | None = None, group_topk: int | None = None):
            if group_topk and num_groups and num_groups > 1:
                return group_limited_topk(s, k, num_groups, group_topk)
            return default_compute_topk(s, k, num_groups, group_topk)

        if self.replay is None:
            return compute(scores, topk, num_groups, group_topk)
        return self.replay.get_replay_topk(scores, topk, num_groups, group_topk, compute)


class GroupScoredRouter(TopKRouter):
    """megatron-core's `TopKRouter` whose group-limited top-k scores a group as the model does."""

    def routing(self, logits: Tensor, padding_mask: Tensor | None = None):
        if self.config.moe_router_fusion:
            # TE's fused kernel hard-codes megatron's group score
            raise RuntimeError("GroupScoredRouter needs moe_router_fusion=False")
        replay = self.router_replay
        # megatron's routing reads the replay object once, as the argument of its top-k function; it is
        # this router's own attribute, restored before anyone else can see it
        self.router_replay = ModelGroupRule(replay)
        try:
            return super().routing(logits, padding_mask)
        finally:
            self.router_replay = replay


def with_model_group_rule(spec: Any) -> Any:
    """Decoder block spec `spec` with every MoE layer's router a `GroupScoredRouter` (in place).

    A layer's `mlp` is a `ModuleSpec` or (megatron-core >= 0.17) a `functools.partial` of `MoELayer`; both
    hold the `MoESubmodules` whose `router` megatron builds. (A pipeline stage may hold no MoE layer; the
    learner's logits test against transformers fails if megatron's layout moves the router elsewhere.)"""
    for layer in spec.layer_specs:
        mlp = getattr(layer.submodules, "mlp", None)
        sub = getattr(mlp, "submodules", None)
        if sub is None and isinstance(mlp, functools.partial):
            sub = mlp.keywords.get("submodules")
        if sub is not None and hasattr(sub, "router"):
            sub.router = GroupScoredRouter
    return spec
