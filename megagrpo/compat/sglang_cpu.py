"""CPU compatibility for SGLang 0.5.23: an in-process `sglang.Engine` on a machine without CUDA.

What is patched, and why (each through `megagrpo.compat.patching.replace`, which records the reason):

* `SGLANG_USE_CPU_ENGINE=1` is exported. It selects SGLang's CPU platform, and `sglang.srt.utils.is_cpu()`
  reads it once (`lru_cache`) and many modules freeze it at import (`_is_cpu = is_cpu()`), so it must be
  set before any `sglang.srt` module is imported. `apply()` raises if that already happened with the
  variable unset.
* `sgl_kernel`: in CPU mode SGLang imports `assign_req_to_token_pool_cpu`, `copy_all_layer_kv_cache_cpu`,
  `build_tree_kernel_efficient_cpu`, ... from `sgl_kernel` at module import. The CPU build of sgl-kernel is
  not on PyPI (the wheels there are CUDA-only), so a stand-in module is put into `sys.modules`:
  `assign_req_to_token_pool_cpu` is written in pure torch (it is the only kernel plain generation needs),
  every other name resolves to a function that raises a `RuntimeError` naming the missing kernel when
  called. `torch.ops.sgl_kernel` stays empty, so SGLang's AMX paths (`cpu_has_amx_support()`) stay off.
* `sglang.srt.mem_cache.pool_host.common.alloc_with_host_register`: the routed-experts host buffer
  (`enable_return_routed_experts`) is allocated through `ALLOC_MEMORY_FUNCS["cpu"]`, whose default calls
  `cudaHostRegister` even on the CPU platform; without a driver that raises. Replaced by a plain allocation.
* `torch.get_device_module`: with the CUDA build of torch on a machine with no GPU, the "current
  accelerator" is still `cuda`, so `get_device_module()` returns `torch.cuda` and the scheduler's
  `release_memory_occupation` crashes on `torch.get_device_module().synchronize()`. Without an argument it
  now returns `torch.cpu` when no accelerator is available (what torch's own docstring promises).
* `SamplingBatchInfo.from_schedule_batch`: SGLang honours a request's `sampling_seed` only under
  `enable_deterministic_inference`, and that mode insists on a GPU attention backend (fa3, flashinfer,
  triton), so the CPU engine cannot enable it. Its seeded sampler itself (`multinomial_with_seed`: a Gumbel
  draw hashed from seed and position) is plain torch. The replacement fills the batch's seed tensor on
  every batch, so a run's rollouts are a function of its seeds and a resumed run repeats them exactly; a
  request without a seed gets one drawn from the scheduler's torch RNG (unseeded requests stay random
  and independent of each other, instead of all sharing upstream's fallback seed 42).
* `murmur_hash32` (in `sglang.kernels.ops.sampling.murmur_hash` and as imported by `sglang.srt.layers.sampler`):
  the seeded sampler's hash of (seed, position, token id). On CPU tensors upstream calls the CPU sgl-kernel
  op, absent here; `murmur_hash32_torch` computes the same MurmurHash3 (x86, 32-bit, seed 0) of the
  16-byte key in int64 torch arithmetic. `multinomial_with_seed` is swapped for its undecorated original,
  because its `torch.compile` would build C++ with inductor in every scheduler process for a few
  elementwise ops. So is `vocab_parallel_embedding.get_masked_input_and_mask`, which only an engine of TP 2
  or more calls (each rank's share of the vocabulary): integer masks, exact either way; compiled, the
  schedulers of a TP 2 engine waited minutes on g++ before their first batch (seen in test_slurm.py's
  local TP 2 run on a loaded host).
* `parallel_state.init_model_parallel_group`: for every model-parallel group whose caller does not choose,
  SGLang 0.5.23 turns PyNccl on for all devices but NPU/XPU (and out-of-tree platforms without it), the CPU
  platform included, so an engine of 2 ranks or more (`tp_size > 1`, or `nnodes > 1`) fails as its TP group
  starts: "Expected a cuda device, but got: cpu" (pynccl.py). SGLang has no server argument or variable
  for this (`disable_custom_all_reduce` covers the custom all-reduce only, which megagrpo's engine config
  also sets on CPU); the replacement passes `use_pynccl=False`, so the group's collectives run on its
  torch.distributed group (gloo on the CPU platform), as they already do for CPU tensors.

* `AttentionBackendRegistry.get_handler` (sglang.srt.models.deepseek_common.attention_backend_handler): the
  torch-native MLA path. DeepSeek-V3's multi-latent attention picks a forward method per batch from a
  handler per attention backend; `torch_native` has none and falls back to triton's, which sends a prefill
  without a cached prefix through the MHA method: it computes K and V in full and calls the backend with
  `save_kv_cache=False`, expecting the backend to attend over the K and V it was given. The torch-native
  backend always attends over its KV pool instead, and an MLA pool holds the latent (kv_lora_rank +
  qk_rope_head_dim per token), so every prefill attended over the wrong tensors (a tiny model whose latent
  width happens to equal its query width ran and was wrong by 0.5 nats; DeepSeek-V3's widths, 576 and 192,
  would not). SGLang's other CPU path is the fused MLA kernel behind Intel AMX (sgl_kernel CPU ops, not on
  PyPI). For `torch_native` every batch now takes the absorbed MLA method, which writes the latent into the
  pool and attends over it with the query absorbed through `w_kc` (exact in real arithmetic, so the
  logprobs agree with transformers' MHA to fp32 round-off), as decode already did.
* `TorchNativeAttnBackend._run_sdpa_forward_extend` and `_run_sdpa_forward_decode`: the speed of that
  absorbed MLA. The MLA pool's value buffer is a prefix view of its key buffer (the latent, kv_lora_rank
  wide, of the latent + rope key), so the value is narrower than the query and key, and torch's
  `scaled_dot_product_attention` on CPU takes its slow "math" path for every MLA layer (measured: a
  DeepSeek-V3-shaped engine 1.7x slower per decoded token than Qwen3-MoE at equal parameters, 1.2x with
  this patch). When the value buffer is exactly the key buffer's prefix, attention runs with the whole key
  buffer as the value and the output keeps its first kv_lora_rank columns: each output column is the same
  softmax-weighted sum of the same value column, so the result is upstream's (to fp32 round-off of a
  different kernel). Any other value buffer goes to upstream unchanged.

* `rotary_embedding.factory.get_rope_cpu`: multi-latent attention's rotary embedding on the CPU platform.
  SGLang's DeepSeek attention builds it through `get_rope_wrapper`, which on a CPU device goes to
  `get_rope_cpu`, and that accepts only DeepSeek's YaRN (`assert scaling_type == "deepseek_yarn"`): an MLA
  model with plain rope (`rope_scaling: null`, as Moonlight ships it) died at engine start on a `None`
  subscript. Without scaling the replacement returns SGLang's own plain `RotaryEmbedding` (`get_rope`, what
  every GQA family gets on the CPU, interleaved or not as the model asks); anything else goes to upstream.

Subprocesses. `sglang.Engine` starts its scheduler (one per TP rank) with `multiprocessing` in `spawn` mode,
so the child is a fresh interpreter: patches made in the parent are gone there. Two things make them
active in the child without sitecustomize or an installed entry point:

1. `Engine.run_scheduler_process_func` is SGLang's documented override point (a class attribute, passed
   to `mp.Process(target=...)`). It is replaced by `scheduler_process_entry` below; spawn pickles the
   target by reference, so the child imports this module, calls `apply()`, and only then imports and runs
   SGLang's `run_scheduler_process`.
2. Because the pickled process arguments (`ServerArgs`, ...) are unpickled in the child too, this module
   also re-applies itself at import when the parent exported `MEGAGRPO_SGLANG_CPU_COMPAT=1`, so even an
   import triggered while unpickling sees the stand-ins.

The detokenizer subprocess is wrapped the same way (`Engine.run_detokenizer_process_func`): its imports reach
`sglang.kernels.ops.kvcache.cache_move`, which imports `sgl_kernel` at module level.

Console in the child. The parent's console filters (`megagrpo.console`) reach the child too: its warning
filters as `-W` options on the child's command line, its log-record filters through `console.quiet_child()`
at the import described in 2., before `apply()` imports SGLang.

Hits in the child. `patching.HITS` counts in the process that ran the patched code; a scheduler's counts are
invisible to the parent. If `MEGAGRPO_COMPAT_HITS_DIR` is set when the engine starts, each child appends the
name of every patch the first time it is hit to `<dir>/<pid>.hits`; `read_child_hits(dir)` collects them.
"""

from __future__ import annotations

import multiprocessing.spawn
import os
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from megagrpo import console
from megagrpo.compat import patching
from megagrpo.compat.patching import replace

CHILD_ENV = "MEGAGRPO_SGLANG_CPU_COMPAT"
HITS_DIR_ENV = "MEGAGRPO_COMPAT_HITS_DIR"

# sgl_kernel names that have a real (pure torch) implementation here; all others raise when called.
_IMPLEMENTED = ("assign_req_to_token_pool_cpu",)

_applied = False


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Pure-torch `sgl_kernel.assign_req_to_token_pool_cpu`.

    For request i (in batch order) write the KV-cache slots `out_cache_loc[o_i : o_i + n_i]` into
    `req_to_token[req_pool_indices[i], start_offset[i] : end_offset[i]]`, where `n_i = end - start` and
    `o_i` is the sum of the earlier `n_j` (the slots are packed request after request).
    Shapes: req_pool_indices, start_offset, end_offset `[batch]`; req_to_token `[pool_size, pool_len]`;
    out_cache_loc `[>= sum n_i]`.
    """
    del pool_len  # the row length of req_to_token; implicit in its shape
    starts = start_offset.to(torch.int64)
    lens = end_offset.to(torch.int64) - starts
    total = int(lens.sum())
    if total == 0:
        return
    rows = req_pool_indices.to(torch.int64).repeat_interleave(lens)
    first = torch.cumsum(lens, 0) - lens  # packed offset of each request's first slot
    cols = starts.repeat_interleave(lens) + torch.arange(total) - first.repeat_interleave(lens)
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def _missing_kernel(name: str):
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"sgl_kernel.{name} is not available on this CPU: the CPU build of sgl-kernel is not on PyPI and "
            "megagrpo's stand-in only implements "
            f"{', '.join(_IMPLEMENTED)}. Use attention_backend='torch_native', disable_cuda_graph=True and "
            "no speculative decoding / quantization / hicache on the CPU engine."
        )

    missing.__name__ = name
    return missing


def _install_sgl_kernel_stub() -> None:
    existing = sys.modules.get("sgl_kernel")
    if existing is not None and not getattr(existing, "__megagrpo_stub__", False):
        return  # a real sgl_kernel is installed: leave it alone
    if existing is None:
        stub = types.ModuleType("sgl_kernel", "megagrpo stand-in for the CPU build of sgl-kernel")
        stub.__megagrpo_stub__ = True

        def __getattr__(name: str) -> Any:  # noqa: N807 (module-level __getattr__, PEP 562)
            if name.startswith("__"):
                raise AttributeError(name)
            return _missing_kernel(name)

        stub.__getattr__ = __getattr__
        sys.modules["sgl_kernel"] = stub
    replace(
        sys.modules["sgl_kernel"],
        "assign_req_to_token_pool_cpu",
        assign_req_to_token_pool_cpu,
        reason="sgl_kernel.assign_req_to_token_pool_cpu: the CPU sgl-kernel build is not on PyPI; "
        "pure-torch scatter of new KV slots into req_to_token",
    )


def alloc_without_host_register(
    dims: tuple,
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """Plain host allocation: `cudaHostRegister` needs a CUDA driver, and pinning buys nothing on a CPU."""
    del pin_memory, registration_granularity_bytes
    return allocator.allocate(dims, dtype=dtype, device=device)


_upstream_get_device_module = torch.get_device_module


def get_device_module(device: Any = None) -> types.ModuleType:
    """`torch.get_device_module`, but `None` means `torch.cpu` when no accelerator is actually available."""
    if device is None and not torch.accelerator.is_available():
        return torch.cpu
    return _upstream_get_device_module(device)


def seeded_from_schedule_batch(cls: Any, batch: Any, vocab_size: int) -> Any:
    """`SamplingBatchInfo.from_schedule_batch` with per-request seeds always filled (see the module doc)."""
    patching.hit("SamplingBatchInfo.from_schedule_batch")
    for r in batch.reqs:
        if r.sampling_params.sampling_seed is None:
            # Stored on the request, so every later batch that holds it samples with the same seed.
            r.sampling_params.sampling_seed = int(torch.randint(0, 2**31 - 1, ()).item())
    info = _UPSTREAM_FROM_SCHEDULE_BATCH.__func__(cls, batch, vocab_size)
    if info.sampling_seed is None:
        info.sampling_seed = torch.tensor(
            [r.sampling_params.sampling_seed for r in batch.reqs], dtype=torch.int64, device=batch.device
        )
    return info


_UPSTREAM_FROM_SCHEDULE_BATCH: Any = None

_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur_block(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2**64, which keeps the low 32 bits exact.
    k = (k * 0xCC9E2D51) & _M32
    k = (_rotl32(k, 15) * 0x1B873593) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32_torch(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """MurmurHash3 x86_32 (seed 0) of the 16-byte key (seed low, seed high, position, column), for every
    row's seed/position and every column: int64 `[n, m]` holding values in [0, 2**32).

    seed `[n]` (int64/uint64, non-negative), positions `[n]`, col_indices `[m]`."""
    seed = seed.to(torch.int64)
    h = torch.zeros_like(seed)
    h = _murmur_block(h, seed & _M32)
    h = _murmur_block(h, (seed >> 32) & _M32)
    h = _murmur_block(h, positions.to(torch.int64) & _M32)
    h = _murmur_block(h[:, None], (col_indices.to(torch.int64) & _M32)[None, :])
    h = h ^ 16  # the key length
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def absorbed_mla_for_every_batch(attn: Any, forward_batch: Any) -> Any:
    """The forward method of an MLA layer under the torch-native backend: absorbed MLA (attention over the
    latent KV pool) for prefill, extend and decode alike (see the module doc)."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    del attn, forward_batch
    return AttnForwardMethod.MLA


_UPSTREAM_GET_HANDLER: Any = None


def mla_handler_for_backend(cls: Any, backend_name: str) -> Any:
    """`AttentionBackendRegistry.get_handler`: torch-native gets `absorbed_mla_for_every_batch`."""
    if backend_name == "torch_native":
        patching.hit("AttentionBackendRegistry.get_handler")
        return absorbed_mla_for_every_batch
    return _UPSTREAM_GET_HANDLER.__func__(cls, backend_name)


def _is_prefix_view(key: torch.Tensor, value: torch.Tensor) -> bool:
    """`value` is `key[..., :n]` for some n < key's width: same memory, dtype, strides and leading shape."""
    return (
        value.shape[-1] < key.shape[-1]
        and value.shape[:-1] == key.shape[:-1]
        and value.dtype == key.dtype
        and value.stride() == key.stride()
        and value.data_ptr() == key.data_ptr()
    )


def _latent_as_value(upstream: Any, name: str) -> Any:
    """An upstream `_run_sdpa_forward_*` that, when the value cache is a prefix view of the key cache (the
    MLA pool), attends with the key cache as the value and keeps the output's first columns (see the
    module doc): equal widths keep SDPA off its slow CPU math path."""

    def run_sdpa(self: Any, query, output, k_cache, v_cache, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _is_prefix_view(k_cache, v_cache):
            return upstream(self, query, output, k_cache, v_cache, *args, **kwargs)
        patching.hit(name)
        wide = output.new_empty((*output.shape[:-1], k_cache.shape[-1]))
        upstream(self, query, wide, k_cache, k_cache, *args, **kwargs)
        output.copy_(wide[..., : v_cache.shape[-1]])
        return output

    run_sdpa.__wrapped__ = upstream  # SGLang's own method, for tests in a process where apply() ran
    return run_sdpa


def _patch_mla_sdpa() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    for method in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode"):
        name = f"TorchNativeAttnBackend.{method}"
        replace(
            TorchNativeAttnBackend,
            method,
            _latent_as_value(TorchNativeAttnBackend.__dict__[method], name),
            reason=f"{name}: the MLA value (the latent) is narrower than query and key, which sends CPU SDPA "
            "to its slow math path; the whole latent as the value, output sliced to the latent's width",
            count_hits=False,
        )


def _plain_rope_too(upstream: Any) -> Any:
    """`factory.get_rope_cpu` that serves an unscaled rope with SGLang's plain `RotaryEmbedding` (module doc)."""
    from sglang.srt.layers.rotary_embedding import factory

    def get_rope_cpu(
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: int,
        is_neox_style: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        partial_rotary_factor: float = 1.0,
        device: str | None = None,
    ) -> Any:
        if rope_scaling is not None:
            return upstream(
                head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                partial_rotary_factor, device,
            )  # fmt: skip
        patching.hit("factory.get_rope_cpu")
        return factory.get_rope(
            head_size, rotary_dim, max_position, base, is_neox_style, None, dtype, partial_rotary_factor
        )

    return get_rope_cpu


def _patch_plain_rope() -> None:
    from sglang.srt.layers.rotary_embedding import factory

    replace(
        factory,
        "get_rope_cpu",
        _plain_rope_too(factory.get_rope_cpu),
        reason="rotary_embedding.factory.get_rope_cpu: only DeepSeek's YaRN was accepted, so multi-latent "
        "attention with plain rope (Moonlight's rope_scaling null) died at engine start; SGLang's plain rope",
        count_hits=False,
    )


def _without_pynccl(upstream: Any) -> Any:
    """`parallel_state.init_model_parallel_group` with PyNccl off: there is no CUDA device to hold it."""

    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        kwargs["use_pynccl"] = False
        return upstream(*args, **kwargs)

    return init_model_parallel_group


def _patch_tp_groups() -> None:
    from sglang.srt.distributed import parallel_state

    replace(
        parallel_state,
        "init_model_parallel_group",
        _without_pynccl(parallel_state.init_model_parallel_group),
        reason="parallel_state.init_model_parallel_group: PyNccl is asked for every TP group on a CPU device "
        "too, so an engine of 2+ ranks failed ('Expected a cuda device, but got: cpu'); gloo instead",
    )


def _check_not_imported_too_early() -> None:
    common = sys.modules.get("sglang.srt.utils.common")
    if common is not None and not common.is_cpu():
        raise RuntimeError(
            "sglang.srt was imported before megagrpo.compat.apply_cpu_compat(sglang=True) set "
            "SGLANG_USE_CPU_ENGINE=1, so SGLang froze the non-CPU platform. Call apply_cpu_compat at process "
            "start, before importing sglang.srt (importing the top-level `sglang` package is fine)."
        )


def apply() -> None:
    """Make `sglang.Engine` run here (CPU only; the caller checks CUDA). Idempotent; see the module doc."""
    global _applied
    if _applied:
        return
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[CHILD_ENV] = "1"  # inherited by spawned schedulers; re-applies this module at import there
    _check_not_imported_too_early()
    _install_sgl_kernel_stub()
    replace(
        torch,
        "get_device_module",
        get_device_module,
        reason="torch.get_device_module: the CUDA build reports 'cuda' as the accelerator without a GPU, so "
        "SchedulerWeightUpdater.release_memory_occupation crashed on torch.cuda.synchronize()",
    )

    from sglang.srt.mem_cache.pool_host import common as pool_host_common

    replace(
        pool_host_common,
        "alloc_with_host_register",
        alloc_without_host_register,
        reason="pool_host.common.alloc_with_host_register (ALLOC_MEMORY_FUNCS default, used for the "
        "routed-experts host buffer): cudaHostRegister needs a CUDA driver; plain allocation instead",
    )
    # ALLOC_MEMORY_FUNCS is a defaultdict whose factory looks the function up at call time; an entry
    # already materialised for "cpu" would keep the old function.
    if pool_host_common.ALLOC_MEMORY_FUNCS.get("cpu") is not None:
        pool_host_common.ALLOC_MEMORY_FUNCS["cpu"] = pool_host_common.alloc_with_host_register

    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    global _UPSTREAM_FROM_SCHEDULE_BATCH
    if _UPSTREAM_FROM_SCHEDULE_BATCH is None:
        _UPSTREAM_FROM_SCHEDULE_BATCH = SamplingBatchInfo.__dict__["from_schedule_batch"]
    replace(
        SamplingBatchInfo,
        "from_schedule_batch",
        classmethod(seeded_from_schedule_batch),
        reason="SamplingBatchInfo.from_schedule_batch: per-request sampling_seed is dropped unless "
        "enable_deterministic_inference, which needs a GPU attention backend; seeds are always filled",
        count_hits=False,
    )

    from sglang.kernels.ops.sampling import murmur_hash
    from sglang.srt.layers import sampler

    for owner in (murmur_hash, sampler):
        replace(
            owner,
            "murmur_hash32",
            murmur_hash32_torch,
            reason="murmur_hash32: on CPU tensors it calls torch.ops.sgl_kernel.murmur_hash32_cpu, which the "
            "PyPI sgl-kernel lacks; the same hash in torch",
        )
    from sglang.srt.layers import vocab_parallel_embedding

    # Their torch.compile would build C++ with inductor in every scheduler process for a few elementwise or
    # integer ops; the undecorated functions compute the same. The mask is called by engines of TP >= 2 only.
    for owner, name in (
        (sampler, "multinomial_with_seed"),
        (vocab_parallel_embedding, "get_masked_input_and_mask"),
    ):
        compiled = getattr(owner, name)
        replace(
            owner,
            name,
            getattr(compiled, "_torchdynamo_orig_callable", compiled),
            reason=f"{owner.__name__.rsplit('.', 1)[-1]}.{name}: torch.compile would build C++ with inductor in "
            "every scheduler process; the undecorated function",
            count_hits=False,
        )

    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    global _UPSTREAM_GET_HANDLER
    if _UPSTREAM_GET_HANDLER is None:
        _UPSTREAM_GET_HANDLER = AttentionBackendRegistry.__dict__["get_handler"]
    replace(
        AttentionBackendRegistry,
        "get_handler",
        classmethod(mla_handler_for_backend),
        reason="AttentionBackendRegistry.get_handler: torch_native has no MLA handler and took triton's, "
        "whose MHA prefill the torch-native backend computes over the latent KV pool; absorbed MLA for "
        "every batch instead (SGLang's other CPU MLA path needs Intel AMX kernels)",
        count_hits=False,
    )
    _patch_mla_sdpa()
    _patch_plain_rope()
    _patch_tp_groups()

    from sglang.srt.entrypoints.engine import Engine

    replace(
        Engine,
        "run_scheduler_process_func",
        staticmethod(scheduler_process_entry),
        reason="Engine.run_scheduler_process_func (sglang.srt.managers.scheduler.run_scheduler_process): "
        "spawned schedulers start without the parent's patches; this entry re-applies them first",
        count_hits=False,
    )
    replace(
        Engine,
        "run_detokenizer_process_func",
        staticmethod(detokenizer_process_entry),
        reason="Engine.run_detokenizer_process_func (sglang.srt.managers.detokenizer_manager."
        "run_detokenizer_process): its imports reach sgl_kernel, absent in the spawned child; re-apply first",
        count_hits=False,
    )
    _applied = True


def scheduler_process_entry(*args: Any, **kwargs: Any) -> Any:
    """Target of every scheduler subprocess: apply the CPU patches, then run SGLang's scheduler."""
    apply()
    _report_hits_from_child()
    patching.hit("Engine.run_scheduler_process_func")
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def detokenizer_process_entry(*args: Any, **kwargs: Any) -> Any:
    """Target of the detokenizer subprocess: apply the CPU patches, then run SGLang's detokenizer."""
    apply()
    _report_hits_from_child()
    patching.hit("Engine.run_detokenizer_process_func")
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    return run_detokenizer_process(*args, **kwargs)


class _FirstHitReporter(Counter):
    """A `Counter` that appends a patch's name to `path` the first time it is counted."""

    def __init__(self, path: Path, initial: Counter) -> None:
        super().__init__(initial)
        self._path = path

    def __setitem__(self, key: str, value: int) -> None:
        first = key not in self
        super().__setitem__(key, value)
        if first:
            with open(self._path, "a") as f:  # one short O_APPEND write per name: safe across processes
                f.write(key + "\n")


def _report_hits_from_child() -> None:
    hits_dir = os.environ.get(HITS_DIR_ENV)
    if not hits_dir or isinstance(patching.HITS, _FirstHitReporter):
        return
    path = Path(hits_dir) / f"{os.getpid()}.hits"
    reporter = _FirstHitReporter(path, patching.HITS)
    for name in reporter:
        with open(path, "a") as f:
            f.write(name + "\n")
    patching.HITS = reporter  # `replace`'s wrappers look HITS up in patching's globals at call time


def read_child_hits(hits_dir: str | Path) -> dict[str, set[int]]:
    """{patch name: pids of the subprocesses that hit it} from the files written under `hits_dir`."""
    out: dict[str, set[int]] = {}
    for path in Path(hits_dir).glob("*.hits"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            if line:
                out.setdefault(line, set()).add(pid)
    return out


def _skip_megatron_in_child() -> None:
    """The scheduler never runs megatron, but SGLang's debug dumper imports `megatron.core` (and wandb and
    tensorboard through it) when its class body is defined, for an optional plugin that reads megatron's
    parallel state. On this CPU that import is a third of a scheduler's start-up. An entry of None in
    `sys.modules` makes the import raise ImportError, which the dumper already handles (plugin off)."""
    if "megatron" in sys.modules:
        return  # already imported here: nothing to save, and nothing may be hidden
    sys.modules["megatron"] = None  # type: ignore[assignment]
    patching.APPLIED["sys.modules['megatron']"] = patching.Patch(
        "sys.modules['megatron']",
        "spawned SGLang children only: the debug dumper's optional megatron plugin imported megatron.core, "
        "wandb and tensorboard on every engine start; the import now fails and the plugin stays off",
    )


if os.environ.get(CHILD_ENV) == "1" and not torch.cuda.is_available():
    # Imported in a spawned SGLang subprocess (the parent applied the patches): apply them here too,
    # after the parent's console filters for log records (its warning filters arrived as -W options).
    # A spawned child (multiprocessing's marker on its command line): SGLang's scheduler or detokenizer,
    # never a trainer rank (torchrun starts those as plain interpreters, with this variable inherited too).
    if multiprocessing.spawn.is_forking(sys.argv):
        _skip_megatron_in_child()
    console.quiet_child()
    apply()
