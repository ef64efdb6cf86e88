"""Declarative HF <-> Megatron parameter maps, one table per architecture family.

A `ParamMap` describes one megatron-core parameter in its *full* layout (TP=1, EP=1, PP=1; layers and
experts numbered globally; local-spec names) and the Hugging Face tensors it is built from. Names for a
particular rank (pipeline layer offset, expert-parallel rank, grouped experts, TE spec) come from
`megatron_name`; tensor transforms live in `megagrpo.bridge.transforms`.

Megatron layouts that the transforms reproduce (megatron-core 0.19, verified by instantiating the modules):
- `linear_qkv.weight` [(nq + 2 nkv) * hd, H]: per query group g, the group's q heads, then k_g, then v_g
  (`SelfAttention.get_query_key_value_tensors` views it as [ng, (nq/ng + 2) * hd]); TP splits whole groups.
- `linear_fc1.weight` (SwiGLU) [2F, H] = cat(gate, up); each TP rank holds cat(gate_r, up_r).
- `word_embeddings` / `output_layer` [padded_vocab, H]: rows beyond the HF vocab are zero padding.
- experts: SequentialMLP `mlp.experts.local_experts.{i}.linear_fc{1,2}.weight` (local index i), TE grouped
  `mlp.experts.linear_fc{1,2}.weight{i}`; both save under the same dist-checkpoint keys.

Stacked HF experts (gpt-oss): one HF tensor holds every expert of a layer on its first axis, and each
expert's map reads its own slice (`ParamMap.stacked`): `gate_up_proj` [E, H, 2F] with gate and up
interleaved on the last axis (`[..., ::2]` / `[..., 1::2]`), `down_proj` [E, F, H] (transposed against a
Linear), and their biases [E, 2F] / [E, H].
"""

from __future__ import annotations

from dataclasses import dataclass

from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError

KINDS = ("copy", "qkv", "gate_up", "vocab", "gate_up_interleaved", "transpose")
# kinds whose megatron tensor is cat(gate, up) on axis 0, split over TP half by half
GATE_UP_KINDS = ("gate_up", "gate_up_interleaved")
LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class ParamMap:
    """One megatron parameter (full layout) and the HF tensors it is made of.

    mcore: global megatron name, e.g. `decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight`.
    hf: HF names in the order the transform consumes them (q, k, v for "qkv"; gate, up for "gate_up").
    kind: one of KINDS. tp_axis: the axis TP splits (None = replicated on every TP rank).
    layer / expert: global indices (None outside decoder layers / for non-expert params).
    hf_shapes: expected shape of each HF tensor, from the config. expert_tp: split over the expert-TP group.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str
    tp_axis: int | None
    hf_shapes: tuple[tuple[int, ...], ...]
    layer: int | None = None
    expert: int | None = None
    # the HF tensors stack every expert on axis 0 and this map is slice [expert] of them; hf_shapes are
    # the slice's shapes
    stacked: bool = False

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


# Per-layer attention block: megatron suffix -> (kind, HF suffixes, tp_axis). Optional rows are keyed by the
# ModelArch flag that enables them.
_ATTN = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",), None),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        0,
    ),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",), 1),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",), None),
}
_QKV_BIAS = {
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        0,
    ),
}
_QK_NORM = {
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",), None),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",), None),
}
# Multi-latent attention (megatron's MLASelfAttention, local spec). The down projections are column-parallel
# in the local spec (each TP rank computes a slice of the latent, then gathers it); the up projections
# split over heads. Row layouts equal HF's: q_b / kv_b rows per head [nope; rope] / [nope; v], kv_a rows
# [latent; shared rotary key].
_MLA = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",), None),
    "self_attention.linear_kv_down_proj.weight": ("copy", ("self_attn.kv_a_proj_with_mqa.weight",), 0),
    "self_attention.kv_layernorm.weight": ("copy", ("self_attn.kv_a_layernorm.weight",), None),
    "self_attention.linear_kv_up_proj.weight": ("copy", ("self_attn.kv_b_proj.weight",), 0),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",), 1),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",), None),
}
_MLA_Q_LORA = {
    "self_attention.linear_q_down_proj.weight": ("copy", ("self_attn.q_a_proj.weight",), 0),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_a_layernorm.weight",), None),
    "self_attention.linear_q_up_proj.weight": ("copy", ("self_attn.q_b_proj.weight",), 0),
}
_MLA_Q = {"self_attention.linear_q_proj.weight": ("copy", ("self_attn.q_proj.weight",), 0)}


def _swiglu(mcore: str, gate: str, up: str, down: str) -> dict:
    """One SwiGLU MLP's rows: megatron's fc1 is [gate; up] stacked (each half split over TP on dim 0), fc2
    is down (split on dim 1). Dense MLPs, shared experts and routed experts all take this shape."""
    return {
        f"{mcore}linear_fc1.weight": ("gate_up", (gate, up), 0),
        f"{mcore}linear_fc2.weight": ("copy", (down,), 1),
    }


def _hf_swiglu(mcore: str, hf: str) -> dict:
    """`_swiglu` with HF's `gate_proj`/`up_proj`/`down_proj` names under `hf`."""
    return _swiglu(mcore, f"{hf}gate_proj.weight", f"{hf}up_proj.weight", f"{hf}down_proj.weight")


_DENSE_MLP = _hf_swiglu("mlp.", "mlp.")
_ROUTER = {"mlp.router.weight": ("copy", ("mlp.gate.weight",), None)}
_EXPERT = _hf_swiglu("", "mlp.experts.{e}.")  # {e} = global expert index

# DeepSeek-V3's MoE block (also GLM-4.5's): router weight and its selection-only correction bias (an fp32
# buffer in megatron), per-expert rows as Qwen3-MoE's, and the shared experts (one SwiGLU MLP of
# n_shared_experts * moe_intermediate_size, split over TP like a dense MLP).
_V3_MOE = {
    "router": _ROUTER,
    "router_bias": {"mlp.router.expert_bias": ("copy", ("mlp.gate.e_score_correction_bias",), None)},
    "shared": _hf_swiglu("mlp.shared_experts.", "mlp.shared_experts."),
    "expert": _EXPERT,
}

# MoE block per family: router rows, then per-expert rows; optional "router_bias" / "shared" rows where the
# family has them (enabled by the arch's description).
_MIXTRAL_EXPERT = "block_sparse_moe.experts.{e}."
_MOE = {
    "qwen3_moe": {"router": _ROUTER, "expert": _EXPERT},
    "mixtral": {
        "router": {"mlp.router.weight": ("copy", ("block_sparse_moe.gate.weight",), None)},
        "expert": _swiglu(
            "", f"{_MIXTRAL_EXPERT}w1.weight", f"{_MIXTRAL_EXPERT}w3.weight", f"{_MIXTRAL_EXPERT}w2.weight"
        ),
    },
    "deepseek_v3": _V3_MOE,
    "glm4_moe": _V3_MOE,
    # gpt-oss: a router with a bias, stacked experts with biases (see the module contract)
    "gpt_oss": {
        "router": {
            "mlp.router.weight": ("copy", ("mlp.router.weight",), None),
            "mlp.router.bias": ("copy", ("mlp.router.bias",), None),
        },
        "expert": {
            "linear_fc1.weight": ("gate_up_interleaved", ("mlp.experts.gate_up_proj",), 0),
            "linear_fc1.bias": ("gate_up_interleaved", ("mlp.experts.gate_up_proj_bias",), 0),
            "linear_fc2.weight": ("transpose", ("mlp.experts.down_proj",), 1),
            "linear_fc2.bias": ("copy", ("mlp.experts.down_proj_bias",), None),
        },
        "stacked": True,
    },
}
# attention rows beyond `_ATTN` / `_QKV_BIAS`, keyed by the ModelArch flag that enables them
_ATTN_OUT_BIAS = {"self_attention.linear_proj.bias": ("copy", ("self_attn.o_proj.bias",), None)}
# megatron's learnable softmax offset (`softmax_type='learnable'`), one per head, split over TP with them
_SINKS = {"self_attention.core_attention.softmax_offset": ("copy", ("self_attn.sinks",), 0)}
MAPPED_FAMILIES = ("llama", "qwen2", "qwen3", *_MOE)

# TE spec fuses the pre-attention norm into linear_qkv and (dense layers only) the pre-MLP norm into fc1;
# the local spec's `sharded_state_dict_keys_map` aliases its names to these in dist checkpoints.
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _hf_shape(arch: ModelArch, hf_name: str) -> tuple[int, ...]:
    """Shape of an HF tensor implied by the config (HF Linear weights are [out, in])."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_kv_heads * hd
    leaf = hf_name.rsplit(".", 2)[-2:]
    mod, kind = leaf[0], leaf[1]
    expert = ".experts." in hf_name
    f = arch.moe_ffn_hidden_size if expert else arch.ffn_hidden_size
    if ".shared_experts." in hf_name:
        f = arch.moe_shared_expert_ffn_hidden_size
    if kind == "e_score_correction_bias":
        return (arch.num_experts,)
    if arch.family == "gpt_oss":
        f = arch.moe_ffn_hidden_size
        oss = {
            "gate_up_proj": (h, 2 * f),  # one expert's slice of the stacked tensors
            "gate_up_proj_bias": (2 * f,),
            "down_proj": (f, h),
            "down_proj_bias": (h,),
            "sinks": (arch.num_attention_heads,),
        }
        if kind in oss:
            return oss[kind]
        if mod == "router":
            return (arch.num_experts, h) if kind == "weight" else (arch.num_experts,)
        if mod == "o_proj" and kind == "bias":
            return (h,)
    if arch.is_mla:
        n, qk = arch.num_attention_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
        mla = {
            "q_proj": (n * qk, h),
            "q_a_proj": (arch.q_lora_rank, h),
            "q_a_layernorm": (arch.q_lora_rank,),
            "q_b_proj": (n * qk, arch.q_lora_rank),
            "kv_a_proj_with_mqa": (arch.kv_lora_rank + arch.qk_rope_head_dim, h),
            "kv_a_layernorm": (arch.kv_lora_rank,),
            "kv_b_proj": (n * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank),
            "o_proj": (h, n * arch.v_head_dim),
        }
        if mod in mla:
            return mla[mod]
    table = {
        "embed_tokens": (arch.vocab_size, h),
        "lm_head": (arch.vocab_size, h),
        "norm": (h,),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "q_proj": (q, h) if kind == "weight" else (q,),
        "k_proj": (kv, h) if kind == "weight" else (kv,),
        "v_proj": (kv, h) if kind == "weight" else (kv,),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "w1": (f, h),
        "w3": (f, h),
        "down_proj": (h, f),
        "w2": (h, f),
        "gate": (arch.num_experts, h),
    }
    return table[mod]


def _rows(
    arch: ModelArch,
    table: dict,
    mcore_prefix: str,
    hf_prefix: str,
    layer: int,
    expert: int | None = None,
    stacked: bool = False,
):
    out = []
    for suffix, (kind, hf_suffixes, tp_axis) in table.items():
        hf = tuple(hf_prefix + s.format(e=expert) for s in hf_suffixes)
        out.append(
            ParamMap(
                mcore=mcore_prefix + suffix,
                hf=hf,
                kind=kind,
                tp_axis=tp_axis,
                hf_shapes=tuple(_hf_shape(arch, n) for n in hf),
                layer=layer,
                expert=expert,
                stacked=stacked,
            )
        )
    return out


def _need(moe: dict, part: str, arch: ModelArch) -> dict:
    if part not in moe:
        raise MegagrpoError(
            f"model family {arch.family!r} has no {part.replace('_', ' ')} in its parameter map"
        )
    return moe[part]


def param_maps(arch: ModelArch) -> list[ParamMap]:
    """Every megatron parameter of `arch` in HF checkpoint order: embedding, layers, final norm, output."""
    if arch.family not in MAPPED_FAMILIES:
        raise MegagrpoError(f"model family {arch.family!r} has no parameter map")
    if arch.is_moe and arch.family not in _MOE:
        raise MegagrpoError(f"model family {arch.family!r} has no MoE parameter map")
    emb = ("model.embed_tokens.weight",)
    maps = [ParamMap("embedding.word_embeddings.weight", emb, "vocab", 0, (_hf_shape(arch, emb[0]),))]
    moe_layers = set(arch.moe_layers())
    for layer in range(arch.num_layers):
        mp, hp = f"{LAYER_PREFIX}{layer}.", f"model.layers.{layer}."
        if arch.is_mla:
            maps += _rows(arch, _MLA, mp, hp, layer)
            maps += _rows(arch, _MLA_Q if arch.q_lora_rank is None else _MLA_Q_LORA, mp, hp, layer)
        else:
            maps += _rows(arch, _ATTN, mp, hp, layer)
        if arch.qkv_bias:
            maps += _rows(arch, _QKV_BIAS, mp, hp, layer)
        if arch.attn_out_bias:
            maps += _rows(arch, _ATTN_OUT_BIAS, mp, hp, layer)
        if arch.attention_sinks:
            maps += _rows(arch, _SINKS, mp, hp, layer)
        if arch.qk_norm:
            maps += _rows(arch, _QK_NORM, mp, hp, layer)
        if layer in moe_layers:
            moe = _MOE[arch.family]
            maps += _rows(arch, moe["router"], mp, hp, layer)
            if arch.moe_router_expert_bias:
                maps += _rows(arch, _need(moe, "router_bias", arch), mp, hp, layer)
            if arch.moe_shared_expert_ffn_hidden_size:
                maps += _rows(arch, _need(moe, "shared", arch), mp, hp, layer)
            stacked = moe.get("stacked", False)
            for e in range(arch.num_experts):
                prefix = f"{mp}mlp.experts.local_experts.{e}."
                maps += _rows(arch, moe["expert"], prefix, hp, layer, e, stacked)
        else:
            maps += _rows(arch, _DENSE_MLP, mp, hp, layer)
    maps.append(
        ParamMap(
            "decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None, ((arch.hidden_size,),)
        )
    )
    if not arch.tie_embeddings:
        head = ("lm_head.weight",)
        maps.append(ParamMap("output_layer.weight", head, "vocab", 0, (_hf_shape(arch, head[0]),)))
    return maps


def hf_names(arch: ModelArch) -> list[str]:
    """All HF tensor names of `arch` (the key set of its safetensors checkpoint), each once."""
    return list(dict.fromkeys(n for m in param_maps(arch) for n in m.hf))


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of `arch`'s checkpoint: what a full export yields (stacked experts whole)."""
    return {
        n: (arch.num_experts, *shape) if m.stacked else shape
        for m in param_maps(arch)
        for n, shape in zip(m.hf, m.hf_shapes, strict=True)
    }


@dataclass(frozen=True)
class Placement:
    """Where a rank's model chunk sits in the full model, for naming its parameters.

    layer_offset: global index of this chunk's first decoder layer (megatron numbers layers locally).
    ep_rank / ep_size: expert-parallel rank and size (experts are split contiguously).
    grouped_experts: TEGroupedMLP names (`experts.linear_fc1.weight{i}`) instead of SequentialMLP.
    te_norms: TE-spec fused layernorm names.
    """

    layer_offset: int = 0
    ep_rank: int = 0
    ep_size: int = 1
    grouped_experts: bool = False
    te_norms: bool = False


def megatron_name(pm: ParamMap, arch: ModelArch, place: Placement = Placement()) -> str | None:
    """The name `pm` has inside one rank's model chunk, or None if its expert lives on another EP rank."""
    name = pm.mcore
    if pm.layer is None:
        return name
    rest = name[len(f"{LAYER_PREFIX}{pm.layer}.") :]
    if pm.is_expert:
        if arch.num_experts % place.ep_size:
            raise MegagrpoError(f"num_experts={arch.num_experts} is not divisible by EP size {place.ep_size}")
        n_local = arch.num_experts // place.ep_size
        if pm.expert // n_local != place.ep_rank:
            return None
        local = pm.expert % n_local
        leaf = rest.split(f"local_experts.{pm.expert}.", 1)[1]  # e.g. linear_fc1.weight
        if place.grouped_experts:
            rest = f"mlp.experts.{leaf}{local}"
        else:
            rest = f"mlp.experts.local_experts.{local}.{leaf}"
    elif place.te_norms and arch.is_mla:
        # TE's MLA spec fuses the q/kv latent norms into the up projections and replicates the down
        # projections (TELinear 'duplicated'), a TP layout these maps do not describe yet.
        raise MegagrpoError(
            "multi-latent attention on the Transformer Engine spec is not mapped; use model.layer_spec=local"
        )
    elif place.te_norms and rest in TE_NORM_NAMES:
        dense = pm.layer not in set(arch.moe_layers())
        if rest == "input_layernorm.weight" or dense:
            rest = TE_NORM_NAMES[rest]
    return f"{LAYER_PREFIX}{pm.layer - place.layer_offset}.{rest}"
