"""HF `config.json` <-> `ModelArch` for the DeepSeek-V3-shaped families: `deepseek_v3` (DeepSeek-V3/R1/V3.1,
Kimi-K2, Moonlight) and `glm4_moe` (GLM-4.5/4.6/4.7, GLM-4.5-Air).

Both share DeepSeek-V3's MoE block: a sigmoid router with a selection-only correction bias
(`e_score_correction_bias`), group-limited top-k, renormalised and scaled combine weights, shared experts
and dense first layers. DeepSeek-V3 adds multi-latent attention with YaRN; GLM-4.5 keeps GQA with partial
rotary, q/k/v biases and optional q/k norms. Every field the public checkpoints ship is read or accepted
as irrelevant to the forward pass (training-time auxiliary-loss settings, inference hints); anything the
learner could not reproduce exactly raises a `MegagrpoError` naming the field.
"""

from __future__ import annotations

import logging
from typing import Any

from megagrpo.bridge.hf_fields import require, unsupported
from megagrpo.errors import MegagrpoError

log = logging.getLogger(__name__)

V3_FAMILIES = ("deepseek_v3", "glm4_moe")
# What a field absent from config.json means: transformers 5.x's config class defaults (DeepseekV3Config,
# Glm4MoeConfig), because SGLang (the sampler) reads the same transformers config object, so those are the
# values both the reference and the sampler compute with. The one model-code default that departs from its
# config class, SGLang glm4_moe's getattr(config, "partial_rotary_factor", 0.5), equals the 0.5 that
# Glm4MoeConfig.__post_init__ sets. Kimi-K2 (deepseek_v3 under its own name) ships every field.
TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_interleave=True, attention_bias=False, rms_norm_eps=1e-6,
    ),
    "glm4_moe": dict(
        n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1, norm_topk_prob=True,
        num_key_value_heads=8, partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=False,
        rms_norm_eps=1e-5,
    ),
}  # fmt: skip
_YARN_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}


def parse_rope(
    cfg: dict[str, Any], where: str, *, yarn: bool, partial: bool, fractional_yarn: bool = False
) -> dict[str, Any]:
    """rope_theta, partial rotary and YaRN fields, from `rope_parameters` (transformers >= 5) or the
    legacy `rope_theta` / `rope_scaling` / `partial_rotary_factor`. fractional_yarn: the family's learner
    keeps YaRN's correction range unrounded (`truncate: false`). The one reader of every family's rope
    (`yarn` / `partial`: whether the family's learner computes YaRN / a partial rotary; else refused)."""
    params = cfg.get("rope_parameters")
    src = "rope_scaling" if params is None else "rope_parameters"  # errors name the field the file has
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    elif not isinstance(params, dict) or not isinstance(params.get("rope_theta"), (int, float)):
        raise MegagrpoError(
            f"{where}: rope_parameters must be a mapping with a numeric rope_theta: {params!r}"
        )
    params = dict(params)
    kind = f"{src}.{'rope_type' if 'rope_type' in params else 'type'}"
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    out: dict[str, Any] = {"rope_theta": float(params.pop("rope_theta"))}
    factor = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor is None:
        factor = 1.0
    if float(factor) != 1.0 and not partial:
        raise unsupported(where, "partial_rotary_factor", factor, "this family rotates whole heads")
    out["rotary_percent"] = float(factor)
    if rope_type == "yarn":
        if not yarn:
            raise unsupported(where, kind, rope_type, "YaRN is implemented for multi-latent attention")
        if params.get("attention_factor") is not None:
            raise unsupported(where, f"{src}.attention_factor", params["attention_factor"],
                        "megatron derives the YaRN attention factor from mscale/mscale_all_dim")  # fmt: skip
        truncate = params.pop("truncate", True)
        if truncate not in (True, False) or (truncate is False and not fractional_yarn):
            raise unsupported(where, f"{src}.truncate", truncate, "megatron rounds the YaRN range")
        if truncate is False:
            out["rope_truncate"] = False
        params.pop("attention_factor", None)
        if "factor" not in params or "original_max_position_embeddings" not in params:
            raise MegagrpoError(
                f"{where}: {src} of type yarn needs factor and original_max_position_embeddings"
            )
        out["rope_type"] = "yarn"
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if not (mscale and all_dim) and (mscale not in (None, 1, 1.0) or all_dim):
            # transformers then scales cos/sin by 0.1 ln(factor) + 1 and ignores the one given; megatron
            # divides the mscale term by the mscale_all_dim term
            raise unsupported(where, f"{src}.mscale", (mscale, all_dim),
                        "mscale and mscale_all_dim must both be set, or mscale 1 and no mscale_all_dim")  # fmt: skip
        # transformers' _compute_yarn_parameters: `get("beta_fast") or 32`, `get("beta_slow") or 1`, so a
        # null (or 0) beta is the default; a missing mscale is 1 and a missing mscale_all_dim 0
        defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        for key, field in _YARN_KEYS.items():
            value = params.pop(key, None)
            if key.startswith("beta_") and not value:
                value = defaults[key]
            elif value is None:
                value = defaults.get(key)
            out[field] = int(value) if key == "original_max_position_embeddings" else float(value or 0.0)
    elif rope_type != "default":
        raise unsupported(where, kind, rope_type, "only default rope and YaRN are implemented")
    if params:
        raise MegagrpoError(f"{where}: rope parameters {sorted(params)} are not supported")
    return out


def _moe(cfg: dict[str, Any], where: str, layers: int, hidden: int) -> dict[str, Any]:
    experts = int(
        require(cfg, "n_routed_experts", where)
        if "n_routed_experts" in cfg
        else require(cfg, "num_local_experts", where)
    )
    topk = int(require(cfg, "num_experts_per_tok", where))
    ffn = int(require(cfg, "moe_intermediate_size", where))
    groups = int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or 1)
    if topk > experts:
        raise MegagrpoError(f"{where}: num_experts_per_tok={topk} > n_routed_experts={experts}")
    if experts % groups:
        raise unsupported(
            where, "n_group", groups, f"n_routed_experts={experts} must split into equal groups"
        )
    if not 1 <= group_topk <= groups:
        raise unsupported(where, "topk_group", group_topk, f"must be in [1, n_group={groups}]")
    per_group = experts // groups
    if groups > 1 and per_group < 2:
        # the model scores a group by its top-2 experts (moe.group_topk); transformers fails on fewer
        raise unsupported(where, "n_group", groups, f"a group needs 2 experts of n_routed_experts={experts}")
    if groups > 1 and topk > group_topk * per_group:
        raise unsupported(where, "num_experts_per_tok", topk,
                    f"more than the {group_topk * per_group} experts of the topk_group={group_topk} kept groups")  # fmt: skip
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring not in (None, "sigmoid"):
        raise unsupported(where, "scoring_func", scoring, "these families' router scores with a sigmoid")
    method = cfg.get("topk_method", "noaux_tc")
    if method not in (None, "noaux_tc"):
        raise unsupported(where, "topk_method", method, "only noaux_tc (bias-corrected group-limited top-k)")
    freq = cfg.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise unsupported(
            where, "moe_layer_freq", freq, "only every layer after first_k_dense_replace is MoE"
        )
    norm = cfg.get("norm_topk_prob", True)
    if norm is False and topk > 1:
        raise unsupported(
            where, "norm_topk_prob", norm, "megatron renormalises sigmoid scores over the chosen experts"
        )
    if norm and topk == 1:
        raise unsupported(where, "norm_topk_prob", norm,
                    "with num_experts_per_tok=1 the model combines its expert with weight 1, megatron-core "
                    "with the sigmoid score and has no setting for 1")  # fmt: skip
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if dense >= layers:
        raise MegagrpoError(f"{where}: first_k_dense_replace={dense} leaves no MoE layer of {layers}")
    shared = int(cfg.get("n_shared_experts") or 0)
    out: dict[str, Any] = dict(
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=ffn,
        moe_renormalize_topk=bool(cfg.get("norm_topk_prob", True)),
        moe_router_score_function="sigmoid",
        moe_router_expert_bias=True,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_shared_expert_ffn_hidden_size=shared * ffn,
    )
    if dense:
        out["moe_layer_pattern"] = tuple(int(i >= dense) for i in range(layers))
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    out["mtp_layers"] = mtp
    if mtp:
        log.warning(
            "%s: num_nextn_predict_layers=%d multi-token-prediction layer(s) are not trained (the learner "
            "builds the main model only); the converter carries their tensors unchanged to the export",
            where,
            mtp,
        )
    return out


def parse_v3_family(cfg: dict[str, Any], where: str, family: str) -> dict[str, Any]:
    """The `ModelArch` fields of a `deepseek_v3` or `glm4_moe` config (absent fields: TRANSFORMERS_DEFAULTS)."""
    defaults = dict(TRANSFORMERS_DEFAULTS[family])
    if "num_local_experts" in cfg:  # transformers' attribute_map alias of n_routed_experts
        defaults.pop("n_routed_experts")
    cfg = {**defaults, **cfg}
    if cfg.get("quantization_config") is not None:
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise unsupported(where, "quantization_config", method,
                    "quantised weights (DeepSeek-V3 ships block-wise FP8): dequantise the checkpoint to bf16 "
                    "and remove quantization_config")  # fmt: skip
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise unsupported(where, "hidden_act", act, "the maps fuse gate/up for SwiGLU only")
    tp = cfg.get("pretraining_tp", 1)
    if tp not in (None, 1):
        raise unsupported(where, "pretraining_tp", tp, "sliced linear layers are not implemented")
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    layers = int(require(cfg, "num_hidden_layers", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    bias = bool(cfg.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=int(require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        ffn_hidden_size=int(require(cfg, "intermediate_size", where)),
        max_position_embeddings=int(require(cfg, "max_position_embeddings", where)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if family == "deepseek_v3":
        if kv_heads != heads:
            raise unsupported(where, "num_key_value_heads", kv_heads,
                        f"multi-latent attention has one key per head (num_attention_heads={heads})")  # fmt: skip
        if bias:
            raise unsupported(where, "attention_bias", bias, "megatron's MLA has no projection biases")
        interleave = cfg.get("rope_interleave", True)
        if interleave is not True:
            raise unsupported(
                where, "rope_interleave", interleave, "megatron's MLA rotates interleaved pairs only"
            )
        q_lora = cfg.get("q_lora_rank")
        nope, rope = (
            int(require(cfg, "qk_nope_head_dim", where)),
            int(require(cfg, "qk_rope_head_dim", where)),
        )
        v_dim = int(require(cfg, "v_head_dim", where))
        if v_dim > nope + rope:
            # megatron's MLA pads the values of packed (THD) sequences to the query head dim, which cuts
            # wider ones (F.pad by a negative width); the learner packs every batch
            raise unsupported(where, "v_head_dim", v_dim,
                        f"wider than the query head (qk_nope_head_dim + qk_rope_head_dim = {nope + rope}), "
                        "which megatron-core's multi-latent attention cuts to that width")  # fmt: skip
        fields.update(
            num_kv_heads=heads,
            head_dim=nope + rope,
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(require(cfg, "kv_lora_rank", where)),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=v_dim,
            **parse_rope(cfg, where, yarn=True, partial=False),
        )
    else:
        if heads % kv_heads:
            raise MegagrpoError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        fields.update(
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            qkv_bias=bias,  # GLM's attention_bias: q, k, v only (o_proj has none)
            qk_norm=bool(cfg.get("use_qk_norm", False)),
            **parse_rope(cfg, where, yarn=False, partial=True),
        )
    fields.update(_moe(cfg, where, layers, hidden))
    return fields


def hf_fields_v3(arch: Any) -> dict[str, Any]:
    """The config.json fields of a `deepseek_v3` / `glm4_moe` arch beyond those every family writes (the
    inverse of `parse_v3_family`, with `hf_config.hf_config_from_arch`); `head_dim: None` drops the field
    (DeepSeek-V3's is derived by transformers)."""
    pattern = arch.moe_layer_pattern or (1,) * arch.num_layers
    dense = pattern.index(1)
    if any(not m for m in pattern[dense:]):
        raise MegagrpoError(f"{arch.family}: MoE layers must follow the first dense ones, got {pattern}")
    if arch.moe_shared_expert_ffn_hidden_size % arch.moe_ffn_hidden_size:
        raise MegagrpoError(
            f"{arch.family}: shared-expert size {arch.moe_shared_expert_ffn_hidden_size} is not a multiple of "
            f"moe_intermediate_size {arch.moe_ffn_hidden_size}"
        )
    kw: dict[str, Any] = dict(
        n_routed_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_topk,
        moe_intermediate_size=arch.moe_ffn_hidden_size,
        n_shared_experts=arch.moe_shared_expert_ffn_hidden_size // arch.moe_ffn_hidden_size,
        norm_topk_prob=arch.moe_renormalize_topk,
        routed_scaling_factor=arch.moe_router_topk_scaling_factor,
        n_group=arch.moe_router_num_groups,
        topk_group=arch.moe_router_group_topk,
        first_k_dense_replace=dense,
        num_nextn_predict_layers=arch.mtp_layers,
    )
    rope: dict[str, Any] = {"rope_theta": arch.rope_theta, "rope_type": arch.rope_type}
    if arch.rope_type == "yarn":
        rope.update(yarn_fields(arch))
    if arch.is_mla:
        kw.update(
            head_dim=None,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_nope_head_dim=arch.qk_nope_head_dim,
            qk_rope_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.v_head_dim,
            attention_bias=False,
            rope_interleave=True,
        )
    else:
        rope["partial_rotary_factor"] = arch.rotary_percent
        kw.update(
            attention_bias=arch.qkv_bias,
            use_qk_norm=arch.qk_norm,
            partial_rotary_factor=arch.rotary_percent,
        )
    kw.update(rope_fields(rope))
    return kw


def yarn_fields(arch: Any) -> dict[str, Any]:
    """The YaRN keys of `rope_parameters` for `arch` (the inverse of `parse_rope`'s YaRN branch)."""
    out: dict[str, Any] = {key: getattr(arch, field) for key, field in _YARN_KEYS.items()}
    if not arch.rope_truncate:
        out["truncate"] = False
    return out


def rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """config.json rope fields for `rope_parameters` `rope`: that (transformers >= 5) and the legacy
    `rope_theta` / `rope_scaling` (transformers 4.x, and models with their own code, such as DeepSeek's
    `configuration_deepseek.py`, which read `rope_scaling["type"]`), so that every loader keeps YaRN."""
    out: dict[str, Any] = {"rope_parameters": dict(rope), "rope_theta": rope["rope_theta"]}
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", "default") != "default":
        out["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}
    return out
