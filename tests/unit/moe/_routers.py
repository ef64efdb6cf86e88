"""megatron's `TopKRouter.routing` without a process group: a router object holding only what it reads,
configured as the learner configures it for an arch (shared by the router tests of every family)."""

from __future__ import annotations

import torch

from megagrpo.learner.mesh import MeshConfig
from megagrpo.learner.model import transformer_config_from_arch


def megatron_router(arch, bias: torch.Tensor | None = None, replay=None):
    """The learner's router class for `arch` (the group-scored one with groups), `bias` its correction
    bias (None: a router without one), `replay` a RouterReplay or None."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megagrpo.moe.group_topk import GroupScoredRouter

    cfg = transformer_config_from_arch(arch, MeshConfig(), routing_replay=True)
    cls = GroupScoredRouter if arch.moe_router_num_groups > 1 else TopKRouter  # as learner.model builds it
    r = cls.__new__(cls)
    torch.nn.Module.__init__(r)
    r.config, r.topk, r.score_function = cfg, cfg.moe_router_topk, cfg.moe_router_score_function
    r.routing_type, r.router_replay = cfg.moe_router_load_balancing_type, replay
    r.enable_expert_bias, r.expert_bias = cfg.moe_router_enable_expert_bias, bias
    r.local_tokens_per_expert = torch.zeros(arch.num_experts)
    r.eval()
    return r


def sets(idx: torch.Tensor) -> list[list[int]]:
    """Each token's chosen experts as a sorted list (the order top-k returns them in does not matter)."""
    return idx.sort(-1).values.tolist()
