"""megatron-core 0.19.2 on a CUDA-less machine (CPU tensors, gloo process groups).

`apply()` is called by `megagrpo.compat.apply_cpu_compat()` only when `torch.cuda.is_available()` is
False. Every patch goes through `patching.replace`, names the upstream thing it replaces and why, and
counts its hits so `tests/dist/test_compat_hits.py` can prove which ones the learner really exercises.

The facts behind each patch (issue 2, "Facts: megatron-core 0.19.2 on CPU with gloo"):

1. `torch.cuda.current_device()` is the allocation device in ~60 call sites (global memory buffer,
   `torch.empty(device=current_device())`, rotary embeddings, router, layers); it raises without a
   driver. -> `torch.cuda.current_device` returns the CPU device.
2. The alltoall dispatcher creates a `torch.cuda.Stream` for device-to-host copies and enters
   `torch.cuda.stream(...)`; events and `synchronize` are used too. -> CPU no-op streams/events.
3. The RNG tracker keeps CUDA generator states. Re-verified here: `CudaRNGStatesTracker.add` and
   `_get_cuda_rng_state` raise "no NVIDIA driver", and `_set_cuda_rng_state` is queued by `_lazy_call`
   and never runs, so `fork()` could not swap states (recompute/dropout not reproducible). -> the
   tracker keeps CPU generator states.
4. `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)` returns a tensor for CPU inputs, then
   `all_to_all_single` gets split sizes as a tensor. -> always honour `as_numpy`.
5. `device="cuda"` is hard-coded in schedules, optimizer, clip_grads, core.utils (and on less-used
   paths: grad scaler, `tensor_parallel.data`, causal masks, dist-checkpoint exchange). -> each of
   those modules sees a `torch` whose factory functions map a CUDA device to the CPU.
6. `param.type() == 'torch.cuda.FloatTensor'` checks in `DistributedOptimizer.
   _build_model_and_main_param_groups` and `clip_grad_by_total_norm_fp32`. -> while those run, CPU
   tensors report their CUDA type name.
7. Without apex/TE the local spec norms are `WrappedTorchNorm`, which refuses sequence parallel. ->
   a torch norm that accepts it and tags its parameters `sequence_parallel=True`, which is exactly
   what makes `finalize_model_grads` all-reduce their grads over TP (as TE's norm does).
8. Gloo rejects all-gather and reduce-scatter with uneven split sizes (the alltoall dispatcher with
   expert-TP > 1 needs them). -> pad-to-max all-gather, all-reduce-then-slice reduce-scatter.
10. torch AdamW's `step` under the DistributedOptimizer: not a CPU fact (a GPU without TE/Apex has it
   too), so it lives in `megagrpo/compat/torch_adam.py`, applied by `build_optimizer` on any device.
9. Not patched (documented constraints, enforced by the learner with clear errors): MoE with TP > 1
   needs sequence parallel; DistributedOptimizer accepts only Adam; a script that saves dist
   checkpoints needs an `if __name__ == "__main__"` guard (the writer starts a spawn manager).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.compat.patching import hit, replace

_CPU = torch.device("cpu")

# -- 1, 2: torch.cuda device/stream/event API ------------------------------------------------------


def _current_device() -> torch.device:
    return _CPU


class _CpuEvent:
    """A CUDA event on a machine where every op is synchronous: recording and waiting are no-ops."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream stand-in (torch.cpu.Stream.record_event returns None, which the dispatcher syncs on)."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _stream(*_args: Any, **_kwargs: Any) -> _CpuStream:
    return _CPU_STREAM


class _StreamClass(_CpuStream):
    """`torch.cuda.Stream` must stay a class: libraries annotate with `torch.cuda.Stream | None`."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        hit("torch.cuda.Stream")


class _EventClass(_CpuEvent):
    """`torch.cuda.Event` stays a class for the same reason as `_StreamClass`."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        hit("torch.cuda.Event")


def _stream_ctx(_stream_obj: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _synchronize(_device: Any = None) -> None:
    return None


def _patch_torch_cuda() -> None:
    c = torch.cuda
    why = "no CUDA driver: {} raises; megatron-core calls it on every step (fact {})"
    replace(c, "current_device", _current_device, reason=why.format("current_device()", 1))
    replace(c, "Stream", _StreamClass, reason=why.format("Stream()", 2) + " (alltoall dispatcher d2h stream)")
    replace(c, "current_stream", _stream, reason=why.format("current_stream()", 2))
    replace(c, "default_stream", _stream, reason=why.format("default_stream()", 2))
    replace(c, "stream", _stream_ctx, reason=why.format("stream(ctx)", 2))
    replace(c, "Event", _EventClass, reason=why.format("Event()", 2))
    replace(c, "synchronize", _synchronize, reason=why.format("synchronize()", 2))


# -- 3: RNG tracker on the CPU generator ------------------------------------------------------------


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        hit("megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add")
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        # The CPU generator *is* the device generator here, so upstream's "CPU state changed inside a
        # GPU fork" warning would fire on every use; the semantics (swap state in, save it back, restore
        # the caller's) are kept.
        hit("megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork")
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    reason = "CUDA generator state; without CUDA the setter is queued by _lazy_call and never runs (fact 3)"
    replace(mrandom, "_get_cuda_rng_state", get_state, reason=reason)
    replace(mrandom, "_set_cuda_rng_state", set_state, reason=reason)
    tracker = mrandom.CudaRNGStatesTracker
    replace(tracker, "add", add, reason=reason + "; add() seeds torch.cuda", count_hits=False)
    replace(tracker, "fork", fork, reason=reason + "; fork() swaps the CPU generator", count_hits=False)


# -- 4: numpy split sizes for the alltoall dispatcher ----------------------------------------------


def _patch_moe_utils() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    reason = (
        "returns a tensor (not numpy) for CPU inputs even with as_numpy=True, so all_to_all_single "
        "gets split sizes as a tensor (fact 4)"
    )
    # token_dispatcher imported the name, so its binding is the one the dispatcher calls.
    replace(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu, reason=reason)
    replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu, reason=reason)


# -- 5: device="cuda" literals ----------------------------------------------------------------------

_FACTORIES = frozenset(
    [
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand",
        "randn",
        "randint",
        "randperm",
        "linspace",
        "eye",
        "empty_strided",
    ]
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CpuTorch(types.ModuleType):
    """`torch` as one megatron module sees it: factory calls asking for a CUDA device get the CPU."""

    def __init__(self, owner: str) -> None:
        super().__init__("torch")
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        real = getattr(torch, name)
        if name not in _FACTORIES:
            return real
        owner = self._owner

        @functools.wraps(real)
        def on_cpu(*args: Any, **kwargs: Any) -> Any:
            if _is_cuda(kwargs.get("device")):
                hit(f"{owner}.torch.{name}(device='cuda')")
                kwargs["device"] = _CPU
            return real(*args, **kwargs)

        return on_cpu


_CUDA_LITERAL_MODULES = {
    "megatron.core.pipeline_parallel.schedules": "forward_backward_* allocate total_num_tokens on cuda",
    "megatron.core.optimizer.optimizer": "MixedPrecisionOptimizer/FP32Optimizer allocate found_inf, "
    "_scale_one, _dummy_overflow_buf on cuda",
    "megatron.core.optimizer.clip_grads": "get_grad_norm_fp32/clip_grad_by_total_norm_fp32/count_zeros_fp32 "
    "allocate norms on cuda",
    "megatron.core.utils": "local_multi_tensor_l2_norm returns a cuda tensor",
    "megatron.core.optimizer.grad_scaler": "fp16 grad scalers keep their scale on cuda",
    "megatron.core.tensor_parallel.data": "broadcast_data sizes on cuda",
    "megatron.core.transformer.utils": "get_default_causal_mask / sliding-window masks on cuda",
    "megatron.core.dist_checkpointing.exchange_utils": "fully-parallel load buffers on cuda",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "save-plan reuse flag on cuda",
    "megatron.core.distributed.param_and_grad_buffer": "buffer warm-up tensor on cuda",
}


def _patch_cuda_literals() -> None:
    import importlib

    for modname, where in _CUDA_LITERAL_MODULES.items():
        mod = importlib.import_module(modname)
        replace(
            mod,
            "torch",
            _CpuTorch(modname),
            reason=f"device='cuda' hard-coded: {where} (fact 5)",
            count_hits=False,
        )


# -- 6: 'torch.cuda.FloatTensor' type checks --------------------------------------------------------

_tensor_type = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _tensors_report_cuda_type() -> Iterator[None]:
    torch.Tensor.type = _cuda_type_name  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = _tensor_type  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hit(name)
        with _tensors_report_cuda_type():
            return fn(*args, **kwargs)

    return wrapped


def _patch_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    why = "checks param.type() == 'torch.cuda.FloatTensor' and rejects CPU fp32 params (fact 6)"
    cls = distrib_optimizer.DistributedOptimizer
    static = inspect.getattr_static(cls, "_build_model_and_main_param_groups")
    name = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups"
    wrapped = _with_cuda_type_names(static.__func__, name)
    replace(cls, "_build_model_and_main_param_groups", classmethod(wrapped), reason=why, count_hits=False)

    name = "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32"
    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32, name)
    replace(clip_grads, "clip_grad_by_total_norm_fp32", wrapped, reason=why, count_hits=False)
    # optimizer.py imported the name; its binding is the one clip_grad_norm() calls.
    replace(moptimizer, "clip_grad_by_total_norm_fp32", wrapped, reason=why, count_hits=False)


# -- 7: torch norms under sequence parallel ---------------------------------------------------------


class SequenceParallelTorchNorm:
    """Replaces `megatron.core.transformer.torch_norm.WrappedTorchNorm` for the local spec.

    Builds `torch.nn.RMSNorm`/`LayerNorm` like upstream, but accepts `sequence_parallel=True`: the norm
    is per-token, so it is correct on a sequence shard; its weight then sees only that shard's tokens,
    and tagging it `sequence_parallel` makes `finalize_model_grads` all-reduce its grad over TP.
    """

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        hit("megatron.core.transformer.torch_norm.WrappedTorchNorm")
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm:
            raise ValueError("torch norms support neither zero_centered_gamma nor persist_layer_norm")
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


def _patch_norm() -> None:
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import torch_norm, transformer_block

    why = "WrappedTorchNorm asserts not sequence_parallel; without apex/TE it is the only norm (fact 7)"
    upstream = torch_norm.WrappedTorchNorm
    for owner in (torch_norm, backends):
        replace(owner, "WrappedTorchNorm", SequenceParallelTorchNorm, reason=why)
    # Modules that bound the class at import under an alias; with apex present they hold FusedLayerNorm,
    # which supports sequence parallel and is left alone.
    for owner, alias in (
        (backends, "LNImpl"),
        (gpt_layer_specs, "LNImpl"),
        (transformer_block, "LayerNormImpl"),
    ):
        if getattr(owner, alias, None) is upstream:
            replace(owner, alias, SequenceParallelTorchNorm, reason=f"{why} ({alias} alias)")


# -- 8: uneven all-gather / reduce-scatter on gloo --------------------------------------------------


def _is_gloo(group: Any) -> bool:
    return dist.get_backend(group) == "gloo"


def _patch_uneven_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    up_gather = mappings._gather_along_first_dim
    up_scatter = mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return up_gather(input_, group, output_split_sizes, use_global_buffer)
        hit("megatron.core.tensor_parallel.mappings._gather_along_first_dim[uneven]")
        sizes = [int(s) for s in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((width * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        return torch.cat([gathered[r * width : r * width + s] for r, s in enumerate(sizes)], dim=0)

    def reduce_scatter_along_first_dim(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return up_scatter(input_, group, input_split_sizes, use_global_buffer)
        hit("megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim[uneven]")
        sizes = [int(s) for s in input_split_sizes]
        start = sum(sizes[: group.rank()])
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total[start : start + sizes[group.rank()]].contiguous()

    why = "gloo rejects all_gather/reduce_scatter with uneven split sizes (ETP>1 alltoall dispatcher, fact 8)"
    replace(mappings, "_gather_along_first_dim", gather_along_first_dim, reason=why, count_hits=False)
    replace(
        mappings,
        "_reduce_scatter_along_first_dim",
        reduce_scatter_along_first_dim,
        reason=why,
        count_hits=False,
    )


def apply() -> None:
    """Install every megatron-core CPU patch (idempotent; `replace` skips already-applied names)."""
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe_utils()
    _patch_cuda_literals()
    _patch_type_checks()
    _patch_norm()
    _patch_uneven_collectives()
