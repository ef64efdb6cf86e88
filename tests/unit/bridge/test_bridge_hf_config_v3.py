"""deepseek_v3 / glm4_moe config.json <-> ModelArch: the public checkpoints' configs, the tiny models, and
every field the learner could not reproduce refused by name."""

from __future__ import annotations

import json
import logging

import pytest

from megagrpo.bridge.hf_config import arch_from_hf, hf_config_from_arch
from megagrpo.errors import MegagrpoError

_YARN = {
    "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn",
}  # fmt: skip
# The public config.json files (weights not needed), as their repositories ship them.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": _YARN, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.46.3",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827, "vocab_size": 163840, "max_position_embeddings": 131072,
    "rope_scaling": {**_YARN, "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0},
}  # fmt: skip
MOONLIGHT = {
    **DEEPSEEK_V3, "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264,
    "kv_lora_rank": 512, "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None,
    "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "topk_group": 1,
    "vocab_size": 163840,
}  # fmt: skip
GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536, "n_group": 1,
    "n_routed_experts": 160, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
    "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "4.54.0",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 151552, "first_k_dense_replace": 3,
}  # fmt: skip
GLM45_AIR = {
    **GLM45, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_routed_experts": 128, "num_hidden_layers": 46, "use_qk_norm": False, "first_k_dense_replace": 1,
}  # fmt: skip
PUBLIC = {
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": KIMI_K2,
    "moonlight": MOONLIGHT,
    "glm45": GLM45,
    "glm45_air": GLM45_AIR,
}


def test_deepseek_v3_public_config():
    a = arch_from_hf(DEEPSEEK_V3)
    assert a.is_mla and (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (
        1536, 512, 128, 64, 128,
    )  # fmt: skip
    assert (a.rope_type, a.rope_scaling_factor, a.rope_original_max_position_embeddings) == (
        "yarn",
        40.0,
        4096,
    )
    assert (a.rope_beta_fast, a.rope_beta_slow, a.rope_mscale, a.rope_mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)
    assert a.moe_router_score_function == "sigmoid" and a.moe_router_expert_bias
    assert (a.moe_router_num_groups, a.moe_router_group_topk, a.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert (a.num_experts, a.moe_topk, a.moe_shared_expert_ffn_hidden_size) == (256, 8, 2048)
    assert a.moe_layers() == list(range(3, 61)) and a.ffn_hidden_size == 18432 and a.mtp_layers == 1


def test_moonlight_full_q_projection_and_no_rope_scaling():
    a = arch_from_hf(MOONLIGHT)
    assert a.q_lora_rank is None and a.rope_type == "default" and a.moe_router_num_groups == 1
    assert a.moe_shared_expert_ffn_hidden_size == 2 * 1408 and a.moe_topk == 6


def test_glm45_and_air():
    a = arch_from_hf(GLM45)
    assert not a.is_mla and a.rotary_percent == 0.5 and a.qkv_bias and a.qk_norm and a.head_dim == 128
    assert (a.num_kv_heads, a.moe_router_topk_scaling_factor, a.moe_layers()[0]) == (8, 2.5, 3)
    air = arch_from_hf(GLM45_AIR)
    assert not air.qk_norm and air.moe_layers()[0] == 1


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_configs_map_back(name):
    a = arch_from_hf(PUBLIC[name])
    out = hf_config_from_arch(a, base=PUBLIC[name])
    assert arch_from_hf(out) == a and out["eos_token_id"] == PUBLIC[name]["eos_token_id"]
    assert arch_from_hf(hf_config_from_arch(a)) == a


def test_transformers_reads_the_exported_config_as_the_arch():
    from transformers import AutoConfig

    for name in ("deepseek_v3", "moonlight", "glm45"):
        a = arch_from_hf(PUBLIC[name])
        cfg = AutoConfig.for_model(
            a.family, **{k: v for k, v in hf_config_from_arch(a).items() if k != "model_type"}
        )
        assert arch_from_hf(cfg.to_dict()) == a, name


def test_multi_token_prediction_layers_said_at_load(caplog):
    with caplog.at_level(logging.WARNING, logger="megagrpo.bridge.hf_config_v3"):
        arch_from_hf(DEEPSEEK_V3)
    assert "num_nextn_predict_layers=1" in caplog.text and "not trained" in caplog.text


@pytest.mark.parametrize(
    "base,change,field",
    [
        (DEEPSEEK_V3, {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (DEEPSEEK_V3, {"rope_interleave": False}, "rope_interleave"),
        (DEEPSEEK_V3, {"norm_topk_prob": False}, "norm_topk_prob"),
        (DEEPSEEK_V3, {"n_group": 256, "topk_group": 8}, "n_group"),  # groups of 1: no top-2 group score
        (DEEPSEEK_V3, {"topk_group": 1, "num_experts_per_tok": 33}, "num_experts_per_tok"),  # > 32 kept
        (DEEPSEEK_V3, {"num_experts_per_tok": 1}, "norm_topk_prob"),  # HF's weight 1, megatron's score
        (DEEPSEEK_V3, {"v_head_dim": 256}, "v_head_dim"),  # wider than the 192-wide query head
        (DEEPSEEK_V3, {"n_group": 7}, "n_group"),
        (DEEPSEEK_V3, {"scoring_func": "softmax"}, "scoring_func"),
        (DEEPSEEK_V3, {"topk_method": "greedy"}, "topk_method"),
        (DEEPSEEK_V3, {"attention_bias": True}, "attention_bias"),
        (DEEPSEEK_V3, {"num_key_value_heads": 8}, "num_key_value_heads"),
        (DEEPSEEK_V3, {"moe_layer_freq": 2}, "moe_layer_freq"),
        (DEEPSEEK_V3, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
        (DEEPSEEK_V3, {"rope_scaling": {**_YARN, "attention_factor": 0.5}}, "attention_factor"),
        (DEEPSEEK_V3, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (DEEPSEEK_V3, {"rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0}}, "mscale"),
        (DEEPSEEK_V3, {"rope_scaling": {**_YARN, "mscale": 0}}, "mscale"),
        (DEEPSEEK_V3, {"hidden_act": "gelu"}, "hidden_act"),
        (GLM45, {"rope_scaling": _YARN}, "rope_scaling.type"),
        (GLM45, {"first_k_dense_replace": 92}, "first_k_dense_replace"),
    ],
)
def test_unreproducible_fields_are_named(base, change, field):
    with pytest.raises(MegagrpoError, match=field):
        arch_from_hf({**base, **change})


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_tiny_models_have_the_router_the_issue_asks_for(tiny_model, arch):
    d = tiny_model(arch, layers=3)
    a = arch_from_hf(d)
    assert a.moe_router_num_groups > 1 and a.moe_router_expert_bias
    assert a.moe_shared_expert_ffn_hidden_size > 0 and a.moe_layer_pattern[0] == 0
    assert a.is_mla == (arch == "deepseek_v3") and (a.rope_type == "yarn") == (arch == "deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    assert arch_from_hf(hf_config_from_arch(a, base=cfg)) == a


def test_kimi_k2_is_deepseek_v3_under_its_published_name():
    a = arch_from_hf(KIMI_K2)
    assert a.family == "deepseek_v3" and a == arch_from_hf({**KIMI_K2, "model_type": "deepseek_v3"})
    # the export keeps the published name and classes (its auto_map names a kimi_k2 configuration class)
    out = hf_config_from_arch(a, base=KIMI_K2)
    assert (out["model_type"], out["architectures"], out["auto_map"]) == (
        "kimi_k2",
        ["DeepseekV3ForCausalLM"],
        KIMI_K2["auto_map"],
    )
    assert hf_config_from_arch(a)["model_type"] == "deepseek_v3"  # no source: the family's own name
    # an alias of another family is not taken over by this one
    glm = arch_from_hf(GLM45)
    assert hf_config_from_arch(glm, base={**GLM45, "model_type": "kimi_k2"})["model_type"] == "glm4_moe"
    with pytest.raises(MegagrpoError, match=r"model_type='kimi_k3'.*aliases kimi_k2 \(as deepseek_v3\)"):
        arch_from_hf({**KIMI_K2, "model_type": "kimi_k3"})


def test_the_shipped_kimi_k2_config_is_the_published_one():
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "configs" / "models" / "Kimi-K2" / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert arch_from_hf(path) == arch_from_hf(KIMI_K2)


def _released_v3_configs() -> dict[str, dict]:
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "configs" / "models"
    out = {}
    for path in sorted(root.glob("*/config.json")):
        cfg = json.loads(path.read_text())
        if cfg["model_type"] in ("deepseek_v3", "kimi_k2", "glm4_moe"):
            out[path.parent.name] = cfg
    return out


RELEASED_V3 = _released_v3_configs()
# every field whose absence the parser fills (the issue's list and the rest the two config classes default)
ABSENT = (
    "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob",
    "n_shared_experts", "rms_norm_eps", "attention_bias", "moe_intermediate_size", "n_routed_experts",
)  # fmt: skip
# per family: DeepseekV3Config's num_key_value_heads default (128) is read by no MLA code (SGLang's MLA and
# transformers' keep one key per query head), so an absent one stays num_attention_heads
ABSENT_FAMILY = {
    "glm4_moe": ("partial_rotary_factor", "num_key_value_heads", "use_qk_norm"),
    "deepseek_v3": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
}
ABSENT_CASES = [
    (name, field)
    for name, cfg in sorted(RELEASED_V3.items())
    for field in ABSENT + ABSENT_FAMILY["glm4_moe" if cfg["model_type"] == "glm4_moe" else "deepseek_v3"]
]


def _transformers_config(cfg: dict):
    """transformers' own config object for `cfg` (Kimi-K2 is its DeepseekV3Config under another name)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig

    cls = Glm4MoeConfig if cfg["model_type"] == "glm4_moe" else DeepseekV3Config
    return cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})


@pytest.mark.parametrize("name,field", ABSENT_CASES)
def test_an_absent_field_means_what_transformers_reads(name, field):
    """A released config without `field` parses as transformers completes it (its config class's default,
    which SGLang reads too): the arch of the config with the field left out equals the arch of the config
    transformers fills in, and the router fields equal the attributes transformers' model code reads."""
    cfg = {k: v for k, v in RELEASED_V3[name].items() if k != field}
    ref = _transformers_config(cfg)
    full = {**cfg, field: getattr(ref, field) if field != "partial_rotary_factor" else None}
    full["partial_rotary_factor"] = ref.rope_parameters.get("partial_rotary_factor", 1.0)
    try:
        want = arch_from_hf(full)
    except MegagrpoError as e:  # the completed config is one megatron cannot compute: so is the absent one
        with pytest.raises(MegagrpoError, match=str(e).split("(")[0].split(": ", 1)[1]):
            arch_from_hf(cfg)
        return
    got = arch_from_hf(cfg)
    assert got == want
    assert (got.moe_router_num_groups, got.moe_router_group_topk) == (ref.n_group, ref.topk_group)
    assert got.moe_router_topk_scaling_factor == ref.routed_scaling_factor
    assert got.moe_layer_pattern.index(1) == ref.first_k_dense_replace
    assert got.norm_eps == ref.rms_norm_eps
    assert got.rotary_percent == ref.rope_parameters.get("partial_rotary_factor", 1.0)


def test_the_defaults_the_issue_names_are_transformers():
    """The fields the issue found parsed unlike transformers, checked by value (the test above would pass
    on a table that agreed with itself; this one says what transformers' classes default to)."""
    glm = {k: v for k, v in GLM45_AIR.items() if k not in ("partial_rotary_factor", "first_k_dense_replace")}
    a = arch_from_hf(glm)
    assert (a.rotary_percent, a.moe_layer_pattern[:2]) == (0.5, (0, 1))
    drop = ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace")
    v3 = arch_from_hf({k: v for k, v in DEEPSEEK_V3.items() if k not in drop})
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk, v3.moe_router_topk_scaling_factor) == (
        8,
        4,
        2.5,
    )
    assert v3.moe_layer_pattern[:4] == (0, 0, 0, 1)


@pytest.mark.parametrize("beta", [None, 0])
def test_a_null_yarn_beta_is_transformers_default(beta):
    """transformers' YaRN reads `beta_fast or 32`, `beta_slow or 1`: null is the default, not 0."""
    for key, default in (("beta_fast", 32), ("beta_slow", 1)):
        a = arch_from_hf({**DEEPSEEK_V3, "rope_scaling": {**_YARN, key: beta}})
        assert a == arch_from_hf({**DEEPSEEK_V3, "rope_scaling": {**_YARN, key: default}})


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2", "glm45"])
def test_the_export_writes_legacy_rope_fields_too(name):
    """Every loader keeps the rope: transformers >= 5 reads rope_parameters, 4.x and DeepSeek's own code
    rope_theta / rope_scaling["type"]; both say the same, and YaRN survives a legacy-only reader."""
    a = arch_from_hf(PUBLIC[name])
    out = hf_config_from_arch(a, base=PUBLIC[name])
    assert out["rope_theta"] == out["rope_parameters"]["rope_theta"] == a.rope_theta
    legacy = {k: v for k, v in out.items() if k != "rope_parameters"}
    assert arch_from_hf(legacy) == a
    if a.rope_type == "yarn":
        assert (
            out["rope_scaling"]["type"] == "yarn" and out["rope_scaling"]["factor"] == a.rope_scaling_factor
        )
    else:
        assert out.get("rope_scaling") is None
