"""HF `config.json` <-> `ModelArch` for OpenAI's gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b).

gpt-oss (transformers' `modeling_gpt_oss.py`) is a GQA transformer whose layers alternate sliding-window
(128) and full attention (`layer_types`), with a learned sink logit per head, biases on q, k, v and o, and
YaRN rope with a fractional correction range (`truncate: false`). Every layer is MoE: a router with a
bias, whose top-k logits go through a softmax over the chosen experts only; experts with biases and a
clamped SwiGLU, `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, l)`. The release
ships MXFP4 expert weights (`quantization_config.quant_method: mxfp4`), which change no architecture
field: `hf_io.HFCheckpoint` reads them dequantised, exactly (`bridge/mxfp4.py`). Anything the learner could not reproduce exactly raises a `MegagrpoError` naming the field.
"""

from __future__ import annotations

from typing import Any

from megagrpo.bridge.hf_config_v3 import parse_rope, rope_fields, yarn_fields
from megagrpo.bridge.hf_fields import require, unsupported
from megagrpo.errors import MegagrpoError

# What a field absent from config.json means: transformers 5.x's GptOssConfig defaults (SGLang reads the
# same config object).
GPT_OSS_DEFAULTS: dict[str, Any] = dict(
    num_local_experts=128, num_experts_per_tok=4, head_dim=64, num_attention_heads=64,
    num_key_value_heads=8, sliding_window=128, rms_norm_eps=1e-5, swiglu_alpha=1.702, swiglu_limit=7.0,
    attention_bias=True, hidden_act="silu", max_position_embeddings=131072, tie_word_embeddings=False,
)  # fmt: skip
GPT_OSS_ROPE_DEFAULT = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}  # fmt: skip
LAYER_TYPES = ("full_attention", "sliding_attention")
# quantisations whose weights dequantise exactly to bf16 (E2M1 x 2^E8M0), so the architecture is unchanged
EXACT_QUANT_METHODS = ("mxfp4",)


def default_layer_types(layers: int) -> tuple[str, ...]:
    """GptOssConfig's default: sliding on even layers, full on odd ones."""
    return tuple(LAYER_TYPES[i % 2 == 0] for i in range(layers))


def parse_gpt_oss(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The `ModelArch` fields of a `gpt_oss` config (absent fields: GPT_OSS_DEFAULTS)."""
    cfg = {**GPT_OSS_DEFAULTS, **cfg}
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        cfg["rope_parameters"] = {**GPT_OSS_ROPE_DEFAULT, "rope_theta": cfg.get("rope_theta", 150000.0)}
    quant = cfg.get("quantization_config")
    if quant is not None and (quant or {}).get("quant_method") not in EXACT_QUANT_METHODS:
        raise unsupported(where, "quantization_config.quant_method", (quant or {}).get("quant_method"),
                          f"only {', '.join(EXACT_QUANT_METHODS)} dequantises exactly; use a bf16 checkpoint")  # fmt: skip
    act = cfg.get("hidden_act")
    if act != "silu":
        raise unsupported(where, "hidden_act", act, "gpt-oss's experts use a clamped SwiGLU")
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    layers = int(require(cfg, "num_hidden_layers", where))
    if heads % kv_heads:
        raise MegagrpoError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    layer_types = cfg.get("layer_types")
    layer_types = default_layer_types(layers) if layer_types is None else tuple(layer_types)
    if len(layer_types) != layers or any(t not in LAYER_TYPES for t in layer_types):
        raise unsupported(where, "layer_types", list(layer_types),
                          f"needs one of {LAYER_TYPES} per layer (num_hidden_layers={layers})")  # fmt: skip
    window = cfg.get("sliding_window")
    if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
        raise unsupported(where, "sliding_window", window, "sliding_attention layers need a positive window")
    experts = int(require(cfg, "num_local_experts", where))
    topk = int(require(cfg, "num_experts_per_tok", where))
    if topk > experts:
        raise MegagrpoError(f"{where}: num_experts_per_tok={topk} > num_local_experts={experts}")
    limit = float(require(cfg, "swiglu_limit", where))
    if limit <= 0:
        raise unsupported(where, "swiglu_limit", limit, "gpt-oss's SwiGLU clamps at a positive limit")
    bias = bool(cfg.get("attention_bias"))
    ffn = int(require(cfg, "intermediate_size", where))
    rope = parse_rope(cfg, where, yarn=True, partial=False, fractional_yarn=True)
    return dict(
        family="gpt_oss",
        vocab_size=int(require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=ffn,
        max_position_embeddings=int(require(cfg, "max_position_embeddings", where)),
        norm_eps=float(cfg.get("rms_norm_eps")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings")),
        qkv_bias=bias,
        attn_out_bias=bias,
        attention_sinks=True,
        layer_types=layer_types,
        sliding_window=int(window) if "sliding_attention" in layer_types else 0,
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=ffn,
        moe_renormalize_topk=True,  # softmax over the top-k logits only
        moe_router_bias=True,
        moe_expert_bias=True,
        swiglu_alpha=float(require(cfg, "swiglu_alpha", where)),
        swiglu_limit=limit,
        swiglu_up_offset=1.0,
        **rope,
    )


def hf_fields_gpt_oss(arch: Any) -> dict[str, Any]:
    """The config.json fields of a `gpt_oss` arch beyond those every family writes (the inverse of
    `parse_gpt_oss`, with `hf_config.hf_config_from_arch`)."""
    if arch.moe_layer_pattern and not all(arch.moe_layer_pattern):
        raise MegagrpoError(f"gpt_oss: every layer is MoE, got moe_layer_pattern={arch.moe_layer_pattern}")
    if arch.qkv_bias != arch.attn_out_bias:
        raise MegagrpoError("gpt_oss: attention_bias covers q, k, v and o together")
    rope: dict[str, Any] = {"rope_theta": arch.rope_theta, "rope_type": arch.rope_type}
    if arch.rope_type == "yarn":
        rope.update(yarn_fields(arch))
    kw: dict[str, Any] = dict(
        num_local_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_topk,
        attention_bias=arch.qkv_bias,
        layer_types=list(arch.layer_types),
        sliding_window=arch.sliding_window or None,
        swiglu_alpha=arch.swiglu_alpha,
        swiglu_limit=arch.swiglu_limit,
    )
    kw.update(rope_fields(rope))
    return kw
