"""Configuration of the SGLang sampler: how the engine is started, and how each request samples."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RolloutConfig:
    """How one in-process `sglang.Engine` is started (one per colocation group)."""

    model_path: str  # HF directory (the bridge's initial export)
    tp_size: int = 1  # tensor parallel size of the engine
    mem_fraction_static: float = 0.5  # share of device memory for weights + KV cache (GPU); on CPU, of RAM
    dtype: str = "bfloat16"  # one of DTYPES
    fp8: bool = False  # GPU only: quantization="fp8" for rollout
    # GPU: SGLang's enable_deterministic_inference (seeded, batch-invariant sampling; slower). The CPU engine
    # honours request seeds without it (megagrpo.compat.sglang_cpu), so there it changes nothing.
    deterministic: bool = False
    max_context_len: int | None = None  # prompt + completion tokens; None: the model's max positions
    max_total_tokens: int | None = None  # KV-cache size in tokens; None: SGLang sizes it from memory
    return_routes: bool = True  # MoE: record routed experts (needed for routing replay R3)
    seed: int = 0  # the engine's random seed (sampling RNG of the scheduler)
    base_gpu_id: int = 0  # GPU: the first of the engine's tp_size GPUs on its node (rollout.groups)
    # An engine over several nodes (SGLang's multi-node TP/EP; `config.mesh_rules.engine_nodes`):
    # this process starts SGLang node `node_rank` of `nnodes`, which meet at `dist_init_addr` (host:port
    # of node 0); tp_size counts the GPUs of all its nodes.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # SGLang's trust_remote_code: run the checkpoint's own Python (its `auto_map` config / tokenizer classes)
    # in the engine's processes, and in the remote engine's tokenizer load (model.trust_remote_code)
    trust_remote_code: bool = False
    log_level: str = "error"
    extra_engine_args: dict = field(default_factory=dict)  # passed to sglang.Engine verbatim, last


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling parameters (SGLang `sampling_params`)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings; the stop string itself is kept in the output
    # Base of the per-request seeds (SGLang `sampling_seed`): request k of a call samples with `seed + k`,
    # so a call repeats exactly. Honoured on the CPU engine (megagrpo.compat.sglang_cpu) and on GPU with
    # RolloutConfig.deterministic (SGLang ignores it otherwise); None: the scheduler's RNG decides.
    seed: int | None = None
    ignore_eos: bool = False
