"""megatron-core `TransformerConfig` and `GPTModel` chunks from a framework-neutral `ModelArch`.

Covers the Llama, Qwen2 (qkv bias), Qwen3 (qk-norm), Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5 and gpt-oss
shapes: GQA (partial rotary; learned sinks, sliding windows per layer, YaRN) or multi-latent attention
(megatron's `MLASelfAttention`, YaRN), RoPE theta, RMSNorm eps, SwiGLU (or gpt-oss's clamped one), biases
on every linear layer (gpt-oss), tied or untied embeddings, routed experts with top-k (softmax or sigmoid
scores, renormalised top-k or not, a selection-only expert bias held frozen, group-limited top-k, a scaling
factor), optional shared experts and dense layers, optional routing replay (issue 7). All of it is read
off `ModelArch`.

Backends: on the CPU the local spec in fp32 (with `attention.TorchCoreAttention`, so packed THD
batches work without Transformer Engine); on a GPU the Transformer Engine spec in bf16, optionally
FP8 through megatron's `fp8`/`fp8_recipe`.

Parameter names (`GPTModel.state_dict()`, per rank; i = local layer index of this pipeline chunk,
H hidden, V_p padded vocab, n/g query heads/KV groups, d head dim, F dense FFN, F_e expert FFN,
E experts, tp/etp/ep the mesh sizes). The bridge maps Hugging Face names onto these:

    embedding.word_embeddings.weight                         [V_p/tp, H]     (first stage)
    decoder.layers.{i}.input_layernorm.weight                [H]             (local spec)
    decoder.layers.{i}.self_attention.linear_qkv.weight      [g*(n/g+2)*d/tp, H]  per KV group: q heads, k, v
    decoder.layers.{i}.self_attention.linear_qkv.bias        [g*(n/g+2)*d/tp]     (qwen2)
    decoder.layers.{i}.self_attention.q_layernorm.weight     [d]             (qwen3, qwen3_moe)
    decoder.layers.{i}.self_attention.k_layernorm.weight     [d]
    decoder.layers.{i}.self_attention.linear_proj.weight     [H, n*d/tp]
    decoder.layers.{i}.self_attention.linear_proj.bias       [H]             (gpt-oss; and every bias below)
    decoder.layers.{i}.self_attention.core_attention.softmax_offset  [n/tp]  (gpt-oss's sinks)
  multi-latent attention instead (r_q/r_kv latent ranks, d_n/d_r/d_v nope/rope/value head dims):
    decoder.layers.{i}.self_attention.linear_q_down_proj.weight  [r_q/tp, H]    (gathered after; or
    decoder.layers.{i}.self_attention.q_layernorm.weight         [r_q]           linear_q_proj [n*(d_n+d_r)/tp, H]
    decoder.layers.{i}.self_attention.linear_q_up_proj.weight    [n*(d_n+d_r)/tp, r_q]    without a q latent)
    decoder.layers.{i}.self_attention.linear_kv_down_proj.weight [(r_kv+d_r)/tp, H]
    decoder.layers.{i}.self_attention.kv_layernorm.weight        [r_kv]
    decoder.layers.{i}.self_attention.linear_kv_up_proj.weight   [n*(d_n+d_v)/tp, r_kv]
    decoder.layers.{i}.self_attention.linear_proj.weight         [H, n*d_v/tp]
    decoder.layers.{i}.pre_mlp_layernorm.weight              [H]
  dense layer:
    decoder.layers.{i}.mlp.linear_fc1.weight                 [2*F/tp, H]     rows [gate_shard; up_shard]
    decoder.layers.{i}.mlp.linear_fc2.weight                 [H, F/tp]
  MoE layer (local spec: SequentialMLP, one module per local expert):
    decoder.layers.{i}.mlp.router.weight                     [E, H]          (replicated)
    decoder.layers.{i}.mlp.router.expert_bias                [E] fp32 BUFFER (sigmoid routers; frozen)
    decoder.layers.{i}.mlp.router.bias                       [E]             (gpt-oss: on the logits)
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight   [2*F_e/etp, H]  [gate; up]
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight   [H, F_e/etp]
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc{1,2}.bias [2*F_e/etp] / [H]  (gpt-oss)
        j is the LOCAL expert index; the global expert is ep_rank * (E/ep) + j.
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight / linear_fc2.weight / gate_weight (if any)
    decoder.final_layernorm.weight                           [H]             (last stage)
    output_layer.weight                                      [V_p/tp, H]     (last stage; absent if tied
                                                                              on a single stage)

With the TE spec (GPU) the two norms fuse into the next linear (`linear_qkv.layer_norm_weight`,
dense `mlp.linear_fc1.layer_norm_weight`) and grouped experts are `mlp.experts.linear_fc1.weight{j}`.
SequentialMLP is the CPU default because it is the only expert module of the local spec (the legacy
GroupedMLP needs the CUDA grouped_gemm kernels), and its per-expert weights map one to one onto the
per-expert Hugging Face tensors. `sharded_state_dict()` (dist checkpoints) uses GLOBAL expert ids and
full-vocab shapes, independent of the mesh.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F

from megagrpo.config.model import FAMILIES, ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.learner.mesh import MeshConfig

VOCAB_MULTIPLE = 128  # vocab padding unit; lcm with tp keeps it TP-independent for tp | 128
QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: x * sigmoid(1.702 x) (Hendrycks & Gimpel, arXiv:1606.08415)

Recompute = Literal["full", "selective"] | None


def padded_vocab_size(arch: ModelArch, tp: int) -> int:
    """Vocab padded to a multiple of lcm(128, tp): splits evenly over TP and stays the same for every
    tp dividing 128, so checkpoints reshard across meshes. Rows >= arch.vocab_size are never targets;
    the learner masks their logits."""
    return arch.padded_vocab_size(math.lcm(VOCAB_MULTIPLE, tp))


def _check_arch(arch: ModelArch, mesh: MeshConfig) -> None:
    if arch.family not in FAMILIES:
        raise MegagrpoError(f"model family {arch.family!r} is not supported; use one of {FAMILIES}")
    if arch.is_mla and arch.num_kv_heads != arch.num_attention_heads:
        raise MegagrpoError("multi-latent attention needs num_kv_heads == num_attention_heads")
    if arch.is_mla and arch.v_head_dim > arch.qk_nope_head_dim + arch.qk_rope_head_dim:
        # megatron's MLA pads packed (THD) values to the query head dim: F.pad by a negative width cuts them
        raise MegagrpoError(
            f"v_head_dim={arch.v_head_dim} is wider than the query head (qk_nope_head_dim + qk_rope_head_dim = "
            f"{arch.qk_nope_head_dim + arch.qk_rope_head_dim}), which megatron-core's multi-latent attention cuts"
        )
    if arch.rope_type not in ("default", "yarn") or (
        arch.rope_type == "yarn" and not arch.is_mla and arch.rotary_percent != 1.0
    ):
        raise MegagrpoError(
            f"rope_type={arch.rope_type!r} with rotary_percent={arch.rotary_percent}: YaRN is implemented "
            "with multi-latent attention or with whole heads rotated"
        )
    if (
        arch.rope_type == "yarn"
        and not arch.is_mla
        and (arch.rope_mscale, arch.rope_mscale_all_dim) != (1, 0)
    ):
        raise MegagrpoError(
            f"rope_mscale={arch.rope_mscale}, rope_mscale_all_dim={arch.rope_mscale_all_dim}: YaRN without "
            "multi-latent attention is implemented with the default attention factor (0.1 ln(factor) + 1)"
        )
    biases = {"qkv_bias": arch.qkv_bias, "attn_out_bias": arch.attn_out_bias}
    if arch.is_moe:
        biases.update(moe_router_bias=arch.moe_router_bias, moe_expert_bias=arch.moe_expert_bias)
    # megatron's add_bias_linear puts a bias on every linear layer at once (qkv, proj, router, fc1/fc2)
    if (arch.attn_out_bias or arch.moe_router_bias or arch.moe_expert_bias) and (
        not all(biases.values()) or len(arch.moe_layers()) != arch.num_layers
    ):
        raise MegagrpoError(
            f"biases {biases} in {arch.family}: megatron-core biases every linear layer or none (and dense "
            "MLP layers would get biases the checkpoint lacks)"
        )
    if arch.swiglu_limit > 0 and arch.swiglu_alpha != QUICK_GELU_ALPHA:
        raise MegagrpoError(
            f"swiglu_alpha={arch.swiglu_alpha}: megatron's clamped SwiGLU uses quick_gelu, whose sigmoid gain "
            f"is {QUICK_GELU_ALPHA}"
        )
    if arch.swiglu_limit <= 0 and (arch.swiglu_alpha != 1.0 or arch.swiglu_up_offset != 0.0):
        raise MegagrpoError(
            f"swiglu_alpha={arch.swiglu_alpha}, swiglu_up_offset={arch.swiglu_up_offset} without a clamp "
            "(swiglu_limit) are not implemented"
        )
    if arch.layer_types and len(arch.layer_types) != arch.num_layers:
        raise MegagrpoError(f"layer_types has {len(arch.layer_types)} entries for {arch.num_layers} layers")
    if arch.sliding_layers() and arch.sliding_window < 1:
        raise MegagrpoError("sliding_attention layers need sliding_window >= 1")
    if arch.num_attention_heads % arch.num_kv_heads:
        raise MegagrpoError(
            f"num_attention_heads={arch.num_attention_heads} is not a multiple of num_kv_heads="
            f"{arch.num_kv_heads}"
        )
    if arch.num_attention_heads % mesh.tp:
        raise MegagrpoError(
            f"num_attention_heads={arch.num_attention_heads} is not divisible by mesh.tp={mesh.tp}"
        )
    if arch.num_kv_heads % mesh.tp and mesh.tp % arch.num_kv_heads:
        raise MegagrpoError(
            f"num_kv_heads={arch.num_kv_heads} and mesh.tp={mesh.tp}: one must divide the other"
        )
    mesh.stage_layer_counts(arch.num_layers)  # MegagrpoError naming mesh.* when the stages cannot add up
    if arch.is_moe:
        if arch.num_experts % mesh.ep:
            raise MegagrpoError(f"num_experts={arch.num_experts} is not divisible by mesh.ep={mesh.ep}")
        if not 0 < arch.moe_topk <= arch.num_experts:
            raise MegagrpoError(f"moe_topk={arch.moe_topk} must be in [1, num_experts={arch.num_experts}]")
        if mesh.tp > 1 and not mesh.sequence_parallel:
            raise MegagrpoError(
                f"MoE with mesh.tp={mesh.tp} needs sequence parallelism (megatron-core requirement): set "
                "mesh.sequence_parallel=true"
            )
        if arch.moe_router_score_function not in ("softmax", "sigmoid"):
            raise MegagrpoError(
                f"moe_router_score_function={arch.moe_router_score_function!r}; use softmax or sigmoid"
            )
        if (
            arch.moe_router_score_function == "sigmoid"
            and not arch.moe_renormalize_topk
            and arch.moe_topk > 1
        ):
            raise MegagrpoError("a sigmoid router with moe_topk > 1 is always renormalised by megatron-core")
        if arch.moe_router_score_function == "sigmoid" and arch.moe_renormalize_topk and arch.moe_topk == 1:
            raise MegagrpoError(
                "a renormalised sigmoid router with moe_topk=1 combines its expert with weight 1 (transformers), "
                "megatron-core with the sigmoid score and has no setting for 1"
            )
        if arch.num_experts % arch.moe_router_num_groups:
            raise MegagrpoError(
                f"num_experts={arch.num_experts} does not split into moe_router_num_groups={arch.moe_router_num_groups}"
            )
        per_group = arch.num_experts // arch.moe_router_num_groups
        if arch.moe_router_num_groups > 1 and (
            per_group < 2 or arch.moe_topk > arch.moe_router_group_topk * per_group
        ):
            # a group is scored by its top-2 experts (moe.group_topk), and the top-k come from the kept groups
            raise MegagrpoError(
                f"moe_router_num_groups={arch.moe_router_num_groups}, moe_router_group_topk="
                f"{arch.moe_router_group_topk}, moe_topk={arch.moe_topk}: each group needs 2 experts and the "
                "kept groups at least moe_topk"
            )
    elif mesh.ep > 1 or mesh.etp > 1:
        raise MegagrpoError(f"mesh.ep={mesh.ep}/etp={mesh.etp} > 1 needs a MoE model; {arch.family} is dense")


def use_transformer_engine(
    layer_spec: str = "auto",
    *,
    arch: ModelArch | None = None,
    dtype: torch.dtype | None = None,
    fp8: str | None = None,
) -> bool:
    """Whether the learner builds megatron's Transformer Engine layers.

    `auto` takes TE where it can run (CUDA and the package present) and where it computes what was asked:
    not for an fp32 learner without FP8, since TE's GEMMs take fp32 inputs in TF32 (10-bit mantissa:
    1.7e-4 nats from the fp32 reference on an H200, against 9.5e-7 on the local spec), and not for
    multi-latent attention, whose TE names the bridge does not map yet. `transformer_engine` insists on
    TE, and refuses what it cannot build."""
    fp8 = None if fp8 in (None, "none") else fp8
    mla = arch is not None and arch.is_mla
    # gpt-oss's sinks and expert biases on TE: names the bridge does not map, and TE's grouped experts lack
    # the local spec's expert-bias fixes (attention.ExpertBiasRowParallelLinear); unproven, so kept local
    oss = arch is not None and (arch.attention_sinks or arch.moe_expert_bias)
    if layer_spec == "local":
        return False
    if oss:
        if layer_spec == "transformer_engine" or fp8:
            raise MegagrpoError(
                f"{arch.family}: attention sinks and expert biases on the Transformer Engine spec are not "
                "mapped yet; set model.layer_spec=local" + (" and model.fp8=null" if fp8 else "")
            )
        return False
    if layer_spec == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            raise MegagrpoError(
                "model.layer_spec=transformer_engine, but Transformer Engine is not installed; "
                "install the gpu extra (pip install 'megagrpo[gpu]') or set model.layer_spec=local"
            )
    else:
        runs = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
        if not runs or (fp8 is None and (mla or dtype == torch.float32)):
            return False
    if mla:
        raise MegagrpoError(
            f"{arch.family}: multi-latent attention on the Transformer Engine spec is not mapped yet"
            + (" (model.fp8 needs that spec); set model.fp8=null" if fp8 else "; set model.layer_spec=local")
        )
    return True


def transformer_config_from_arch(
    arch: ModelArch,
    mesh_cfg: MeshConfig,
    *,
    dtype: torch.dtype = torch.float32,
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
    recompute: Recompute = None,
    routing_replay: bool = False,
    layer_spec: str = "auto",
    router_bias_update_rate: float = 0.0,
    **overrides: Any,
) -> Any:
    """A megatron `TransformerConfig` for `arch` on `mesh_cfg`.

    fp8: None/"none", "hybrid" or "e4m3" (TE only); fp8_recipe "delayed" or "blockwise".
    recompute: None, "full" (every layer, uniform) or "selective" (core attention).
    routing_replay: sets `moe_enable_routing_replay` so megatron's `RouterReplay` can record/replay.
    router_bias_update_rate: megatron's expert-bias update per optimizer step (0 freezes the bias).
    overrides: any further TransformerConfig field (wins over the derived values).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    _check_arch(arch, mesh_cfg)
    if router_bias_update_rate and not arch.moe_router_expert_bias:
        raise MegagrpoError(
            f"model.router_bias_update_rate={router_bias_update_rate}: {arch.family} has no router "
            "correction bias to update; set it to 0"
        )
    te = use_transformer_engine(layer_spec, arch=arch, dtype=dtype, fp8=fp8)
    fp8 = None if fp8 in (None, "none") else fp8
    if fp8 is not None and not te:
        raise MegagrpoError("model.fp8 needs the Transformer Engine layer spec on a GPU; set model.fp8=null")
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=mesh_cfg.tp,
        pipeline_model_parallel_size=mesh_cfg.pp,
        virtual_pipeline_model_parallel_size=mesh_cfg.vpp if mesh_cfg.vpp and mesh_cfg.vpp > 1 else None,
        # uneven stages: megatron builds, offsets and checkpoints the layers by these counts
        num_layers_in_first_pipeline_stage=mesh_cfg.first_stage_layers,
        num_layers_in_last_pipeline_stage=mesh_cfg.last_stage_layers,
        context_parallel_size=mesh_cfg.cp,
        expert_model_parallel_size=mesh_cfg.ep,
        expert_tensor_parallel_size=mesh_cfg.etp,
        sequence_parallel=mesh_cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # RL batches change sequence length between micro-batches; PP stages exchange shapes first.
        variable_seq_lengths=True,
        # Micro-batch losses arrive already divided by the global normaliser: no division by the
        # micro-batch count in the schedule, and DP gradients are summed, not averaged.
        calculate_per_token_loss=True,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl="transformer_engine" if te else "local",
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        masked_softmax_fusion=te,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=te,
        attention_softmax_in_fp32=True,
        # alltoall is the dispatcher that supports every EP x ETP combination; it is also set for dense
        # models because TransformerConfig rejects the default "allgather" with variable_seq_lengths.
        moe_token_dispatcher_type="alltoall",
    )
    if arch.attn_out_bias:
        kw["add_bias_linear"] = True  # q/k/v, o, router and experts (checked in _check_arch)
    if arch.swiglu_limit > 0:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        # gpt-oss's clamped SwiGLU: megatron's glu() clamps the gate above and the linear half both ways
        kw.update(
            activation_func=quick_gelu,
            activation_func_clamp_value=arch.swiglu_limit,
            glu_linear_offset=arch.swiglu_up_offset,
        )
    if arch.attention_sinks:
        kw["softmax_type"] = "learnable"  # one sink logit per head: megatron's softmax_offset
    if arch.sliding_layers():
        # megatron's window (left, right): keys i - left .. i; transformers' sliding window counts the
        # query itself, so left = window - 1. window_attn_skip_freq as a list marks the sliding layers.
        kw.update(
            window_size=(arch.sliding_window - 1, 0),
            window_attn_skip_freq=[int(t == "sliding_attention") for t in arch.layer_types],
        )
    if arch.is_mla:
        # megatron's MLASelfAttention: its latent norms are the q/kv "layernorms", RoPE on interleaved
        # pairs of the rotary dims (DeepSeek's layout), YaRN with DeepSeek's mscale in the softmax scale.
        yarn = arch.rope_type == "yarn"
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=arch.q_lora_rank,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.qk_nope_head_dim,
            qk_pos_emb_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.v_head_dim,
            qk_layernorm=True,
            rope_type="yarn" if yarn else "rope",
            rotary_base=arch.rope_theta,
            rotary_percent=1.0,
            rotary_scaling_factor=arch.rope_scaling_factor,
            original_max_position_embeddings=arch.rope_original_max_position_embeddings
            or arch.max_position_embeddings,
            beta_fast=arch.rope_beta_fast,
            beta_slow=arch.rope_beta_slow,
            mscale=arch.rope_mscale,
            mscale_all_dim=arch.rope_mscale_all_dim if yarn else 0.0,
        )
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
            # pre_softmax=True: softmax over all experts, then take the top-k probabilities as they are.
            # pre_softmax=False: top-k logits first, then softmax over them (= renormalised top-k).
            moe_router_pre_softmax=not arch.moe_renormalize_topk,
            moe_router_score_function=arch.moe_router_score_function,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_grouped_gemm=te,
            moe_layer_freq=list(arch.moe_layer_pattern) if arch.moe_layer_pattern else 1,
            moe_enable_routing_replay=routing_replay,
        )
        if arch.moe_router_score_function == "sigmoid" and arch.moe_renormalize_topk and arch.moe_topk > 1:
            # sigmoid scores are renormalised over the chosen experts by megatron when topk > 1.
            kw["moe_router_pre_softmax"] = False
        if arch.moe_shared_expert_ffn_hidden_size:
            kw.update(
                moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size,
                moe_shared_expert_gate=arch.moe_shared_expert_gate,
            )
        if arch.moe_router_expert_bias:
            # The correction bias is a buffer, not a parameter: no optimizer touches it. Megatron moves it
            # in finalize_model_grads by its aux-loss-free rule at moe_router_bias_update_rate; 0 (the
            # default) freezes it, so RL keeps the checkpoint's bias (and the sampler's routing) unchanged.
            kw.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=router_bias_update_rate)
        if arch.moe_router_num_groups > 1:
            kw.update(
                moe_router_num_groups=arch.moe_router_num_groups,
                moe_router_group_topk=arch.moe_router_group_topk,
            )
        if arch.moe_router_topk_scaling_factor != 1.0:
            kw["moe_router_topk_scaling_factor"] = arch.moe_router_topk_scaling_factor
    elif routing_replay:
        raise MegagrpoError(f"routing replay needs a MoE model; {arch.family} is dense: set replay: none")
    if fp8 is not None:
        kw.update(fp8=fp8, fp8_recipe=fp8_recipe)
        if arch.is_moe:
            # FP8 grouped GEMMs need every expert's token count a multiple of 16: the alltoall dispatcher
            # pads the routing map (padded slots carry probability 0, after routing replay has recorded).
            kw["moe_router_padding_for_quantization"] = True
        if fp8_recipe == "delayed":
            kw.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute is not None:
        raise MegagrpoError(f"recompute={recompute!r}; use null, 'full' or 'selective'")
    kw.update(overrides)
    try:
        config = (MLATransformerConfig if arch.is_mla else TransformerConfig)(**kw)
    except (AssertionError, ValueError) as e:
        raise MegagrpoError(f"megatron-core rejected the model/mesh combination: {e}") from e
    if arch.rope_type == "yarn" and not arch.is_mla:
        # GPTModel's YarnRotaryEmbedding and SelfAttention's rotary mscale read these attributes, which
        # TransformerConfig does not declare (MLATransformerConfig has its own names)
        config.yarn_rotary_scaling_factor = arch.rope_scaling_factor
        config.yarn_original_max_position_embeddings = arch.rope_original_max_position_embeddings
        config.yarn_beta_fast = arch.rope_beta_fast
        config.yarn_beta_slow = arch.rope_beta_slow
        config.yarn_mscale = arch.rope_mscale
        config.yarn_mscale_all_dim = arch.rope_mscale_all_dim
        config.yarn_correction_range_round_to_int = arch.rope_truncate
    return config


def _local_block_spec(config: Any, vp_stage: int | None, pp_rank: int | None) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megagrpo.learner.attention import TorchCoreAttention, local_mla_self_attention

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
    )
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, core_attention=TorchCoreAttention)
        )
        if config.multi_latent_attention:
            attn = dataclasses.replace(attn, module=local_mla_self_attention())
        layer.submodules.self_attention = attn
        if config.add_bias_linear and config.num_moe_experts:
            layer.submodules.mlp = _with_expert_fc2(layer.submodules.mlp)
    return spec


def _with_expert_fc2(mlp: Any) -> Any:
    """The MoE layer spec `mlp` (partial(MoELayer, submodules=...)) with `ExpertBiasRowParallelLinear` as
    the experts' fc2; a dense layer's spec unchanged."""
    import functools

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megagrpo.learner.attention import ExpertBiasRowParallelLinear

    if not isinstance(mlp, functools.partial) or mlp.func is not MoELayer:
        return mlp
    subs = mlp.keywords["submodules"]
    experts = subs.experts
    inner = dataclasses.replace(experts.keywords["submodules"], linear_fc2=ExpertBiasRowParallelLinear)
    experts = functools.partial(experts.func, *experts.args, **{**experts.keywords, "submodules": inner})
    subs = dataclasses.replace(subs, experts=experts)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})


def build_gpt_model(
    arch: ModelArch,
    mesh_cfg: MeshConfig,
    *,
    dtype: torch.dtype = torch.float32,
    fp8: str | None = None,
    fp8_recipe: str = "delayed",
    recompute: Recompute = None,
    routing_replay: bool = False,
    layer_spec: str = "auto",
    router_bias_update_rate: float = 0.0,
    config_overrides: dict[str, Any] | None = None,
) -> list[Any]:
    """This rank's `GPTModel` chunks (one per virtual pipeline stage; one chunk without VPP).

    Needs `init_mesh(mesh_cfg)` first. Weights are randomly initialised (seeded by `init_mesh`); the
    bridge or a checkpoint loads real ones. Parameters live on the current device in `dtype`.
    """
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model needs init_mesh() first")
    te = use_transformer_engine(layer_spec, arch=arch, dtype=dtype, fp8=fp8)
    config = transformer_config_from_arch(
        arch,
        mesh_cfg,
        dtype=dtype,
        fp8=fp8,
        fp8_recipe=fp8_recipe,
        recompute=recompute,
        routing_replay=routing_replay,
        layer_spec=layer_spec,
        router_bias_update_rate=router_bias_update_rate,
        **(config_overrides or {}),
    )
    vpp = mesh_cfg.vpp if mesh_cfg.vpp and mesh_cfg.vpp > 1 else None
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        if te:
            spec = get_gpt_decoder_block_spec(
                config,
                use_transformer_engine=True,
                normalization="RMSNorm",
                vp_stage=vp_stage,
                pp_rank=pp_rank,
            )
        else:
            spec = _local_block_spec(config, vp_stage, pp_rank)
        if arch.is_moe and arch.moe_router_num_groups > 1:
            from megagrpo.moe.group_topk import with_model_group_rule

            with_model_group_rule(spec)  # the group score the model computes, not megatron's
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(arch, mesh_cfg.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,  # logits stay vocab-sharded; learner.logprobs reduces over TP
            share_embeddings_and_output_weights=arch.tie_embeddings,
            position_embedding_type="yarn" if arch.rope_type == "yarn" and not arch.is_mla else "rope",
            rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
            rotary_percent=arch.rotary_percent,
            vp_stage=vp_stage,
        )
        model.model_type = ModelType.encoder_or_decoder
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def model_config(chunks: list[Any]) -> Any:
    """The TransformerConfig shared by the chunks (unwrapping DDP/Float16Module)."""
    m = chunks[0]
    while hasattr(m, "module") and not hasattr(m, "config"):
        m = m.module
    return m.config


def wrap_ddp(
    chunks: list[Any], *, distributed_optimizer: bool = True, bucket_size: int | None = None
) -> list[Any]:
    """Wrap model chunks in megatron's `DistributedDataParallel` (contiguous fp32 grad buffers).

    Grads are SUMMED over data-parallel ranks (`calculate_per_token_loss=True` sets megatron's DP
    gradient scaling to 1): every micro-batch loss is already divided by the global normaliser, so
    the sum over ranks is the gradient of the whole batch. `param.main_grad` holds the result after
    `finalize_model_grads`.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        if not chunk.config.calculate_per_token_loss:
            raise ValueError(
                "build the model with transformer_config_from_arch (calculate_per_token_loss=True)"
            )
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Only the first chunk's buffers are bucketed (megatron's convention for VPP).
                disable_bucketing=i > 0,
            )
        )
    return wrapped
