"""The sigmoid, bias-corrected, group-limited routers of DeepSeek-V3 and GLM-4.5 against transformers' own
gates (DeepseekV3TopkRouter, Glm4MoeTopkRouter), through megatron's routing code with the config megagrpo
derives: the own selection, the weights under replay (and their gradients), and RSPO's log r.

No process group: megatron's `TopKRouter.routing` runs on a router object holding only what it reads."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megagrpo.learner.mesh import MeshConfig
from megagrpo.learner.model import transformer_config_from_arch
from megagrpo.moe import stats
from megagrpo.moe.routers import RouterSlot
from tests.dist._common import TINY_DEEPSEEK_V3, TINY_GLM4_MOE
from tests.unit.moe._routers import megatron_router, sets

# DeepSeek-V3's own shape in small: 4 groups of 4, the best 2 kept, top-4 (a group scored by its top 2)
WIDE_V3 = dataclasses.replace(
    TINY_DEEPSEEK_V3, num_experts=16, moe_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
    moe_router_topk_scaling_factor=1.8,
)  # fmt: skip


def _grouped(experts: int, groups: int, group_topk: int, topk: int):
    return dataclasses.replace(
        WIDE_V3,
        num_experts=experts,
        moe_topk=topk,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
    )


# (n_group, topk_group, top_k) whose top_k / topk_group is not 2: megatron's own group score (the sum of a
# group's top top_k / topk_group experts) is not the model's (the sum of its top 2)
GROUP_SHAPES = {
    "g4_k2_top6": _grouped(16, 4, 2, 6),  # the shape: groups scored by their top 3 in megatron
    "g8_k3_top4": _grouped(32, 8, 3, 4),  # top 1
    "g4_k1_top3": _grouped(16, 4, 1, 3),  # top 3
    "g2_k1_top8": _grouped(16, 2, 1, 8),  # top 8 = every expert of a group
}
ARCHS = {
    "deepseek_v3": TINY_DEEPSEEK_V3, "glm4_moe": TINY_GLM4_MOE, "deepseek_v3_wide": WIDE_V3, **GROUP_SHAPES,
}  # fmt: skip
N = 256  # tokens


def _hf_gate(arch, seed: int):
    """transformers' gate of the arch's family, with random weights and a random correction bias."""
    if arch.family == "glm4_moe":
        from transformers import Glm4MoeConfig as Cfg
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Gate
    else:
        from transformers import DeepseekV3Config as Cfg
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Gate
    cfg = Cfg(
        hidden_size=arch.hidden_size, n_routed_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk,
        n_group=arch.moe_router_num_groups, topk_group=arch.moe_router_group_topk, norm_topk_prob=True,
        routed_scaling_factor=arch.moe_router_topk_scaling_factor,
    )  # fmt: skip
    gate = Gate(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.3)
        # large enough to change the selection (checked below), as DeepSeek-V3's trained biases do
        gate.e_score_correction_bias.copy_(torch.randn(arch.num_experts, generator=g) * 0.1)
    return gate


def _megatron_router(arch, bias: torch.Tensor, replay=None):
    return megatron_router(arch, bias, replay)


def _hidden(arch, seed: int) -> torch.Tensor:
    return torch.randn(N, arch.hidden_size, generator=torch.Generator().manual_seed(seed))


_sets = sets


def _reference_weights(scores: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' combine weights (DeepseekV3TopkRouter.forward's last lines) at given experts: the
    unbiased sigmoid scores gathered, renormalised (norm_topk_prob), scaled (routed_scaling_factor)."""
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_own_selection_and_weights_equal_transformers_gate(name):
    arch = ARCHS[name]
    gate = _hf_gate(arch, seed=1)
    x = _hidden(arch, seed=2)
    with torch.no_grad():
        logits, hf_w, hf_idx = gate(x)
    bias = gate.e_score_correction_bias.detach().clone()
    # megagrpo's own top-k (the statistics' selection): megatron's function with the model's description
    cfg = transformer_config_from_arch(arch, MeshConfig(), routing_replay=True)
    own = RouterSlot(SimpleNamespace(config=cfg, expert_bias=bias), moe=0).own_topk(logits)
    assert _sets(own) == _sets(hf_idx)
    # the model's routing: the same experts, weighted as transformers weights them
    probs, rmap = _megatron_router(arch, bias).routing(logits.view(N, 1, -1))
    assert _sets(rmap.nonzero()[:, 1].view(N, -1)) == _sets(hf_idx)
    torch.testing.assert_close(probs.gather(1, hf_idx), hf_w, rtol=0, atol=1e-6)
    # the test can tell: without the bias, or without the group limit, the selection differs
    no_bias = RouterSlot(SimpleNamespace(config=cfg, expert_bias=torch.zeros_like(bias)), 0).own_topk(logits)
    assert _sets(no_bias) != _sets(hf_idx)
    if arch.moe_router_num_groups > 1:
        ungrouped = (logits.sigmoid() + bias).topk(arch.moe_topk, -1).indices
        assert _sets(ungrouped) != _sets(hf_idx)


@pytest.mark.parametrize("name", sorted(GROUP_SHAPES))
def test_megatrons_own_group_score_is_not_the_models(name):
    """What GroupScoredRouter corrects: megatron's `group_limited_topk` (a group scored by its top
    top_k / topk_group experts) chooses other experts than transformers' gate on these shapes, and the
    R2 recording (RouterReplay RECORD) through GroupScoredRouter records transformers' choice."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    arch = GROUP_SHAPES[name]
    gate = _hf_gate(arch, seed=1)
    with torch.no_grad():
        logits, _, hf_idx = gate(_hidden(arch, seed=2))
    bias = gate.e_score_correction_bias.detach().clone()
    _, megatron_idx = topk_routing_with_score_function(
        logits, arch.moe_topk, num_groups=arch.moe_router_num_groups, group_topk=arch.moe_router_group_topk,
        score_function="sigmoid", expert_bias=bias, dense_output=True,
    )  # fmt: skip
    differ = sum(a != b for a, b in zip(_sets(megatron_idx), _sets(hf_idx)))
    assert differ > N // 50, f"{differ} of {N} tokens"
    replay = RouterReplay()
    try:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
        _megatron_router(arch, bias, replay).routing(logits.view(N, 1, -1))
        assert _sets(replay.get_recorded_indices()) == _sets(hf_idx)
    finally:
        RouterReplay.global_router_replay_instances.remove(replay)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_replay_weights_are_current_unbiased_scores_with_gradients(name):
    """R3/R2: the replayed experts (a sampler's, not the learner's own choice) combined with the learner's
    current sigmoid scores at them, without the bias, renormalised and scaled; gradients flow through them
    into the router weight exactly as through transformers' formula."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    arch = ARCHS[name]
    gate = _hf_gate(arch, seed=1)
    x = _hidden(arch, seed=2)
    with torch.no_grad():
        _, _, replayed = _hf_gate(arch, seed=7)(x)  # the "sampler": other weights, other bias
        _, _, own = gate(x)
    assert _sets(replayed) != _sets(own)
    bias = gate.e_score_correction_bias.detach().clone()
    replay = RouterReplay()
    try:
        replay.set_target_indices(replayed)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        w = gate.weight.detach().clone().requires_grad_(True)
        probs, rmap = _megatron_router(arch, bias, replay).routing(F.linear(x, w).view(N, 1, -1))
    finally:
        RouterReplay.global_router_replay_instances.remove(replay)
    assert _sets(rmap.nonzero()[:, 1].view(N, -1)) == _sets(replayed)
    w_ref = w.detach().clone().requires_grad_(True)
    scores = F.linear(x, w_ref).sigmoid()
    scale = arch.moe_router_topk_scaling_factor
    want = _reference_weights(scores, replayed, scale)
    got = probs.gather(1, replayed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # wrong variants are told apart: the bias in the weights, softmax scores, or no renormalisation
    for wrong in (
        _reference_weights(scores + bias, replayed, scale),
        torch.softmax(F.linear(x, w_ref), -1).gather(1, replayed) * scale,
        scores.gather(1, replayed) * scale,
    ):
        assert (got - wrong).abs().max() > 1e-3
    c = torch.randn(N, arch.moe_topk, generator=torch.Generator().manual_seed(3))
    (got * c).sum().backward()
    (want * c).sum().backward()
    assert w.grad.abs().max() > 1e-3  # the router weight learns through the replayed combine weights
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_rspo_log_r_is_the_models_combine_weight(name):
    """RSPO's r for a sigmoid router (stats.router_logp) is the weight the model combines e_k with, over the
    scaling factor: log of transformers' topk_weights / routed_scaling_factor."""
    arch = ARCHS[name]
    gate = _hf_gate(arch, seed=1)
    with torch.no_grad():
        logits, hf_w, hf_idx = gate(_hidden(arch, seed=2))
    lr = stats.router_logp(logits[:, None], hf_idx[:, None], score_function="sigmoid", renormalize=True)
    want = (hf_w / arch.moe_router_topk_scaling_factor).log()
    torch.testing.assert_close(lr[:, 0], want, rtol=0, atol=1e-5)


def _logit(p: torch.Tensor) -> torch.Tensor:
    return p.log() - (-p).log1p()


def test_rspo_gamma_on_sigmoid_router_sees_only_what_changes_the_model():
    """Scores of the old experts all scaled by one factor leave the model's weights, hence every logprob
    under replay, unchanged: gamma = 1 (the per-expert sigmoid score would call it a shift). A change of
    their ratio gives the hand value exp(-(1/K) sum_k |d log w_k|)."""
    z_old = torch.tensor([[[0.4, -1.0, 2.0, 0.1]]])  # [n=1, L=1, E=4]
    routes = torch.tensor([[[0, 2]]])
    s = z_old.sigmoid()
    z_same = z_old.clone()
    z_same[..., [0, 2]] = _logit(0.5 * s[..., [0, 2]])  # both chosen scores halved, the rest anything
    z_same[..., 1] = 3.0
    mask = torch.ones(1, dtype=torch.bool)

    def gamma(z_new, renormalize=True):
        new = stats.router_logp(z_new, routes, score_function="sigmoid", renormalize=renormalize)
        old = stats.router_logp(z_old, routes, score_function="sigmoid", renormalize=renormalize)
        return stats.router_shift_from_logp(new, old, mask, gamma_min=0.0).gamma_mean

    assert gamma(z_same) == pytest.approx(1.0, abs=1e-6)
    assert gamma(z_same, renormalize=False) < 0.7  # the per-expert score moved by log 2 at both
    z_new = z_old.clone()
    z_new[..., 0] = _logit(torch.tensor(0.3))  # s0 0.599 -> 0.3, s2 unchanged
    w_old = s[0, 0, [0, 2]] / s[0, 0, [0, 2]].sum()
    s_new = z_new.sigmoid()[0, 0, [0, 2]]
    w_new = s_new / s_new.sum()
    want = math.exp(-float((w_new.log() - w_old.log()).abs().mean()))
    assert gamma(z_new) == pytest.approx(want, rel=1e-6)
    # top-1: the renormalised weight is always 1, so r is the score megatron combines with
    one = stats.router_logp(z_old, routes[..., :1], score_function="sigmoid", renormalize=True)
    assert float(one) == pytest.approx(math.log(float(s[0, 0, 0])), rel=1e-6)


def test_router_logp_refuses_an_unknown_score_function():
    with pytest.raises(ValueError, match="score_function"):
        stats.router_logp(
            torch.zeros(1, 1, 4),
            torch.zeros(1, 1, 2, dtype=torch.int64),
            score_function="sqrtsoftplus",
            renormalize=True,
        )
