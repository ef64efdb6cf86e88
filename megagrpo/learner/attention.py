"""Core attention for the local (non-Transformer-Engine) layer spec, with packed THD sequences.

megatron-core's local `DotProductAttention` asserts `packed_seq_params is None`, so without TE (on the
CPU) packed batches could not run. `TorchCoreAttention` takes its place in the local spec: causal
`torch.nn.functional.scaled_dot_product_attention` per sequence, grouped-query heads expanded on the
fly, and the THD layout (`PackedSeqParams.cu_seqlens_q`) handled by attending within each sequence.

Shapes (per tensor-parallel rank; np = local query heads, ng = local KV groups, hn = head dim):
  padded: query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]` -> `[sq, b, np * hn]`
  THD:    query `[t, np, hn]`,     key/value `[t, ng, hn]`     -> `[t, np * hn]`
Multi-latent attention: ng == np, and v's head dim may differ from q/k's (the output has v's).

Per layer, as transformers' eager attention computes them (gpt-oss): a sliding window (megatron's
`window_size` (left, 0) on the layers `window_attn_skip_freq` marks: keys i - left .. i), and learned sinks
(`softmax_type='learnable'`, megatron's `softmax_offset` [np]: one logit per head joins every query's
softmax, and its probability is dropped). Both take the explicit path (scores, mask, softmax in fp32),
since SDPA has neither; cost O(s^2) memory per sequence and head, as the eager reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


class TorchCoreAttention(MegatronModule):
    """Drop-in for megatron's local `DotProductAttention` (same constructor and forward signature)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs the Transformer Engine layer spec (GPU)")
        if config.softmax_type not in ("vanilla", "learnable"):
            raise ValueError(f"TorchCoreAttention: softmax_type={config.softmax_type!r} is not implemented")
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        self.heads = divide(config.num_attention_heads, tp)
        # layer_number is global and 1-based, as megatron's is_layer_window_attention reads it
        self.window = (
            config.window_size[0]
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )
        if self.window is not None and config.window_size[1] != 0:
            raise ValueError(f"window_size={config.window_size}: only causal windows (left, 0)")
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            # as DotProductAttention allocates it, on this rank's heads (TP splits heads)
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(self.heads, device=_device(), dtype=config.params_dtype)
            )
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
            # split over TP like the heads: counted once per rank in the gradient norm
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        self.groups = divide(config.num_query_groups, tp)
        # multi-latent attention passes its q/k head dim (nope + rope) and v head dim; v may be narrower
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q `[b, np, s, hn]`, k/v `[b, ng, s, hn]`, mask None (causal) or bool `[b, 1, s, s]` True=masked."""
        if self.groups != self.heads:
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        if self.window is not None or self.softmax_offset is not None:
            return self._attend_explicit(q, k, v, mask, dropout)
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale
            )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=~mask, dropout_p=dropout, scale=self.softmax_scale
        )

    def _attend_explicit(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float
    ) -> Tensor:
        """transformers' eager attention (gpt-oss's `eager_attention_forward`): causal (and windowed)
        scores, the sink logit appended to each row of the softmax and its probability dropped."""
        s_q, s_k = q.shape[2], k.shape[2]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        i = torch.arange(s_q, device=q.device).unsqueeze(1) + (s_k - s_q)
        j = torch.arange(s_k, device=q.device).unsqueeze(0)
        hidden = j > i
        if self.window is not None:
            hidden = hidden | (i - j > self.window)
        if mask is not None:
            hidden = hidden | mask
        scores = scores.masked_fill(hidden, float("-inf"))
        if self.softmax_offset is not None:
            sink = self.softmax_offset.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if self.softmax_offset is not None:
            probs = probs[..., :-1]
        probs = F.dropout(probs, p=dropout, training=dropout > 0).to(v.dtype)
        return torch.matmul(probs, v)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        """The sinks as DotProductAttention saves them: split over TP on the head axis."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {} if self.softmax_offset is None else self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            bounds = cu.tolist()
            outs = []
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                if hi == lo:
                    continue
                # [s, h, hn] -> [1, h, s, hn]
                q, k, v = (x[lo:hi].permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
                outs.append(self._attend(q, k, v, None)[0].permute(1, 0, 2))
            out = torch.cat(outs, dim=0) if outs else query.new_zeros(query.shape)
            if bounds[-1] < query.shape[0]:  # tail padding after the last sequence (TP/SP alignment)
                tail = query.new_zeros((query.shape[0] - bounds[-1], *out.shape[1:]))
                out = torch.cat([out, tail], dim=0)
            return out.reshape(out.shape[0], -1)
        # [s, b, h, hn] -> [b, h, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is not None and mask_type != AttnMaskType.causal:
            mask = attention_mask
        out = self._attend(q, k, v, mask)  # [b, np, s, hn]
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def local_mla_self_attention() -> type:
    """megatron's `MLASelfAttention` for the local spec (built on first use: it imports megatron's MLA).

    The local spec makes the q/kv down projections `ColumnParallelLinear` (each TP rank computes a slice
    of the latent, then megatron gathers it). On that path megatron hands the shared rotary key
    (`k_pos_emb`, the last `qk_pos_emb_head_dim` columns of the kv latent) to each rank's heads with the
    whole sequence and no reduction on the way back: each rank keeps only its own heads' part of that
    gradient, so `linear_kv_down_proj` (and everything below it) gets a wrong gradient under TP > 1
    (measured: 1.5e-4 against one process, while logits agree to 1e-6). Gathering the latent here and
    handing it over in the sequence-parallel layout of megatron's duplicated-`Linear` path (TE's) makes
    megatron gather `k_pos_emb` over the sequence itself, whose backward reduce-scatter sums the heads'
    parts over TP. MoE models need sequence parallelism with TP > 1 anyway (`learner.model`).

    Without a q latent (`q_lora_rank` null: Moonlight, DeepSeek-V2-Lite) the query is one plain projection
    of the layer's input and only the kv latent has a norm. megatron's resolver of MLA norms cannot say
    that without Transformer Engine: with `qk_layernorm` it wants a fused norm+linear q projection (a norm
    these models lack), and it refuses the local spec's q norm as unused. `_resolve_qk_norm_config` says it.
    """
    global _LOCAL_MLA
    if _LOCAL_MLA is None:
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )
        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        class LocalMLASelfAttention(MLASelfAttention):
            def _qkv_down_projection(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
                q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
                if kv_combined.size(-1) != self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim:
                    if not self.config.sequence_parallel:
                        raise ValueError("multi-latent attention with TP > 1 needs sequence parallelism")
                    kv_combined = scatter_to_sequence_parallel_region(
                        gather_from_tensor_model_parallel_region(kv_combined)
                    )
                return q_compressed, kv_combined

            def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
                if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
                    return super()._resolve_qk_norm_config(submodules)
                return dict(
                    linear_q_proj=submodules.linear_q_proj,
                    linear_q_up_proj=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj,
                    q_layernorm=IdentityOp,
                    kv_layernorm=submodules.kv_layernorm,
                )

        _LOCAL_MLA = LocalMLASelfAttention
    return _LOCAL_MLA


_LOCAL_MLA: type | None = None


class ExpertBiasRowParallelLinear(RowParallelLinear):
    """An expert's fc2 with a bias (gpt-oss), as megatron-core's local spec gets two things wrong for it.

    - Gradient: `RowParallelLinear` tags its bias `sequence_parallel` under SP, so `finalize_model_grads`
      sums its gradient over the TP group; but every TP rank of an expert already holds the whole
      gradient of its tokens (the expert-data-parallel reduction adds the ranks up), so TP2 doubled it.
      The tag is dropped (measured: TP2 expert fc2-bias gradient off by 0.03, then equal to one process).
    - In-place add: `MLP.forward` adds the skipped bias scaled by the routing probability in place
      (`output += bias * prob`). On one expert-TP rank without EP, `RowParallelLinear` returns its output
      through megatron's reduce (an autograd Function that hands its input back), a view autograd refuses
      to modify in place in training; that case returns a copy (one copy of the expert's output rows).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.sequence_parallel = False

    def forward(self, input_: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None and not self.explicit_expert_comm:
            output = output.clone()
        return output, bias
