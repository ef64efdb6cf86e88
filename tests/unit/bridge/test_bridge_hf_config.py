"""HF config.json <-> ModelArch: what the tiny transformers models say, and what is refused by name."""

from __future__ import annotations

import json

import pytest

from megagrpo.bridge.hf_config import arch_from_hf, hf_config_from_arch
from megagrpo.errors import MegagrpoError

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def _config(tiny_model, arch: str, **kw) -> dict:
    return json.loads((tiny_model(arch, **kw) / "config.json").read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_from_saved_config(tiny_model, arch):
    a = arch_from_hf(tiny_model(arch))
    assert (a.family, a.hidden_size, a.num_layers, a.num_attention_heads, a.num_kv_heads, a.head_dim) == (
        arch,
        64,
        2,
        4,
        2,
        16,
    )
    assert a.rope_theta == 10000.0 and a.norm_eps == 1e-6 and a.vocab_size == 1024
    assert a.qk_norm == (arch in ("qwen3", "qwen3_moe"))
    assert a.qkv_bias == (arch == "qwen2")
    if arch in ("qwen3_moe", "mixtral"):
        assert (a.num_experts, a.moe_topk) == (8, 2)
        assert a.moe_ffn_hidden_size == (64 if arch == "qwen3_moe" else 128)
    else:
        assert not a.is_moe


@pytest.mark.parametrize("arch", ARCHS)
def test_export_config_maps_back(tiny_model, arch):
    base = _config(tiny_model, arch)
    a = arch_from_hf(base)
    out = hf_config_from_arch(a, base=base)
    assert arch_from_hf(out) == a
    assert out["eos_token_id"] == base["eos_token_id"] and out["model_type"] == arch
    assert arch_from_hf(hf_config_from_arch(a)) == a  # without a base config too


def test_legacy_rope_theta_and_tied(tiny_model):
    cfg = _config(tiny_model, "llama", tie=True)
    del cfg["rope_parameters"]
    cfg.update(rope_theta=500000.0, rope_scaling=None)
    a = arch_from_hf(cfg)
    assert a.rope_theta == 500000.0 and a.tie_embeddings


def test_qwen3_moe_dense_layers(tiny_model):
    cfg = _config(tiny_model, "qwen3_moe")
    cfg.update(mlp_only_layers=[0])
    assert arch_from_hf(cfg).moe_layers() == [1]


@pytest.mark.parametrize(
    ("arch", "change", "field"),
    [
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type",
        ),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 128}, "use_sliding_window"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window"),
        ("llama", {"model_type": "gpt2"}, "model_type"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ("llama", {"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_fields_are_named(tiny_model, arch, change, field):
    cfg = _config(tiny_model, arch)
    cfg.update(change)
    with pytest.raises(MegagrpoError, match=field):
        arch_from_hf(cfg)


def test_legacy_rope_scaling_refused(tiny_model):
    cfg = _config(tiny_model, "llama")
    del cfg["rope_parameters"]
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(MegagrpoError, match="rope_scaling"):
        arch_from_hf(cfg)


def test_missing_config_file(tmp_path):
    with pytest.raises(MegagrpoError, match="config.json"):
        arch_from_hf(tmp_path)
