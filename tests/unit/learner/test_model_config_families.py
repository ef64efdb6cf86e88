"""The learner's megatron config read off the router and attention description (no process group)."""

from __future__ import annotations

import dataclasses

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.learner.mesh import MeshConfig
from megagrpo.learner.model import transformer_config_from_arch
from tests.dist._common import TINY_DEEPSEEK_V3, TINY_GLM4_MOE


def test_deepseek_v3_router_and_mla():
    c = transformer_config_from_arch(TINY_DEEPSEEK_V3, MeshConfig())
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_bias_update_rate == 0.0  # the correction bias stays frozen during RL
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert c.moe_shared_expert_intermediate_size == 32 and c.moe_layer_freq == [0, 1, 1, 1]
    assert c.multi_latent_attention and (c.q_lora_rank, c.kv_lora_rank) == (32, 16)
    assert (c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (16, 8, 16)
    assert (c.rope_type, c.rotary_scaling_factor, c.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert (c.mscale, c.mscale_all_dim) == (1.0, 1.0)


def test_glm4_moe_keeps_gqa():
    c = transformer_config_from_arch(TINY_GLM4_MOE, MeshConfig())
    assert not c.multi_latent_attention and c.add_qkv_bias and c.qk_layernorm
    assert c.moe_router_enable_expert_bias and c.moe_router_bias_update_rate == 0.0


def test_uneven_pipeline_stages_reach_megatron():
    """Issue 37 section 4: a layer count PP does not divide builds with the first/last stage counts set,
    and megatron's own offsets follow them (the bridge and the routers number layers by these)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    five = dataclasses.replace(TINY_DEEPSEEK_V3, num_layers=5)
    with pytest.raises(MegagrpoError, match="mesh.first_stage_layers and/or mesh.last_stage_layers"):
        transformer_config_from_arch(five, MeshConfig(pp=2))
    c = transformer_config_from_arch(five, MeshConfig(pp=2, first_stage_layers=2))
    assert (c.num_layers_in_first_pipeline_stage, c.num_layers_in_last_pipeline_stage) == (2, None)
    assert [get_num_layers_to_build(c, pp_rank=r) for r in (0, 1)] == [2, 3]
    assert [get_transformer_layer_offset(c, pp_rank=r) for r in (0, 1)] == [0, 2]
    with pytest.raises(MegagrpoError, match="do not add up"):
        transformer_config_from_arch(five, MeshConfig(pp=2, first_stage_layers=2, last_stage_layers=2))


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(moe_renormalize_topk=False), "always renormalised"),
        (dict(moe_router_num_groups=3), "moe_router_num_groups=3"),
        (dict(num_kv_heads=2), "num_kv_heads == num_attention_heads"),
        # issue 43: these passed every check, then combined unlike transformers / crashed the first forward
        (dict(moe_topk=1), "moe_topk=1 combines its expert with weight 1"),
        (dict(v_head_dim=32), "v_head_dim=32 is wider than the query head"),  # 16 + 8 = 24
    ],
)
def test_unreproducible_descriptions_are_refused(change, words):
    with pytest.raises(MegagrpoError, match=words):
        transformer_config_from_arch(dataclasses.replace(TINY_DEEPSEEK_V3, **change), MeshConfig())


def test_mla_without_a_q_latent_has_a_plain_q_projection_and_the_kv_norm():
    """q_lora_rank null (Moonlight): megatron's MLA norm resolver, without Transformer Engine, refused the
    local spec (a q norm it would not use, or no fused norm+linear q projection), so `megagrpo train` failed
    at build; the learner's MLA resolves a plain q projection and keeps the kv latent's norm."""
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from megagrpo.learner.attention import local_mla_self_attention

    c = transformer_config_from_arch(dataclasses.replace(TINY_DEEPSEEK_V3, q_lora_rank=None), MeshConfig())
    assert c.q_lora_rank is None and c.qk_layernorm
    spec = get_gpt_decoder_block_spec(c, use_transformer_engine=False, normalization="RMSNorm", pp_rank=0)
    sub = spec.layer_specs[0].submodules.self_attention.submodules
    got = local_mla_self_attention()._resolve_qk_norm_config(types.SimpleNamespace(config=c), sub)
    assert got["linear_q_proj"] is sub.linear_q_proj and got["q_layernorm"] is IdentityOp
    assert got["kv_layernorm"] is sub.kv_layernorm and sub.kv_layernorm is not IdentityOp
    assert got["linear_kv_up_proj"] is sub.linear_kv_up_proj


def test_yarn_without_mla_is_refused():
    with pytest.raises(MegagrpoError, match="YaRN"):
        transformer_config_from_arch(dataclasses.replace(TINY_GLM4_MOE, rope_type="yarn"), MeshConfig())


def test_router_bias_update_rate_reaches_megatron_from_the_config():
    """model.router_bias_update_rate (default 0: frozen) becomes megatron's expert-bias update rate; a
    model without a correction bias refuses a non-zero rate by the field's name."""
    from megagrpo.config.schema import Config
    from megagrpo.trainer.components import learner_config

    cfg = Config.model_validate({"model": {"hf_path": "m"}})
    assert cfg.model.router_bias_update_rate == 0.0 and learner_config(cfg).router_bias_update_rate == 0.0
    cfg = Config.model_validate({"model": {"hf_path": "m", "router_bias_update_rate": 1e-3}})
    rate = learner_config(cfg).router_bias_update_rate
    c = transformer_config_from_arch(TINY_GLM4_MOE, MeshConfig(), router_bias_update_rate=rate)
    assert c.moe_router_enable_expert_bias and c.moe_router_bias_update_rate == 1e-3
    no_bias = dataclasses.replace(TINY_GLM4_MOE, moe_router_expert_bias=False)
    with pytest.raises(MegagrpoError, match="model.router_bias_update_rate"):
        transformer_config_from_arch(no_bias, MeshConfig(), router_bias_update_rate=1e-3)
