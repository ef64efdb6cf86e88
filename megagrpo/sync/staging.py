"""The packed CPU transport's shared memory: the parent's staging buffer per engine and the scheduler-side
loader that copies from it (`sync.weights` module doc, "Transport, CPU engine")."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from megagrpo.sync.buckets import NamedTensor


class _Staging:
    """ONE shared-memory buffer per engine, holding every packed tensor of a sync, reused from sync to sync.

    Each send bucket's tensors are views into it, so pickling a bucket passes the same single fd to the
    scheduler on every call, and the buffer's pages are faulted in and zeroed by the kernel once, not on
    every sync. One buffer rather than one per bucket lets the scheduler keep ONE mapping of it from sync
    to sync (`load_packed`): mapping 205 MB afresh costs the scheduler's copy 18 ms of page faults and
    unmapping, about one plain copy of the bytes (docs/scaling.md). Reuse is safe because
    `update_weights_from_tensor` returns only after the scheduler has copied the bucket into its
    parameters. Cost: the buffer stays allocated while the engine lives (one copy of the model in the
    engine's dtype), and the scheduler maps the same pages (no second copy).
    """

    _ALIGN = 64  # bytes; every view starts aligned like a fresh allocation

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)  # uint8 [nbytes], shared memory
        self.used = 0

    @classmethod
    def nbytes(cls, specs: Iterable[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes that views of these (shape, dtype) take, each aligned."""
        return sum(-(-math.prod(shape) * dtype.itemsize // cls._ALIGN) * cls._ALIGN for shape, dtype in specs)

    def begin(self, total: int) -> None:
        """Start a sync that takes at most `total` bytes of views; the buffer grows (a new one) only if needed."""
        if self.buffer.numel() < total:
            storage = torch.UntypedStorage._new_shared(max(total, 1))
            self.buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (max(total, 1),))
        self.used = 0

    def views(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Contiguous tensors of the given (shape, dtype), the next ones in the buffer."""
        if self.used + self.nbytes(specs) > self.buffer.numel():
            raise AssertionError(
                f"staging overrun: {self.used} + {self.nbytes(specs)} > {self.buffer.numel()}"
            )
        out = []
        for shape, dtype in specs:
            n = math.prod(shape) * dtype.itemsize
            out.append(self.buffer[self.used : self.used + n].view(dtype).view(shape))
            self.used += self.nbytes([(shape, dtype)])
        return out


_STAGING: weakref.WeakKeyDictionary[Any, _Staging] = weakref.WeakKeyDictionary()


def _staging_for(eng: Any) -> _Staging:
    return _STAGING.get(eng) or _STAGING.setdefault(eng, _Staging())


# The custom weight loader of CPU engines (`rollout.engines.engine` names it in `custom_weight_loader`).
PACKED_LOADER = f"{__name__}.load_packed"
_HELD: list[torch.UntypedStorage] = []  # in the scheduler process: the storages of the last packed load


def load_packed(model: torch.nn.Module, named_tensors: list[NamedTensor]) -> None:
    """SGLang custom weight loader for packed syncs; runs in the CPU engine's scheduler process.

    Loads as SGLang's `load_format="direct"` does (one `copy_` per parameter, by SGLang name), then keeps
    the received tensors' storages (the parent's `_Staging` buffer, mapped here) until the next call.
    While a storage lives, torch's `rebuild_storage_fd` returns it for the same shared-memory file instead
    of mapping the file again, so the next sync's copy reads pages that are already mapped: no page faults
    and no unmap (18 ms of the 205 MB load here, half of it). Holds no memory of its own: the pages are the
    parent's staging, which lives as long as the engine.

    Tensors SGLang derives from its parameters after a load are derived again, as its own `load_weights`
    does: multi-latent attention's `w_kc`/`w_vc` (from `kv_b_proj`, in `post_load_weights`), which would
    otherwise keep serving the old weights' attention.
    """
    params = dict(model.named_parameters())
    for name, t in named_tensors:  # SGLang's `default_weight_loader`, without importing its model loader
        param = params[name]
        if param.numel() == 1 and t.numel() == 1:
            param.data.fill_(t.item())
        else:
            assert param.size() == t.size(), (
                f"{name}: sent {tuple(t.size())}, parameter {tuple(param.size())}"
            )
            param.data.copy_(t)
    _derive_after_load(model, [name for name, _ in named_tensors])
    _HELD[:] = list({id(s): s for s in (t.untyped_storage() for _, t in named_tensors)}.values())


# Parameters from which SGLang's `post_load_weights` derives tensors that are not parameters (DeepSeek-V3's
# family: w_kc and w_vc split from kv_b_proj per layer).
DERIVED_FROM = (".self_attn.kv_b_proj.weight",)


def _derive_after_load(model: torch.nn.Module, names: list[str]) -> None:
    """SGLang's `post_load_weights` for the layers whose `DERIVED_FROM` parameters were just loaded."""
    loaded = [n for n in names if n.endswith(DERIVED_FROM)]
    if loaded and hasattr(model, "post_load_weights"):
        model.post_load_weights(weight_names=loaded)


def packed_load_format(eng: Any) -> str:
    """`load_packed` when the engine was started with it (`rollout.engines.engine` does so on CPUs), else "direct"."""
    return (
        PACKED_LOADER
        if PACKED_LOADER in (getattr(eng.server_args, "custom_weight_loader", None) or [])
        else "direct"
    )
