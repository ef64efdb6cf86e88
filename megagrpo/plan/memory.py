"""The memory plan: bytes per GPU of a colocated megagrpo job, from the model's `config.json` alone.
(A disaggregated job's two pools of GPUs: `plan/pools.py`, on the same arithmetic; the plan of either
kind from a config: `plan/job.py`.)

Pure arithmetic on a `ModelArch`, the mesh and the config; no torch, no process group, no weights, so a
user can plan before downloading anything. What it models, and from which code:

Learner state (`learner_state_bytes`), as megatron-core 0.19 allocates it for `learner.model.wrap_ddp`
and `learner.optimizer.build_optimizer`:
  - every trainable tensor of one rank (TP/PP/EP/ETP split, embedding on the first pipeline stage,
    final norm and output layer on the last; see the name table in `learner/model.py`);
  - `DistributedDataParallel` groups them into one contiguous buffer per (dtype, expert or not)
    (`distributed/param_and_grad_buffer.py: group_params_for_buffers`). One bucket per buffer because
    `overlap_grad_reduce=False`. With the DistributedOptimizer each tensor starts on a 64-element
    boundary and the buffer ends on a multiple of lcm(DP, 128) (`optimizer/param_layout.py`), and the
    parameters become views into a param buffer of the same padded size;
  - gradients: the grad buffer, fp32 because megagrpo sets `grad_reduce_in_fp32=True`;
  - optimizer: Adam's exp_avg and exp_avg_sq in fp32, plus an fp32 master copy when the parameters
    are 16-bit (`Float16OptimizerWithFloat16Params`, or `shard_fp32_from_float16_groups` of the
    DistributedOptimizer). fp32 parameters have no master copy (`FP32Optimizer`, or the shard is a view).
    The DistributedOptimizer shards all of it over the data-parallel group of the buffer: DP x CP for
    dense tensors, expert-DP = world / (EP x ETP x PP) for experts.

Activations (`activation_bytes`): an estimate of the tensors autograd saves, per token and layer, with
the Transformer Engine spec (flash attention: no [T, T] score matrix) in the learner dtype:
  attention  2H/s + 2(n+g)d/tp           norm input and output, q/k/v after RoPE and the attention output
  dense MLP  2H/s + 3F/tp                norm input and output, fc1 output (SwiGLU input), fc2 input
  MoE        2H/s (norm) + fp32 router input H/s and logits/probs 2E/s,
             + (k/s)(2H*etp + 3F_e)      per routed copy: permuted input, fc1 output, fc2 input, fc2 output
where s = tp with sequence parallelism else 1. A micro-batch of B x T tokens saves L_stage layers of
that plus one layer's worth of transient gradients in backward (full recompute: only each layer's H/s
input, plus the one layer being recomputed). The first pipeline stage holds min(PP, micro-batches) micro-batches
in flight (1F1B); the last stage also holds the logits [T, V/tp], their gradient, and two fp32 blocks of
`chunk_tokens` rows (`learner/logprobs.py`). Not modelled: the allocator's fragmentation, and the CPU
spec's `TorchCoreAttention`, which saves [T, T] scores (CPU only).

Multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight) has its own tensors (`attention_numels`) and
saves per token q and k of n(d_n+d_r)/tp, v and the output of n d_v/tp, the kv up projection's output
n(d_n+d_v)/tp, and the latents (2 r_q + 2 r_kv + d_r) instead of the GQA attention term above.
Multi-token-prediction layers are neither trained nor served: they count nowhere.

Engine (SGLang, `plan/engine_rank.py`): weights = each rank's shard of the parameters SGLang splits over
engine_tp plus the ones it replicates (MLA's down projections, norms, routers) x the rollout dtype; its
static pool is mem_fraction_static x GPU memory, and the KV cache is that pool minus the weights. One KV
token takes 2 x layers x max(1, kv_heads / engine_tp) x head_dim x dtype bytes (kv heads are replicated
when the engine TP exceeds them); with multi-latent attention layers x (kv_lora_rank + qk_rope_head_dim)
x dtype bytes on every engine rank: the latent, not K and V.

Phases (`trainer/samplers.py`): the learner and the engine take turns on the device. The engine
releases its weights and KV cache before the learner reloads; the learner offloads all of its state to
host memory (`Learner.offload`) before the engine resumes. The weight sync resumes the engine's weights
beside the reloaded learner. So a GPU must hold
  rollout:  the engine's static pool (plus the learner state, for frameworks that keep it resident),
            and the step's rows in flight: they move while the engine holds its pool, through NCCL,
            i.e. device memory (`rows_wire_bytes`)
  training: learner state (+ resident reference) + activations and logits of the micro-batches in flight
  sync:     learner state (+ resident reference) + the engine's weight shard + two export buckets
each within the GPU memory minus `RESERVE_GIB` (CUDA contexts of the learner and the SGLang
scheduler, NCCL buffers, SGLang's CUDA graphs and sampling buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from megagrpo.config.mesh_rules import layers_of_stage, mesh_sizes, stage_layer_counts
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.plan.engine_rank import (  # re-exported: the engine's side of the plan, a room below this one
    GIB,
    EngineSpan,
    dtype_bytes,
    engine_weight_bytes,
    gqa_numels,
    kv_bytes_per_token,
)

if TYPE_CHECKING:
    from megagrpo.plan.host import HostPlan

# Vocab padding unit; the same as `megagrpo.learner.model.VOCAB_MULTIPLE` (a unit test holds them equal).
VOCAB_MULTIPLE = 128
PARAM_ALIGN = 64  # megatron `pad_param_start`: each tensor starts on a 64-element boundary
BUFFER_ALIGN = 128  # megatron `pad_bucket_end`: a bucket ends on a multiple of lcm(DP, 128)
RESERVE_GIB = 4.0  # CUDA contexts (2 x ~0.5), NCCL buffers (~1), SGLang CUDA graphs/sampling (~1-2)
LOGPROB_CHUNK_TOKENS = 1024  # learner.LearnerConfig.chunk_tokens: rows of fp32 logits worked on at once
# The data plane's wire piece; the same as `megagrpo.rollout.groups.WIRE_CHUNK_BYTES` (a unit test holds
# them equal). Pickled scalars of the step's rows (`trainer.rows.row_scalars`), upper bounds that a unit
# test measures: per group its position and scores tensor, per row 3 ints, per score 4 bytes.
ROWS_WIRE_CHUNK_BYTES = 64 << 20
GROUP_SCALAR_BYTES = 512
ROW_SCALAR_BYTES = 16

Recompute = Literal["none", "full"]


# ------------------------------------------------------------------------------------------ the mesh


@dataclass(frozen=True)
class PlanMesh:
    """Learner mesh sizes; DP and expert-DP follow from `world_size` as in `config.check_mesh`."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None  # uneven stages (mesh.first/last_stage_layers); None = even
    last_stage_layers: int | None = None

    @classmethod
    def of(cls, mesh: Any, world_size: int) -> PlanMesh:
        """From any object with tp/pp/ep/etp(/cp/sequence_parallel/first,last_stage_layers) attributes
        (either MeshConfig)."""
        if isinstance(mesh, PlanMesh):
            return replace(mesh, world_size=world_size)
        return cls(
            world_size=world_size,
            tp=mesh.tp,
            pp=mesh.pp,
            ep=mesh.ep,
            etp=mesh.etp,
            cp=getattr(mesh, "cp", 1),
            sequence_parallel=bool(getattr(mesh, "sequence_parallel", False)),
            first_stage_layers=getattr(mesh, "first_stage_layers", None),
            last_stage_layers=getattr(mesh, "last_stage_layers", None),
        )

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Global decoder-layer indices of pipeline `stage` (megatron's split, `mesh_rules.stage_layer_counts`):
        the plan sizes each stage by its own layers, and a GPU by the largest stage."""
        counts = stage_layer_counts(num_layers, self.pp, self.first_stage_layers, self.last_stage_layers)
        return layers_of_stage(counts, stage)

    def stages_note(self, num_layers: int) -> str:
        """` (layers per stage: 5+7x8)` for uneven stages; empty otherwise (the even split is implied)."""
        if self.first_stage_layers is None and self.last_stage_layers is None:
            return ""
        c = stage_layer_counts(num_layers, self.pp, self.first_stage_layers, self.last_stage_layers)
        first = [c[0]] if self.first_stage_layers is not None else []
        last = [c[-1]] if self.last_stage_layers is not None else []
        middle = len(c) - len(first) - len(last)
        parts = (
            [str(x) for x in first]
            + ([f"{c[len(first)]}x{middle}"] if middle else [])
            + [str(x) for x in last]
        )
        return f" (layers per stage: {'+'.join(parts)})"

    def check(self) -> None:
        """The one divisibility rule (`config.mesh_rules.mesh_sizes`), on the planned number of GPUs."""
        mesh_sizes(self.world_size, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp)

    @property
    def dp(self) -> int:
        """The DistributedOptimizer's dense shard group: DP x CP = world / (TP x PP)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.ep * self.etp * self.pp)

    @property
    def seq_shard(self) -> int:
        """How many ranks share one token's norm/residual activations (TP under sequence parallelism)."""
        return self.tp if self.sequence_parallel else 1


# -------------------------------------------------------------------------------------- the tensors


def padded_vocab(arch: ModelArch, tp: int) -> int:
    """= `learner.model.padded_vocab_size`: the vocab padded to lcm(128, tp)."""
    return arch.padded_vocab_size(math.lcm(VOCAB_MULTIPLE, tp))


def stage_tensor_numels(arch: ModelArch, mesh: PlanMesh, stage: int) -> tuple[list[int], list[int]]:
    """Element counts of the trainable tensors on one rank of pipeline `stage`: (dense, expert).

    Mirrors the per-rank shapes in `learner/model.py`'s name table. Expert tensors are the ones megatron
    marks `allreduce=False` (separate buffer, expert-DP group) when EP > 1 or ETP != TP; otherwise they
    share the dense buffer, which `learner_state_bytes` handles.
    """
    H, n, g = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads
    tp, pp = mesh.tp, mesh.pp
    layers = mesh.stage_layers(arch.num_layers, stage)  # MegagrpoError naming mesh.* if they cannot add up
    if n % tp or (g % tp and tp % g):
        raise MegagrpoError(f"attention heads {n}/{g} (q/kv) do not split over mesh.tp={tp}")
    moe = set(arch.moe_layers())
    attention = attention_numels(arch, tp)  # GQA or multi-latent, per TP rank
    dense: list[int] = []
    expert: list[int] = []
    vocab_rows = padded_vocab(arch, tp) // tp
    if stage == 0:
        dense.append(vocab_rows * H)  # embedding.word_embeddings
    for layer in layers:
        dense += [H, *attention, H]  # input norm, attention, pre-MLP norm
        if layer in moe:
            E, Fe, etp = arch.num_experts, arch.moe_ffn_hidden_size or arch.ffn_hidden_size, mesh.etp
            if E % mesh.ep or Fe % etp:
                raise MegagrpoError(f"{E} experts of width {Fe} do not split over ep={mesh.ep}, etp={etp}")
            dense.append(E * H)  # router, replicated
            expert += [2 * Fe // etp * H, H * Fe // etp] * (E // mesh.ep)
            Fs = arch.moe_shared_expert_ffn_hidden_size
            if Fs:
                dense += [2 * Fs // tp * H, H * Fs // tp]
                if arch.moe_shared_expert_gate:
                    dense.append(H)
        else:
            F = arch.ffn_hidden_size
            dense += [2 * F // tp * H, H * F // tp]
    if stage == pp - 1:
        dense.append(H)  # final norm
        if not arch.tie_embeddings or pp > 1:
            dense.append(vocab_rows * H)  # output_layer (a separate copy when tied across stages)
    return dense, expert


def model_numel(arch: ModelArch) -> int:
    """All parameters of the model, counted once (what the engine loads). Multi-token-prediction layers
    (`arch.mtp_layers`) are not counted: the learner does not build them and SGLang loads them only for
    speculative decoding, which megagrpo's engines do not run."""
    dense, expert = stage_tensor_numels(arch, PlanMesh(world_size=1), 0)
    return sum(dense) + sum(expert)


def active_numel(arch: ModelArch, *, embeddings: bool = True) -> int:
    """Parameters one token runs through: everything but the routed experts, plus `moe_topk` of them in
    each MoE layer (shared experts and dense layers always run). `embeddings=False` leaves out the input
    embedding and the output layer, the convention some model cards use for their "active" figure."""
    H = arch.hidden_size
    dense, expert = stage_tensor_numels(arch, PlanMesh(world_size=1), 0)
    n = sum(dense)
    moe = arch.moe_layers()
    if moe:
        n += sum(expert) // (len(moe) * arch.num_experts) * arch.moe_topk * len(moe)
    if not embeddings:
        vocab = padded_vocab(arch, 1) * H
        n -= vocab * (1 if arch.tie_embeddings else 2)
    return n


def attention_numels(arch: ModelArch, tp: int) -> list[int]:
    """Element counts of one layer's attention tensors on one TP rank (`learner/model.py`'s name table).

    GQA: linear_qkv [g(n/g+2)d/tp, H] (kv heads replicated when tp exceeds them), its bias, q/k norms
    [d] and linear_proj [H, nd/tp]. Multi-latent attention (DeepSeek-V2 arXiv:2405.04434 section 2.1):
    the q latent's down projection [r_q/tp, H], norm [r_q] and up projection [n(d_n+d_r)/tp, r_q] (or one
    q projection [n(d_n+d_r)/tp, H] when q_lora_rank is null), the kv latent's down projection
    [(r_kv+d_r)/tp, H] (the latent and the shared rotary key), norm [r_kv], up projection
    [n(d_n+d_v)/tp, r_kv] (kv_b_proj: per head its no-rope key and value) and linear_proj [H, n d_v/tp].
    The local spec splits the down projections over TP (column-parallel, gathered after); Transformer
    Engine's replicates them, which adds (r_q + r_kv + d_r)(1 - 1/tp)H per layer (< 8% of DeepSeek-V3's
    attention at TP8).
    """
    H, n = arch.hidden_size, arch.num_attention_heads
    if arch.is_mla:
        qk, rq, rkv = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.q_lora_rank, arch.kv_lora_rank
        q = [n * qk // tp * H] if rq is None else [rq // tp * H, rq, n * qk // tp * rq]
        kv = [
            (rkv + arch.qk_rope_head_dim) // tp * H,
            rkv,
            n * (arch.qk_nope_head_dim + arch.v_head_dim) // tp * rkv,
        ]
        return [*q, *kv, H * n * arch.v_head_dim // tp]
    return gqa_numels(arch, tp)


# ---------------------------------------------------------------------------------- learner state


@dataclass(frozen=True)
class StateBytes:
    """Learner bytes of one rank: parameters, gradients and optimizer state (incl. fp32 master copies)."""

    params: int
    grads: int
    optimizer: int
    numel: int  # trainable elements on this rank, before padding

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _buffer_bytes(
    numels: list[int], shard: int, p_bytes: int, g_bytes: int, distributed: bool
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of one DDP buffer whose optimizer state is sharded `shard` ways."""
    if not numels:
        return 0, 0, 0
    n = sum(numels)
    if distributed:
        padded = _round_up(sum(_round_up(x, PARAM_ALIGN) for x in numels), math.lcm(shard, BUFFER_ALIGN))
        per_elem = 8 + (4 if p_bytes < 4 else 0)  # Adam moments + fp32 master when params are 16-bit
        return padded * p_bytes, padded * g_bytes, -(-n // shard) * per_elem
    per_elem = 8 + (4 if p_bytes < 4 else 0)
    return n * p_bytes, n * g_bytes, n * per_elem


def learner_state_bytes(
    arch: ModelArch,
    mesh: Any,
    world_size: int,
    *,
    param_dtype: str = "bfloat16",
    grad_dtype: str = "float32",
    distributed_optimizer: bool = True,
    stage: int | None = None,
) -> StateBytes:
    """Parameter, gradient and optimizer bytes that megatron-core allocates on one learner rank.

    arch: the model; mesh: any object with tp, pp, ep, etp (and optionally cp, sequence_parallel)
    attributes, e.g. `learner.mesh.MeshConfig` or the config's `MeshConfig`; world_size: all ranks.
    param_dtype: the learner dtype ("bfloat16" on GPU, "float32" on the CPU); grad_dtype: the DDP grad
    buffer ("float32": megagrpo's `grad_reduce_in_fp32=True`); distributed_optimizer: Adam state (and
    fp32 master params) sharded over DP. stage: a pipeline stage; None = the stage with the most bytes.
    Buffer padding is counted; Adam's per-tensor `step` scalars (4 bytes each) are not.
    """
    m = PlanMesh.of(mesh, world_size)
    m.check()
    p_bytes, g_bytes = dtype_bytes(param_dtype), dtype_bytes(grad_dtype)
    # megatron puts experts in their own buffer (expert-DP group) when EP > 1 or ETP != TP.
    separate_experts = m.ep > 1 or m.etp != m.tp
    stages = range(m.pp) if stage is None else [stage]
    best: StateBytes | None = None
    for s in stages:
        dense, expert = stage_tensor_numels(arch, m, s)
        buffers = [(dense + expert, m.dp)] if not separate_experts else [(dense, m.dp), (expert, m.expert_dp)]
        sums = [
            _buffer_bytes(nums, shard, p_bytes, g_bytes, distributed_optimizer) for nums, shard in buffers
        ]
        got = StateBytes(
            params=sum(b[0] for b in sums),
            grads=sum(b[1] for b in sums),
            optimizer=sum(b[2] for b in sums),
            numel=sum(dense) + sum(expert),
        )
        if best is None or got.total > best.total:
            best = got
    assert best is not None
    return best


# ------------------------------------------------------------------------------------ activations


def layer_activation_bytes_per_token(arch: ModelArch, mesh: PlanMesh, layer: int, act_bytes: int) -> float:
    """Bytes autograd saves per token for one layer on one rank (formula in the module docstring)."""
    H, n, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    tp, s, a = mesh.tp, mesh.seq_shard, act_bytes
    if arch.is_mla:
        # q, k (no-rope part and the shared rotary key, per head), v and the attention output per head;
        # the kv_b_proj output [n(d_n+d_v)] before its split; the latents before and after their norms
        dn, dr, dv = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        heads = n * (2 * (dn + dr) + (dn + dv) + 2 * dv) / tp
        latents = 2 * (arch.q_lora_rank or 0) + 2 * arch.kv_lora_rank + dr
        attn = a * (2 * H / s + heads + latents)
    else:
        attn = a * (2 * H / s + 2 * (n + g) * d / tp)
    if layer in set(arch.moe_layers()):
        E, k = arch.num_experts, arch.moe_topk
        Fe = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        mlp = a * 2 * H / s + 4 * (H + 2 * E) / s + a * (k / s) * (2 * H * mesh.etp + 3 * Fe)
        if arch.moe_shared_expert_ffn_hidden_size:
            mlp += a * 3 * arch.moe_shared_expert_ffn_hidden_size / tp
    else:
        mlp = a * (2 * H / s + 3 * arch.ffn_hidden_size / tp)
    return attn + mlp


def activation_bytes(
    arch: ModelArch,
    mesh: Any,
    tokens: int,
    *,
    world_size: int | None = None,
    act_dtype: str = "bfloat16",
    recompute: Recompute = "none",
    stage: int = 0,
    in_flight: int = 1,
) -> int:
    """Estimated activation bytes of `in_flight` micro-batches of `tokens` tokens each on one rank of
    pipeline `stage` during the backward pass (logits excluded: `logits_bytes`)."""
    m = PlanMesh.of(mesh, world_size or _min_world(mesh))
    a = dtype_bytes(act_dtype)
    layers = m.stage_layers(arch.num_layers, stage)
    t = tokens / m.cp
    per_layer = [layer_activation_bytes_per_token(arch, m, i, a) * t for i in layers]
    if recompute == "full":
        # each layer keeps its input; the layer in backward is recomputed, and its activations are freed
        # as its backward proceeds (measured on an H100: one layer's worth, not two; docs/scaling.md)
        saved = len(layers) * t * a * arch.hidden_size / m.seq_shard
        return int(saved * in_flight + max(per_layer))
    if recompute != "none":
        raise MegagrpoError(f"recompute={recompute!r}: use 'none' or 'full'")
    # in-flight micro-batches keep what they saved; the one in backward also holds one layer's worth of
    # transient gradients
    return int(sum(per_layer) * in_flight + max(per_layer))


def logits_bytes(arch: ModelArch, mesh: Any, tokens: int, *, act_dtype: str = "bfloat16") -> int:
    """Last stage: logits [T, V/tp] and their gradient in the learner dtype, plus two fp32 blocks of
    `LOGPROB_CHUNK_TOKENS` rows for the log-softmax (`learner/logprobs.py`)."""
    m = PlanMesh.of(mesh, _min_world(mesh))
    v = padded_vocab(arch, m.tp) // m.tp
    t = -(-tokens // m.cp)
    return 2 * t * v * dtype_bytes(act_dtype) + 2 * min(t, LOGPROB_CHUNK_TOKENS) * v * 4


def _min_world(mesh: Any) -> int:
    if isinstance(mesh, PlanMesh):
        return mesh.world_size
    return math.lcm(mesh.tp * getattr(mesh, "cp", 1) * mesh.pp, mesh.ep * mesh.etp * mesh.pp)


# ----------------------------------------------------------------------------------------- engine


def rows_wire_bytes(world_size: int, engines: int, groups: int, group_size: int, scores: int) -> int:
    """Device bytes of megagrpo's data plane (`trainer.rows`) on one GPU during the rollout phase: one wire
    piece out and one in (2 x `ROWS_WIRE_CHUNK_BYTES`), and the gathered per-row scalars: every rank
    receives each engine owner's, padded to the largest (ceil(groups / engines) prompt groups of
    `group_size` rows with `scores` reward scores each), plus its own: (world + 1) x that. The int64 sizes
    and flags (a few per rank) are not counted."""
    per_owner = -(-groups // engines) * (GROUP_SCALAR_BYTES + group_size * (ROW_SCALAR_BYTES + 4 * scores))
    return 2 * ROWS_WIRE_CHUNK_BYTES + (world_size + 1) * per_owner


# ------------------------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Workload:
    """What the plan needs to know about a job besides the model: one per megagrpo config (see
    `workload_from_config`), or written by hand for another framework's published run."""

    mesh: PlanMesh
    seq_len: int  # tokens of one sequence: prompt + response
    micro_batch_size: int = 1  # sequences per learner micro-batch
    micro_batch_tokens: int | None = None  # token cap of a dynamic micro-batch; None = size * seq_len
    micro_batches: int | None = None  # per optimizer step and DP rank; None = at least PP (1F1B fills)
    param_dtype: str = "bfloat16"
    grad_dtype: str = "float32"
    distributed_optimizer: bool = True
    recompute: Recompute = "none"
    reference: bool = False  # a frozen reference model (KL) of the same shape
    ref_offload: bool = False  # reference weights on the CPU between uses
    # another framework's knob that megagrpo's learner does not have (0 for its configs):
    optimizer_offload: float = 0.0  # fraction of optimizer state (and master params) kept on the CPU
    offload_in_rollout: bool = True  # learner state moved to host memory while sampling (megagrpo does)
    sync_bucket_bytes: int = 512 << 20  # weight-sync bucket; two are held at once (one built, one sent)
    rows_in_flight: int = 0  # the data plane's device bytes while sampling (megagrpo: `rows_wire_bytes`)
    engine_tp: int = 1
    engine_mem_fraction: float = 0.5
    engine_dtype: str = "bfloat16"
    engine_fp8: bool = False
    reserve_gib: float = RESERVE_GIB

    def tokens(self, micro_batch_size: int | None = None) -> int:
        if micro_batch_size is None and self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return (micro_batch_size or self.micro_batch_size) * self.seq_len


def workload_from_config(cfg: Any, world_size: int, *, engines: int | None = None) -> Workload:
    """The `Workload` of a megagrpo `Config` on `world_size` learner GPUs (bf16 learner for dtype auto).
    engines: the SGLang engines the rows come from; None = one per colocation group of engine_tp GPUs."""
    m = cfg.mesh
    mesh = PlanMesh(
        world_size=world_size,
        tp=m.tp,
        pp=m.pp,
        ep=m.ep,
        etp=m.etp,
        cp=m.cp,
        sequence_parallel=m.sequence_parallel or (m.tp > 1 and m.ep > 1),
        first_stage_layers=m.first_stage_layers,
        last_stage_layers=m.last_stage_layers,
    )
    mesh.check()
    dp = world_size // (m.tp * m.cp * m.pp)
    rows = cfg.rollout.multi_turn.rows_per_session  # an agent session trains a row per branch, bounded
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.group_size * rows // cfg.algo.ppo_mini_batches
    per_rank = max(1, seqs // dp)
    auto = "bfloat16"  # the plan is for GPUs, where dtype auto means bfloat16
    return Workload(
        mesh=mesh,
        seq_len=cfg.data.max_prompt_tokens + cfg.rollout.response_tokens,  # a trajectory's whole row
        micro_batch_size=cfg.schedule.micro_batch_size,
        micro_batches=max(1, -(-per_rank // cfg.schedule.micro_batch_size)),
        param_dtype=auto if cfg.model.dtype == "auto" else cfg.model.dtype,
        distributed_optimizer=cfg.optimizer.distributed,
        recompute="full" if cfg.model.recompute_activations else "none",
        reference=cfg.algo.kl.coef > 0,
        ref_offload=cfg.model.ref_offload,
        engine_tp=cfg.rollout.engine_tp,
        engine_mem_fraction=cfg.rollout.mem_fraction_static,
        engine_dtype=auto if cfg.rollout.dtype == "auto" else cfg.rollout.dtype,
        engine_fp8=cfg.rollout.fp8,
        sync_bucket_bytes=cfg.sync.bucket_mb << 20,
        rows_in_flight=rows_wire_bytes(
            world_size,
            engines or max(1, world_size // cfg.rollout.engine_tp),  # colocated: one per engine_tp GPUs
            cfg.rollout.prompts_per_step,
            cfg.rollout.group_size * rows,
            max(1, len(cfg.rewards.functions)),
        ),
    )


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU (the worst pipeline stage) and the verdict. `total` is the largest phase peak."""

    gpu_mem_gib: float
    workload: Workload
    params: int
    grads: int
    optimizer: int  # on the GPU (after optimizer_offload)
    activations: int  # per micro-batch step: all micro-batches in flight on the worst stage
    logits: int
    reference: int  # resident reference weights (0 when offloaded or absent)
    engine_weights: int
    kv_cache: int  # the engine's KV pool: mem_fraction_static x GPU memory - engine weights
    kv_tokens: int
    rollout_peak: int
    sync_peak: int
    train_peak: int
    total: int
    budget: int  # GPU memory minus the reserve
    fits: bool
    max_micro_batch: int  # largest micro_batch_size whose training peak fits (0: not even 1)
    max_kv_tokens: int  # largest KV cache, in tokens, whose rollout peak fits
    stage: int = 0  # the pipeline stage the bytes are of: the one with the highest training peak
    reasons: tuple[str, ...] = field(default=())
    num_layers: int = 0  # the model's decoder layers (the table names uneven stages' layer counts)
    rows_in_flight: int = 0  # the step's rows on their way to the learner ranks (rollout phase)
    host: HostPlan | None = None  # the node's host memory for tool calls (`plan/host.py`)
    engine_span: EngineSpan | None = None  # the nodes an engine takes (`plan/engines.py`)

    @property
    def margin(self) -> int:
        return self.budget - self.total

    def summary(self) -> str:
        """One line for `megagrpo submit`."""
        return (
            f"peak {self.total / GIB:.1f} GiB per GPU of a {self.budget / GIB:.1f} GiB budget "
            f"({self.gpu_mem_gib:g} GiB GPUs)"
        )

    def table(self) -> str:
        """The per-GPU table that `megagrpo plan` prints."""
        w = self.workload
        m = w.mesh
        lines = [
            ("learner parameters", self.params, ""),
            ("learner gradients", self.grads, ""),
            ("optimizer (Adam, fp32 master)", self.optimizer, ""),
            ("reference model", self.reference, ""),
            ("activations (in flight)", self.activations, ""),
            ("logits and log-softmax", self.logits, ""),
            ("engine weights", self.engine_weights, ""),
            ("engine KV cache", self.kv_cache, f"  ({self.kv_tokens} tokens)"),
            ("rows in flight (data plane)", self.rows_in_flight, ""),
            ("reserve (contexts, NCCL)", int(w.reserve_gib * GIB), ""),
            None,
            ("rollout peak", self.rollout_peak, ""),
            ("training peak", self.train_peak, ""),
            ("weight-sync peak", self.sync_peak, ""),
            ("GPU memory", int(self.gpu_mem_gib * GIB), ""),
        ]
        rows = [
            f"mesh: {m.world_size} GPUs, tp={m.tp} pp={m.pp}{m.stages_note(self.num_layers)} ep={m.ep} "
            f"etp={m.etp} cp={m.cp} (dp={m.dp}, expert-dp={m.expert_dp}); engine_tp={w.engine_tp}, "
            f"mem_fraction_static={w.engine_mem_fraction}",
            f"micro-batch: {w.tokens()} tokens ({w.micro_batch_size} x {w.seq_len}), "
            f"recompute={w.recompute}, learner {w.param_dtype} params / {w.grad_dtype} grads",
            "",
            f"  {f'per GPU (pipeline stage {self.stage})':<32}{'GiB':>9}",
        ]
        rows += ["" if x is None else f"  {x[0]:<32}{x[1] / GIB:9.2f}{x[2]}" for x in lines]
        if self.host is not None and self.host.lines():
            rows += ["", *self.host.lines()]
        if self.engine_span is not None:
            rows += ["", *self.engine_span.lines()]
        rows += [
            "",
            f"verdict: {'FITS' if self.fits else 'DOES NOT FIT'} "
            f"(margin {self.margin / GIB:+.2f} GiB); largest micro_batch_size that fits: "
            f"{self.max_micro_batch}; largest KV cache that fits: {self.max_kv_tokens} tokens",
        ]
        rows += [f"  - {r}" for r in self.reasons]
        return "\n".join(rows)


@dataclass(frozen=True)
class _Stage:
    stage: int
    state: StateBytes  # optimizer already net of optimizer_offload
    resident: int  # learner state (+ resident reference) while training
    activations: int
    logits: int

    @property
    def train(self) -> int:
        return self.resident + self.activations + self.logits


def _stage(arch: ModelArch, w: Workload, stage: int, tokens: int, ref_resident: int) -> _Stage:
    m = w.mesh
    st = learner_state_bytes(
        arch,
        m,
        m.world_size,
        param_dtype=w.param_dtype,
        grad_dtype=w.grad_dtype,
        distributed_optimizer=w.distributed_optimizer,
        stage=stage,
    )
    st = replace(st, optimizer=int(st.optimizer * (1.0 - w.optimizer_offload)))
    in_flight = min(m.pp - stage, w.micro_batches or m.pp)
    act = activation_bytes(
        arch, m, tokens, act_dtype=w.param_dtype, recompute=w.recompute, stage=stage, in_flight=in_flight
    )
    logits = logits_bytes(arch, m, tokens, act_dtype=w.param_dtype) if stage == m.pp - 1 else 0
    if w.reference and w.ref_offload:
        # the offloaded reference visits the GPU for a forward pass: its weights and that pass's logits
        act = max(act + logits, reference_bytes(arch, w, stage) + logits // 2) - logits
    return _Stage(stage, st, st.total + ref_resident, act, logits)


def _worst_stage(arch: ModelArch, w: Workload, tokens: int, ref_resident: int) -> _Stage:
    return max((_stage(arch, w, s, tokens, ref_resident) for s in range(w.mesh.pp)), key=lambda x: x.train)


def reference_bytes(arch: ModelArch, w: Workload, stage: int) -> int:
    """The frozen reference model's weights on one rank: plain tensors in the learner dtype."""
    dense, expert = stage_tensor_numels(arch, w.mesh, stage)
    return (sum(dense) + sum(expert)) * dtype_bytes(w.param_dtype)


def max_micro_batch(arch: ModelArch, w: Workload, ref_resident: int, budget: int, beside: int = 0) -> int:
    """The largest micro_batch_size (at most 4096; 0: not even 1) whose training peak, plus `beside`
    bytes held alongside, fits `budget`; a dynamic micro-batch (token cap) either fits as it is or not."""
    if w.micro_batch_tokens is not None:
        fits = _worst_stage(arch, w, w.tokens(), ref_resident).train + beside <= budget
        return w.micro_batch_size if fits else 0
    n = 0
    while n < 4096 and _worst_stage(arch, w, w.tokens(n + 1), ref_resident).train + beside <= budget:
        n += 1
    return n


def plan_workload(arch: ModelArch, w: Workload, *, gpu_mem_gib: float = 80.0) -> MemoryPlan:
    """The memory plan of workload `w` for `arch` on GPUs of `gpu_mem_gib` GiB."""
    if gpu_mem_gib <= 0:
        raise MegagrpoError(f"--gpu-mem-gib must be > 0, got {gpu_mem_gib}")
    if not 0.0 < w.engine_mem_fraction < 1.0:
        raise MegagrpoError(f"rollout.mem_fraction_static={w.engine_mem_fraction} must be in (0, 1)")
    w.mesh.check()
    mem = int(gpu_mem_gib * GIB)
    budget = mem - int(w.reserve_gib * GIB)
    ref_resident = 0
    if w.reference and not w.ref_offload:
        ref_resident = max(reference_bytes(arch, w, s) for s in range(w.mesh.pp))
    worst = _worst_stage(arch, w, w.tokens(), ref_resident)
    train_peak = worst.train
    # the engine's pool must fit beside the largest resident learner state of any stage
    learner = max(_stage(arch, w, s, 1, ref_resident).resident for s in range(w.mesh.pp))
    resident_rollout = 0 if w.offload_in_rollout else learner
    e_dtype = "fp8" if w.engine_fp8 else w.engine_dtype
    e_weights = engine_weight_bytes(arch, w.engine_tp, e_dtype)
    pool = int(w.engine_mem_fraction * mem)
    kv = pool - e_weights
    per_token = kv_bytes_per_token(arch, w.engine_tp, w.engine_dtype)
    kv_tokens = max(0, kv // per_token)
    rollout_peak = resident_rollout + pool + w.rows_in_flight
    sync_peak = learner + e_weights + 2 * w.sync_bucket_bytes
    total = max(rollout_peak, train_peak, sync_peak)
    reasons = []
    if rollout_peak > budget:
        reasons.append(
            f"rollout: learner state {resident_rollout / GIB:.1f} GiB + engine pool {pool / GIB:.1f} GiB "
            f"+ rows in flight {w.rows_in_flight / GIB:.1f} GiB exceed {budget / GIB:.1f} GiB; lower "
            "rollout.mem_fraction_static or shard the learner more"
        )
    if train_peak > budget:
        reasons.append(
            f"training: {train_peak / GIB:.1f} GiB exceed {budget / GIB:.1f} GiB; lower "
            "schedule.micro_batch_size, set model.recompute_activations, or shard the learner more"
        )
    if sync_peak > budget:
        reasons.append(
            f"weight sync: learner state {learner / GIB:.1f} GiB + engine weights {e_weights / GIB:.1f} GiB "
            f"exceed {budget / GIB:.1f} GiB; raise rollout.engine_tp or shard the learner more"
        )
    if kv_tokens < w.seq_len:
        reasons.append(
            f"engine: its weights ({e_weights / GIB:.1f} GiB) leave room for {kv_tokens} KV tokens, less "
            f"than one sequence ({w.seq_len}); raise rollout.engine_tp or rollout.mem_fraction_static"
        )
    max_mb = max_micro_batch(arch, w, ref_resident, budget)
    room = budget - resident_rollout - e_weights - w.rows_in_flight
    return MemoryPlan(
        num_layers=arch.num_layers,
        gpu_mem_gib=gpu_mem_gib,
        workload=w,
        params=worst.state.params,
        grads=worst.state.grads,
        optimizer=worst.state.optimizer,
        activations=worst.activations,
        logits=worst.logits,
        reference=ref_resident,
        engine_weights=e_weights,
        kv_cache=max(0, kv),
        kv_tokens=kv_tokens,
        rollout_peak=rollout_peak,
        sync_peak=sync_peak,
        train_peak=train_peak,
        total=total,
        budget=budget,
        fits=not reasons,
        max_micro_batch=max_mb,
        max_kv_tokens=max(0, room // per_token),
        stage=worst.stage,
        reasons=tuple(reasons),
        rows_in_flight=w.rows_in_flight,
    )
