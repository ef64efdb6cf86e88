"""Engines that span nodes: the fewest GPUs one SGLang engine needs to hold the model, and the nodes it takes.

An engine holds the whole model split over its `rollout.engine_tp` GPUs (SGLang's tensor parallelism, with
its expert parallelism inside the same ranks; what SGLang replicates is whole on every rank:
`plan/engine_rank.py`), and its KV cache must hold at least one sequence. When no
node has enough GPUs for that, the engine spans nodes: SGLang's multi-node engine, one server process per
node (`ServerArgs.nnodes`, `node_rank`, `dist_init_addr`), which megagrpo starts in the disaggregated
placement (`config.mesh_rules.engine_nodes`, `engine_node_of`; `rollout/engines/server.py`). DeepSeek-V3 (671B) in
bf16 needs it on any 8-GPU node, in fp8 on 80 GB GPUs; Kimi-K2 (1T) anywhere.

The plan names the smallest engine (a power of two GPUs, as TP sizes go) and the nodes it spans, and
refuses a colocated engine over several nodes: the colocated weight handoff passes CUDA IPC handles,
which do not leave a node, while the disaggregated one broadcasts to every node's schedulers.
"""

from __future__ import annotations

from megagrpo.config.mesh_rules import engine_nodes
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.plan.engine_rank import (
    GIB,
    MAX_ENGINE_GPUS,
    EngineSpan,
    engine_weight_bytes,
    kv_bytes_per_token,
)
from megagrpo.plan.memory import Workload


def min_engine_tp(arch: ModelArch, w: Workload, gpu_mem_gib: float) -> int | None:
    """The smallest power-of-two engine_tp whose static pool (rollout.mem_fraction_static of each GPU) holds
    the engine's weight shard and one sequence (`w.seq_len` tokens) of KV cache; None past MAX_ENGINE_GPUS
    or the attention heads."""
    pool = int(w.engine_mem_fraction * gpu_mem_gib * GIB)
    dtype = "fp8" if w.engine_fp8 else w.engine_dtype
    tp = 1
    # SGLang splits attention by heads: a TP that does not divide them is no engine
    while tp <= MAX_ENGINE_GPUS and arch.num_attention_heads % tp == 0:
        kv = w.seq_len * kv_bytes_per_token(arch, tp, w.engine_dtype)
        if engine_weight_bytes(arch, tp, dtype) + kv <= pool:
            return tp
        tp *= 2
    return None


def engine_span(
    arch: ModelArch, w: Workload, *, gpus_per_node: int, gpu_mem_gib: float, disaggregated: bool
) -> EngineSpan:
    """`EngineSpan` of workload `w` on nodes of `gpus_per_node` GPUs of `gpu_mem_gib` GiB."""
    dtype = "fp8" if w.engine_fp8 else w.engine_dtype
    reasons: list[str] = []
    try:
        nodes = engine_nodes(w.engine_tp, gpus_per_node)
    except MegagrpoError as e:
        nodes = -(-w.engine_tp // gpus_per_node)
        reasons.append(str(e))
    if nodes > 1 and not disaggregated:
        reasons.append(
            f"rollout.engine_tp={w.engine_tp} spans {nodes} nodes of {gpus_per_node} GPUs: an engine over "
            "several nodes runs in the disaggregated placement only (rollout.placement.kind=disaggregated; "
            "the colocated handoff passes CUDA IPC handles, which do not leave a node)"
        )
    least = min_engine_tp(arch, w, gpu_mem_gib)
    least_nodes = None if least is None else -(-least // gpus_per_node)
    if least is None:
        reasons.append(
            f"engine: no engine of up to {MAX_ENGINE_GPUS} GPUs of {gpu_mem_gib:g} GiB holds the model in "
            f"{dtype} and one sequence of {w.seq_len} tokens; use rollout.fp8, a larger "
            "rollout.mem_fraction_static or shorter sequences"
        )
    elif w.engine_tp < least:
        over = (
            f": an engine over {least_nodes} nodes of {gpus_per_node} GPUs (SGLang's multi-node engine, "
            "rollout.placement.kind=disaggregated)"
            if least_nodes > 1
            else ""
        )
        reasons.append(
            f"engine: the model ({engine_weight_bytes(arch, 1, dtype) / GIB:.0f} GiB in {dtype}) and one "
            f"sequence of KV cache need at least {least} GPUs of {gpu_mem_gib:g} GiB per engine at "
            f"rollout.mem_fraction_static={w.engine_mem_fraction}; set rollout.engine_tp={least}{over}"
        )
    return EngineSpan(
        engine_tp=w.engine_tp,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        min_engine_tp=least,
        min_nodes=least_nodes,
        model_bytes=engine_weight_bytes(arch, 1, dtype),
        dtype=dtype,
        reasons=tuple(reasons),
    )
