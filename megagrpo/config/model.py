"""`ModelArch`: the architecture of a decoder-only (MoE) transformer, independent of any framework.

The bridge derives it from a Hugging Face `config.json`; the learner turns it into a megatron-core
`TransformerConfig` and `GPTModel`. It lives here, below both, so neither has to import the other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layers(self) -> list[int]:
        if not self.is_moe:
            return []
        if not self.moe_layer_pattern:
            return list(range(self.num_layers))
        return [i for i, m in enumerate(self.moe_layer_pattern) if m]

    def padded_vocab_size(self, multiple: int) -> int:
        """Vocab rounded up to a multiple (e.g. 128 * TP) so the embedding splits evenly."""
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArch:
        d = dict(d)
        if "moe_layer_pattern" in d:
            d["moe_layer_pattern"] = tuple(d["moe_layer_pattern"])
        return cls(**d)
