"""`ModelArch`: the architecture of a decoder-only (MoE) transformer, independent of any framework.

The bridge derives it from a Hugging Face `config.json`; the learner turns it into a megatron-core
`TransformerConfig` and `GPTModel`. It lives here, below both, so neither has to import the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")
# Published `model_type`s that are one of FAMILIES under another name: the checkpoint ships its own
# configuration class (`auto_map`), but the architecture is the family's, field for field. Accepted as
# the family; an export keeps the source's name, so the exported directory looks like the original.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2: configuration_deepseek.DeepseekV3Config
# Families the bridge and the learner build but `megagrpo train/sft/eval` cannot run yet, and what is
# missing: refused by name before anything starts (trainer/preflight.py).
NOT_TRAINABLE = {
    "gpt_oss": (
        "its SGLang engine side (serving, weight sync, the harmony response format) is not in megagrpo yet; "
        "the HF <-> megatron conversion and the learner read it"
    ),
}


@dataclass(frozen=True)
class ModelArch:
    family: str  # one of FAMILIES; selects the HF<->Megatron parameter map
    vocab_size: int  # HF vocab size (before padding to a TP multiple)
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # GQA groups; == num_attention_heads for MHA
    head_dim: int
    ffn_hidden_size: int  # dense SwiGLU intermediate size
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    qkv_bias: bool = False  # Qwen2: bias on q, k, v projections
    tie_embeddings: bool = False
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    # True: softmax over the top-k logits (Mixtral; Qwen3-MoE with norm_topk_prob). False: softmax over
    # all experts, then take the top-k probabilities unnormalised (Qwen3-MoE without norm_topk_prob).
    moe_renormalize_topk: bool = True
    moe_layer_pattern: tuple[int, ...] = ()  # per layer, 1 = MoE, 0 = dense; empty = all MoE
    # Router score function over the expert logits: "softmax" (Mixtral, Qwen-MoE) or "sigmoid".
    moe_router_score_function: str = "softmax"
    # Shared experts (an always-on dense MLP beside the routed ones); 0 = none. The gate is Qwen2-MoE's
    # sigmoid gate on the shared-expert output.
    moe_shared_expert_ffn_hidden_size: int = 0
    moe_shared_expert_gate: bool = False
    # DeepSeek-V3's router (arXiv:2412.19437, eqs. 12-16 and section 2.1.2), also GLM-4.5's:
    # - expert bias: a per-expert correction added to the scores for the SELECTION only (auxiliary-loss-
    #   free balancing, HF `e_score_correction_bias`); the combine weights are the unbiased scores;
    # - group-limited top-k: experts split into `moe_router_num_groups` equal groups, a group scored by the
    #   sum of its top-2 (biased) scores, the top `moe_router_group_topk` groups kept; 1 = no grouping;
    # - the combine weights (renormalised over the chosen experts if `moe_renormalize_topk`) times
    #   `moe_router_topk_scaling_factor` (HF `routed_scaling_factor`).
    moe_router_expert_bias: bool = False
    moe_router_num_groups: int = 1
    moe_router_group_topk: int = 1
    moe_router_topk_scaling_factor: float = 1.0
    # Attention. GQA by default (num_kv_heads, head_dim, qkv_bias, qk_norm above); partial rotary applies
    # RoPE to the first `rotary_percent` of each head's dims (GLM-4.5: 0.5).
    rotary_percent: float = 1.0
    # Multi-latent attention (DeepSeek-V2/V3, arXiv:2405.04434 section 2.1) when kv_lora_rank > 0: q from
    # a low-rank latent of rank q_lora_rank (None = a full q projection, as Moonlight ships it), k and v
    # from a shared latent of rank kv_lora_rank plus one shared rotary key of qk_rope_head_dim. Heads have
    # qk_nope_head_dim + qk_rope_head_dim query/key dims and v_head_dim value dims; RoPE on the rotary part
    # in DeepSeek's interleaved-pair layout. num_kv_heads == num_attention_heads and head_dim is unused.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # RoPE scaling: "default" (none) or "yarn" (arXiv:2309.00071, with DeepSeek's mscale: attention
    # logits scaled by (0.1 * mscale_all_dim * ln(factor) + 1)^2, cos/sin by the mscale ratio).
    rope_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_original_max_position_embeddings: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    # Multi-token-prediction layers the checkpoint ships after the main ones (HF num_nextn_predict_layers,
    # model.layers.{num_layers + i}.*): not built, not trained; counted so that their tensors are known.
    mtp_layers: int = 0
    # YaRN's correction range: True rounds it to whole dims (floor/ceil, as DeepSeek-V3 computes it), False
    # keeps it fractional (gpt-oss, transformers' `truncate: false`).
    rope_truncate: bool = True
    # Attention per layer (HF `layer_types`): "full_attention" or "sliding_attention" (a query attends to
    # itself and the `sliding_window - 1` keys before it, as transformers' sliding-window mask); empty = all
    # full. gpt-oss alternates them, starting with a sliding layer.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    # Learned attention sinks (gpt-oss): one logit per head joins each query's softmax and takes its share
    # of the probability, then is dropped (no value).
    attention_sinks: bool = False
    # A bias on the attention output projection too (gpt-oss's attention_bias: q, k, v and o).
    attn_out_bias: bool = False
    # A bias on the router's logits (gpt-oss): unlike `moe_router_expert_bias` it enters the combine
    # weights as well as the selection.
    moe_router_bias: bool = False
    # Biases on every expert's fc1 (gate and up) and fc2 (gpt-oss).
    moe_expert_bias: bool = False
    # gpt-oss's clamped SwiGLU: gate clamped above at `swiglu_limit`, up clamped to [-limit, limit], then
    # gate * sigmoid(swiglu_alpha * gate) * (up + swiglu_up_offset). limit 0 = no clamp (plain SwiGLU:
    # alpha 1, offset 0).
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    swiglu_up_offset: float = 0.0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layers(self) -> list[int]:
        if not self.is_moe:
            return []
        if not self.moe_layer_pattern:
            return list(range(self.num_layers))
        return [i for i, m in enumerate(self.moe_layer_pattern) if m]

    def sliding_layers(self) -> list[int]:
        """The layers with sliding-window attention (`layer_types`)."""
        return [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]

    def padded_vocab_size(self, multiple: int) -> int:
        """Vocab rounded up to a multiple (e.g. 128 * TP) so the embedding splits evenly."""
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArch:
        d = dict(d)
        for key in ("moe_layer_pattern", "layer_types"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)
