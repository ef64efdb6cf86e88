"""gpt-oss's router (issue 44) against transformers' own `GptOssTopKRouter`, through megatron's routing code
with the config megagrpo derives: a bias on the logits, the top-k logits, then a softmax over the chosen
experts only. The own selection and weights, and under R3/R2 the replayed experts weighted by the learner's
current biased logits (with gradients into the weight and the bias), on several shapes; wrong variants
(no bias, a softmax over all experts, the bias in the selection only) are told apart.

No process group: megatron's `TopKRouter.routing` runs on a router object holding only what it reads, and
the logits are `router_gating_linear`'s (F.linear with the router's bias, fp32)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megagrpo.learner.mesh import MeshConfig
from megagrpo.learner.model import transformer_config_from_arch
from megagrpo.moe import stats
from megagrpo.moe.routers import RouterSlot
from tests.dist._common import TINY_GPT_OSS
from tests.unit.moe._routers import megatron_router, sets

# (experts, top-k): the tiny model's, gpt-oss-20b's and gpt-oss-120b's, and an odd one
SHAPES = {"e8_top2": (8, 2), "e32_top4": (32, 4), "e128_top4": (128, 4), "e16_top3": (16, 3)}
N = 256  # tokens


def _arch(name: str):
    experts, topk = SHAPES[name]
    return dataclasses.replace(TINY_GPT_OSS, num_experts=experts, moe_topk=topk)


def _hf_router(arch, seed: int):
    """transformers' GptOssTopKRouter with random weight and bias (HF initialises both to zero)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(
        hidden_size=arch.hidden_size, num_local_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk
    )
    router = GptOssTopKRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        # large enough to change the selection (checked below)
        router.bias.copy_(torch.randn(arch.num_experts, generator=g))
    return router


def _megatron_router(arch, replay=None):
    return megatron_router(arch, None, replay)  # no correction bias: the logits carry gpt-oss's bias


def _hidden(arch, seed: int) -> torch.Tensor:
    return torch.randn(N, arch.hidden_size, generator=torch.Generator().manual_seed(seed))


_sets = sets


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_own_selection_and_weights_equal_transformers_router(name):
    arch = _arch(name)
    router = _hf_router(arch, seed=1)
    x = _hidden(arch, seed=2)
    with torch.no_grad():
        logits, hf_w, hf_idx = router(x)  # logits include the bias
    cfg = transformer_config_from_arch(arch, MeshConfig(), routing_replay=True)
    assert cfg.add_bias_linear and not cfg.moe_router_pre_softmax  # the router has its bias; top-k first
    own = RouterSlot(SimpleNamespace(config=cfg, expert_bias=None), moe=0).own_topk(logits)
    assert _sets(own) == _sets(hf_idx)
    probs, rmap = _megatron_router(arch).routing(logits.view(N, 1, -1))
    assert _sets(rmap.nonzero()[:, 1].view(N, -1)) == _sets(hf_idx)
    torch.testing.assert_close(probs.gather(1, hf_idx), hf_w, rtol=0, atol=1e-6)
    # the bias decides the selection (so a learner that dropped it would route elsewhere)
    unbiased = F.linear(x, router.weight.detach()).topk(arch.moe_topk, -1).indices
    assert _sets(unbiased) != _sets(hf_idx)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_replay_weights_are_a_softmax_over_the_replayed_biased_logits_with_gradients(name):
    """R3/R2: the sampler's experts combined with the learner's current weights at them: a softmax over
    their biased logits (transformers' formula applied to the replayed set), gradients into the router's
    weight and bias as through that formula."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    arch = _arch(name)
    router = _hf_router(arch, seed=1)
    x = _hidden(arch, seed=2)
    with torch.no_grad():
        _, _, replayed = _hf_router(arch, seed=7)(x)  # the "sampler": other weights, other bias
        _, _, own = router(x)
    assert _sets(replayed) != _sets(own)
    replay = RouterReplay()
    try:
        replay.set_target_indices(replayed)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        w = router.weight.detach().clone().requires_grad_(True)
        b = router.bias.detach().clone().requires_grad_(True)
        probs, rmap = _megatron_router(arch, replay).routing(F.linear(x, w, b).view(N, 1, -1))
    finally:
        RouterReplay.global_router_replay_instances.remove(replay)
    assert _sets(rmap.nonzero()[:, 1].view(N, -1)) == _sets(replayed)
    w_ref = w.detach().clone().requires_grad_(True)
    b_ref = b.detach().clone().requires_grad_(True)
    logits = F.linear(x, w_ref, b_ref)
    want = torch.softmax(logits.gather(1, replayed), -1)  # GptOssTopKRouter.forward at the replayed set
    got = probs.gather(1, replayed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    unbiased = F.linear(x, w_ref)
    for wrong in (
        torch.softmax(unbiased.gather(1, replayed), -1),  # the bias dropped from the weights
        torch.softmax(logits, -1).gather(1, replayed),  # a softmax over all experts
    ):
        assert (got - wrong).abs().max() > 1e-3
    c = torch.randn(N, arch.moe_topk, generator=torch.Generator().manual_seed(3))
    (got * c).sum().backward()
    (want * c).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, b_ref.grad, rtol=1e-5, atol=1e-6)
    # RSPO's r is the model's combine weight at the replayed set: the softmax renormalised over it cancels
    # the all-expert normaliser in log r_theta - log r_old, so log r over all experts differs only by a
    # per-token constant
    logr = stats.router_logp(logits.detach(), replayed, score_function="softmax", renormalize=True)
    shift = (logr - want.detach().log()).std(-1)
    assert shift.max() < 1e-5


def test_a_top1_router_is_refused_by_name():
    """transformers combines a top-1 expert with weight 1 (a softmax over one logit); megatron-core wants
    pre-softmax scores for top-1, which would weight it by its softmax over all experts."""
    from megagrpo.errors import MegagrpoError

    with pytest.raises(MegagrpoError, match="pre-softmax when topk is 1"):
        transformer_config_from_arch(dataclasses.replace(TINY_GPT_OSS, moe_topk=1), MeshConfig())
