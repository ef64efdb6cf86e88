"""Hugging Face `config.json` <-> `ModelArch`.

Only what the parameter maps and the learner can reproduce exactly is accepted. Anything else (rope
scaling, sliding windows, biases megatron's local spec has no slot for, unknown model types) raises a
`MegagrpoError` naming the field, because silently ignoring it would give a model that computes
something other than the checkpoint it came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megagrpo.bridge.hf_config_oss import hf_fields_gpt_oss, parse_gpt_oss
from megagrpo.bridge.hf_config_v3 import V3_FAMILIES, hf_fields_v3, parse_rope, parse_v3_family, rope_fields
from megagrpo.bridge.hf_fields import require, unsupported
from megagrpo.config.model import FAMILIES, MODEL_TYPE_ALIASES, ModelArch
from megagrpo.errors import MegagrpoError

# HF architectures class written into an exported config.json, per family.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def load_hf_config(config: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    """Return (config dict, where it came from) for a dict, a model directory or a config.json path."""
    if isinstance(config, dict):
        return dict(config), "config"
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MegagrpoError(
            f"{path}: no such file; pass a Hugging Face model directory containing config.json"
        )
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as e:
        raise MegagrpoError(f"{path}: not valid JSON ({e}); restore the model's config.json") from e


def _reject(cond: bool, where: str, field: str, value: Any, why: str) -> None:
    if cond:
        raise unsupported(where, field, value, why)


def arch_from_hf(config: dict[str, Any] | str | Path) -> ModelArch:
    """Derive the framework-free `ModelArch` from a HF config (dict, model dir or config.json path)."""
    cfg, where = load_hf_config(config)
    model_type = cfg.get("model_type")
    family = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if family not in FAMILIES:
        aliases = ", ".join(f"{a} (as {f})" for a, f in MODEL_TYPE_ALIASES.items())
        raise MegagrpoError(
            f"{where}: model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(FAMILIES)}, and their published aliases {aliases}"
        )
    if family in V3_FAMILIES:
        return ModelArch(**parse_v3_family(cfg, where, family))
    if family == "gpt_oss":
        return ModelArch(**parse_gpt_oss(cfg, where))
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(require(cfg, "num_hidden_layers", where))

    act = cfg.get("hidden_act", "silu")
    _reject(act != "silu", where, "hidden_act", act, "the maps fuse gate/up for SwiGLU only")
    _reject(bool(cfg.get("mlp_bias")), where, "mlp_bias", cfg.get("mlp_bias"), "no MLP bias in the maps")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        sw = cfg.get("use_sliding_window")
        _reject(bool(sw), where, "use_sliding_window", sw, "sliding-window attention is not implemented")
    if family == "mixtral":
        sw = cfg.get("sliding_window")
        _reject(sw is not None, where, "sliding_window", sw, "sliding-window attention is not implemented")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        _reject(True, where, "layer_types", layer_types, "only full attention is implemented")
    attn_bias = bool(cfg.get("attention_bias", False))
    if family == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    else:
        # llama's attention_bias also adds an o_proj bias, which megatron's local spec cannot hold
        _reject(attn_bias, where, "attention_bias", attn_bias, "no o_proj bias slot in megatron's local spec")
        qkv_bias = False

    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=int(require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(require(cfg, "intermediate_size", where)),
        max_position_embeddings=int(require(cfg, "max_position_embeddings", where)),
        rope_theta=parse_rope(cfg, where, yarn=False, partial=False)["rope_theta"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if heads % kv_heads:
        raise MegagrpoError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )

    if family in ("qwen3_moe", "mixtral"):
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise MegagrpoError(f"{where}: required field 'num_local_experts' (or 'num_experts') is missing")
        fields.update(num_experts=int(experts), moe_topk=int(require(cfg, "num_experts_per_tok", where)))
        if family == "mixtral":
            fields.update(moe_ffn_hidden_size=fields["ffn_hidden_size"], moe_renormalize_topk=True)
        else:
            fields.update(
                moe_ffn_hidden_size=int(require(cfg, "moe_intermediate_size", where)),
                moe_renormalize_topk=bool(cfg.get("norm_topk_prob", True)),
            )
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
            if not all(pattern):
                fields["moe_layer_pattern"] = pattern
            if not any(pattern):
                raise MegagrpoError(f"{where}: mlp_only_layers/decoder_sparse_step leave no MoE layer")
        if fields["moe_topk"] > fields["num_experts"]:
            raise MegagrpoError(f"{where}: num_experts_per_tok > number of experts")
    return ModelArch(**fields)


def hf_config_from_arch(
    arch: ModelArch, *, base: dict[str, Any] | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The HF config dict for `arch`, for export.

    With `base` (the original config.json kept next to the checkpoint) its extra fields (token ids,
    initializer range, ...) are preserved; the architecture fields always come from `arch`, and the
    result must map back to `arch`. Fields not written take transformers' defaults on load. (Built as a
    plain dict: importing transformers' config classes after `apply_cpu_compat()` fails, see the report.)
    """
    f = arch.family
    kw: dict[str, Any] = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.ffn_hidden_size,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.norm_eps,
        tie_word_embeddings=arch.tie_embeddings,
        hidden_act="silu",
    )
    if f in V3_FAMILIES:
        kw.update(hf_fields_v3(arch))
        if kw["head_dim"] is None:
            del kw["head_dim"]
        return _finish(arch, kw, base, dtype)
    if f == "gpt_oss":
        kw.update(hf_fields_gpt_oss(arch))
        return _finish(arch, kw, base, dtype)
    if f in ("qwen2", "qwen3", "qwen3_moe"):
        kw["use_sliding_window"] = False
    if f == "qwen3_moe":
        pattern = arch.moe_layer_pattern or (1,) * arch.num_layers
        kw.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.moe_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size,
            norm_topk_prob=arch.moe_renormalize_topk,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, m in enumerate(pattern) if not m],
        )
    if f == "mixtral":
        kw.update(num_local_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk)
    kw.update(rope_fields({"rope_theta": arch.rope_theta, "rope_type": "default"}))
    return _finish(arch, kw, base, dtype)


def exported_config(arch: ModelArch, source_dir: str | Path, *, dtype: str | None = None) -> dict[str, Any]:
    """`hf_config_from_arch` for an export beside `source_dir`: its config.json, when there is one, is the
    base, so the export keeps the source's extra fields, auto_map and published model_type."""
    path = Path(source_dir) / "config.json"
    base = load_hf_config(path)[0] if path.is_file() else None
    return hf_config_from_arch(arch, base=base, dtype=dtype)


def _finish(
    arch: ModelArch, kw: dict[str, Any], base: dict[str, Any] | None, dtype: str | None
) -> dict[str, Any]:
    f = arch.family
    cfg = dict(base or {})
    for k in (
        "rope_theta", "rope_scaling", "partial_rotary_factor", "num_experts", "num_local_experts",
        "n_routed_experts", "head_dim", "architectures",
        # the export's tensors are in `dtype` (an MXFP4 source's experts read dequantised): a kept
        # quantization_config would have loaders look for quantised tensors that are not there
        "quantization_config",
    ):  # fmt: skip
        cfg.pop(k, None)
    cfg.update(kw)
    cfg["model_type"], cfg["architectures"] = f, [ARCHITECTURES[f]]
    source = base or {}
    if MODEL_TYPE_ALIASES.get(source.get("model_type")) == f:
        # the family under its published name (Kimi-K2's kimi_k2): keep the name and classes, so the
        # export loads through the same auto_map (and the same SGLang model class) as the original
        cfg["model_type"] = source["model_type"]
        cfg["architectures"] = list(source.get("architectures") or cfg["architectures"])
    if dtype is not None:
        cfg["dtype"] = dtype
    out = dict(sorted(cfg.items()))
    back = arch_from_hf(out)
    if back != arch:
        raise MegagrpoError(f"exported config does not map back to the architecture: {back} != {arch}")
    return out
