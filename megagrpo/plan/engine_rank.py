"""What one GPU of an SGLang engine holds: its weight shard and its KV cache per token; and `EngineSpan`,
the nodes one engine takes.

This room sits below `plan/memory.py` (the colocated plan), `plan/pools.py` (the disaggregated one) and
`plan/engines.py` (the engine's span over nodes), which all read it; it reads none of them.

Weights. SGLang 0.5.23 does not split every tensor over the engine's TP ranks
(`sglang/srt/models/deepseek_v2.py`, `qwen3_moe.py`, `glm4_moe.py`, with attention TP = engine TP):
  - split over TP: the q, k, v and output projections of attention (column- and row-parallel; GQA's kv
    heads replicated when TP exceeds them), MLA's q up projection (`q_b_proj`, or `q_proj` without a q
    latent), kv up projection (`kv_b_proj`) and output projection, every MLP and expert (routed experts
    split by TP or placed by EP inside the same ranks: 1/TP of them per rank either way), the embedding
    and the LM head (`VocabParallelEmbedding`: the vocab padded to 64 rows, to 64 x TP when 64 rows do
    not split);
  - replicated, whole on every rank: MLA's down projections (`fused_qkv_a_proj_with_mqa`, or
    `kv_a_proj_with_mqa` without a q latent: `ReplicatedLinear`), every norm (`RMSNorm`: the layer norms,
    the latent norms, q/k norms, the final norm), the router (`MoEGate.weight`, a plain parameter of
    [experts, hidden]) with its selection bias (`e_score_correction_bias`), and a shared-expert gate.
DeepSeek-V3 at TP 8: the replicated pieces are 1.03 G parameters, 2.06 GB in bf16 whole on every rank, of
which an even split over TP would count 1/8: 1.80 GB per rank more.
Not counted: multi-token-prediction layers (no speculative decoding), and the per-layer copy of
`kv_b_proj` that MLA's absorbed path keeps as `w_kc`/`w_vc` after loading.

KV cache. GQA: K and V of the rank's kv heads; MLA: the latent (`MLATokenToKVPool`), the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
SGLANG_VOCAB_PADDING = 64  # sglang.srt.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
MAX_ENGINE_GPUS = 1 << 12  # past this no engine holds the model: the plan says so instead of searching on


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise MegagrpoError(f"dtype {name!r}: use one of {', '.join(DTYPE_BYTES)}") from None


def engine_vocab_rows(vocab_size: int, engine_tp: int) -> int:
    """Rows of the embedding (and LM head) on one engine rank: SGLang's `VocabParallelEmbedding` pads the
    vocab to 64 rows, or to 64 x TP when that does not split over TP."""
    pad = SGLANG_VOCAB_PADDING
    if -(-vocab_size // pad) * pad % engine_tp:
        pad *= engine_tp
    return -(-vocab_size // pad) * pad // engine_tp


def _attention_numels(arch: ModelArch, tp: int) -> list[int]:
    """One layer's attention tensors on one engine rank, SGLang's layout (module doc)."""
    H, n = arch.hidden_size, arch.num_attention_heads
    if arch.is_mla:
        qk, rq, rkv, dr = (
            arch.qk_nope_head_dim + arch.qk_rope_head_dim,
            arch.q_lora_rank,
            arch.kv_lora_rank,
            arch.qk_rope_head_dim,
        )
        if rq is None:  # q_proj split, kv_a_proj_with_mqa replicated
            q = [n * qk // tp * H, (rkv + dr) * H]
        else:  # fused_qkv_a_proj_with_mqa and q_a_layernorm replicated, q_b_proj split
            q = [(rq + rkv + dr) * H, rq, n * qk // tp * rq]
        return [
            *q,
            rkv,
            n * (arch.qk_nope_head_dim + arch.v_head_dim) // tp * rkv,
            H * n * arch.v_head_dim // tp,
        ]
    return gqa_numels(arch, tp)


def gqa_numels(arch: ModelArch, tp: int) -> list[int]:
    """One GQA layer's attention tensors on one TP rank: q, k, v rows [(n/tp + 2 kv heads) d, H], their bias,
    q/k norms [d] and the output projection [H, nd/tp]. megatron's `linear_qkv` and SGLang's
    `QKVParallelLinear` hold the same elements, each replicating kv heads when TP exceeds them."""
    H, n, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    kv_heads = g // tp if g % tp == 0 else 1
    rows = (n // tp + 2 * kv_heads) * d
    out = [rows * H]
    if arch.qkv_bias:
        out.append(rows)
    if arch.qk_norm:
        out += [d, d]
    return [*out, H * n * d // tp]


def engine_rank_numels(arch: ModelArch, engine_tp: int) -> list[int]:
    """Element counts of the tensors one rank of an engine of `engine_tp` GPUs holds (module doc)."""
    H, tp = arch.hidden_size, engine_tp
    if arch.num_attention_heads % tp:
        raise MegagrpoError(
            f"{arch.num_attention_heads} attention heads do not split over rollout.engine_tp={tp}"
        )
    rows = engine_vocab_rows(arch.vocab_size, tp)
    out = [rows * H]  # embed_tokens
    attention = _attention_numels(arch, tp)
    moe = set(arch.moe_layers())
    for layer in range(arch.num_layers):
        out += [H, *attention, H]  # input_layernorm, attention, post_attention_layernorm
        if layer in moe:
            E, Fe = arch.num_experts, arch.moe_ffn_hidden_size or arch.ffn_hidden_size
            out.append(E * H)  # the router, replicated
            if arch.moe_router_expert_bias:
                out.append(E)  # its selection bias, replicated
            out.append(-(-E * 3 * Fe * H // tp))  # routed experts: gate/up and down
            Fs = arch.moe_shared_expert_ffn_hidden_size
            if Fs:
                out.append(3 * Fs * H // tp)
                if arch.moe_shared_expert_gate:
                    out.append(H)
        else:
            out.append(3 * arch.ffn_hidden_size * H // tp)
    out.append(H)  # final norm
    if not arch.tie_embeddings:
        out.append(rows * H)  # lm_head
    return out


def engine_weight_bytes(arch: ModelArch, engine_tp: int, dtype: str = "bfloat16") -> int:
    """Weight bytes on one engine rank: its shard plus what SGLang replicates (module doc)."""
    return sum(engine_rank_numels(arch, engine_tp)) * dtype_bytes(dtype)


def kv_bytes_per_token(arch: ModelArch, engine_tp: int, kv_dtype: str = "bfloat16") -> int:
    """The KV cache of one token over all layers on one engine rank.

    GQA: K and V of the rank's kv heads; kv heads replicate when TP exceeds them. Multi-latent attention:
    the latent, kv_lora_rank + qk_rope_head_dim per layer (DeepSeek-V2 arXiv:2405.04434 section 2.1.2,
    what SGLang's `MLATokenToKVPool` stores), the same on every TP rank (the latent is not split by head),
    never full K and V. Multi-token-prediction layers hold no cache (no speculative decoding)."""
    if arch.is_mla:
        return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * dtype_bytes(kv_dtype)
    heads = max(1, arch.num_kv_heads // engine_tp)
    return 2 * arch.num_layers * heads * arch.head_dim * dtype_bytes(kv_dtype)


@dataclass(frozen=True)
class EngineSpan:
    """The configured engine's nodes and the smallest engine that holds the model (`plan/engines.py`)."""

    engine_tp: int
    nodes: int  # nodes one configured engine spans (SGLang's nnodes)
    gpus_per_node: int
    min_engine_tp: int | None  # None: no engine of up to MAX_ENGINE_GPUS GPUs holds it
    min_nodes: int | None
    model_bytes: int  # the whole model in the rollout dtype
    dtype: str
    reasons: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return not self.reasons

    def lines(self) -> list[str]:
        where = (
            f"{self.nodes} nodes (SGLang nnodes={self.nodes}: the first rank of each node starts node_rank "
            "0.., node 0 serves HTTP)"
            if self.nodes > 1
            else "one node"
        )
        least = (
            f"{self.min_engine_tp} GPU{'s' if self.min_engine_tp != 1 else ''} "
            f"({self.min_nodes} node{'s' if self.min_nodes != 1 else ''})"
            if self.min_engine_tp is not None
            else f"more than {MAX_ENGINE_GPUS} GPUs"
        )
        return [
            f"engine: engine_tp={self.engine_tp} on {where}; the model is {self.model_bytes / GIB:.0f} GiB in "
            f"{self.dtype}, the smallest engine that holds it and one sequence: {least}"
        ]
