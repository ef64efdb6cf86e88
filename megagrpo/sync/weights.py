"""Weight sync learner -> SGLang: validate, send bucket by bucket, optionally verify by checksum.

`sync_weights` takes buckets of `(hf_name, tensor)` (the bridge's streaming export, consumed one bucket at
a time, or `bucketize(...)`) and checks every name, shape and value (finite) before the engine's weights are
overwritten, so a bad export leaves the engine serving the old weights. `sync_weights` says how each
transport manages that without holding the whole export: the CPU engine stages, the GPU engine streams
(its values were checked on the learner's shards first).

Transport, CPU engine (TP=1): the parent packs each bucket into SGLang's own parameter layout
(`sglang_layout`: q/k/v fused, gate/up fused, one `w13_weight [E, 2I, H]` and one `w2_weight [E, H, I]` per
MoE layer), in the engine's dtype, directly in shared memory, and sends it with `load_format="direct"` (or
`load_packed`, the same load that also keeps the shared memory mapped in the scheduler): the scheduler
copies each tensor into its parameter with one `copy_`. Why: the HF-named path costs a constant
per TENSOR on both sides (one fd handshake with the parent's resource sharer per tensor, and in SGLang's MoE
`load_weights` a narrow + copy per expert shard after a linear scan of the expert map, so O(E^2) string
tests per layer), and on a loaded CPU every small torch op also pays an OpenMP barrier. Packed, a sync is
about 10 tensors per layer whatever the number of experts, so its time follows the bytes. The packed
path is used when the engine holds every packed name (looked up once per engine) and, for `partial`
syncs, when every fused group is complete; otherwise the HF-named path (`load_weights`) is used.
Padding: SGLang's CPU engine pads MLP intermediate sizes (`sglang_layout` module doc, "Padding"), so the
engine's shapes are asked once, before the first packing (`engine_held_shapes`), and each parameter is
packed in them, its parts in zeroed slots: padded on send rather than loaded into the padded view by a
loader of ours, because the engine's copy then stays one contiguous `copy_` per parameter (SGLang's own
`direct` load works unchanged) and the staged bytes hash like the engine's; the cost is the padding's
zeros in the staging buffer and in both copies, (Ip - I) / I of the expert bytes (none at TP 1 for
every released checkpoint we know of: their sizes are multiples of 32). The HF-named transports send the
checkpoint's shapes (the fewest bytes per rank) and SGLang's loader pads, per TP shard where a GPU kernel
asks for it. All buckets are packed (and checked) before the first is sent, into one shared-memory
staging buffer kept per engine (`_Staging`): one extra copy of the model in the engine's dtype, held while
the engine lives.

Transport, GPU engine: one `FlattenedTensorBucket` per bucket (`load_format="flattened_bucket"`), so each
bucket is a single CUDA-IPC handle per TP rank instead of one per tensor; SGLang's `load_weights` shards it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megagrpo.bridge.hf_io import mtp_layer_prefixes, open_safetensors
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.engine import EngineFailed
from megagrpo.sync import sglang_layout
from megagrpo.sync.buckets import NamedTensor, tensor_bytes
from megagrpo.sync.sglang_layout import (
    FusedParam,
    fuse_into,
    laid_out,
    load_groups,
    sglang_params,
    sglang_plan,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStats:
    bytes: int  # bytes given (sum over the HF tensors of numel * element size, as passed in)
    seconds: float  # wall time of the sync: validation, packing, begin/update/end (not the checksum)
    buckets: int  # update_weights_from_tensor calls
    tensors: int  # HF tensors given
    checksum_ok: bool | None  # None when no checksum was asked for
    packed: bool = False  # True when sent in SGLang's parameter layout (load_format "direct" or load_packed)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def metrics(self) -> dict[str, float]:
        m = {"sync/bytes": float(self.bytes), "sync/seconds": self.seconds, "sync/gbps": self.gbps}
        if self.checksum_ok is not None:
            m["sync/checksum_ok"] = float(self.checksum_ok)
        return m


def _sglang_engine(engine: Any) -> Any:
    return getattr(engine, "engine", engine)  # a RolloutEngine or a bare sglang.Engine


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """{hf_name: shape} of every tensor in the HF checkpoint the engine was started from (headers only)
    that a sync updates: all but its multi-token-prediction layers (`mtp_layer_prefixes`)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    mtp = mtp_layer_prefixes(model_dir)
    for fname in files:
        with open_safetensors(os.path.join(model_dir, fname)) as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not (mtp and k.startswith(mtp)):
                    shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in a float tensor. A sum propagates NaN and inf in one allocation-free pass (2x faster
    here than `aminmax`, 20x faster than `isfinite(t).all()`, which materialises a bool tensor); only a
    non-finite sum, which a finite tensor gives only by overflowing, pays for the exact `aminmax`."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum())):
        return True
    lo, hi = t.aminmax()
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not all_finite(t):
        raise MegagrpoError(f"weight sync: tensor {name!r} holds NaN or inf values")


class _Checker:
    """Checks buckets one at a time against the engine's checkpoint: MegagrpoError naming the first unknown,
    duplicated, misshapen or (with check_finite) non-finite tensor, or the first group that the engine
    fuses at load (`groups`, default `load_groups(expected)`) arriving split over buckets; `finish` names
    missing ones."""

    def __init__(
        self, expected: Mapping[str, tuple[int, ...]], groups: Mapping[str, tuple[str, ...]] | None = None
    ) -> None:
        self.expected = expected
        self.groups = load_groups(expected) if groups is None else groups
        self.seen: set[str] = set()

    def check(self, bucket: list[NamedTensor], *, check_finite: bool) -> None:
        names = {name for name, _ in bucket}
        for name, t in bucket:
            if not torch.is_tensor(t):
                raise MegagrpoError(f"weight sync: {name!r} is a {type(t).__name__}, not a tensor")
            if name not in self.expected:
                raise MegagrpoError(
                    f"weight sync: tensor {name!r} is not in the engine's checkpoint; the export and the rollout "
                    "model directory disagree (check the bridge's name map for this architecture)"
                )
            if name in self.seen:
                raise MegagrpoError(f"weight sync: tensor {name!r} is sent twice")
            if tuple(t.shape) != tuple(self.expected[name]):
                raise MegagrpoError(
                    f"weight sync: tensor {name!r} has shape {tuple(t.shape)}, the engine expects "
                    f"{tuple(self.expected[name])}"
                )
            if check_finite:
                _check_finite(name, t)
            self._check_whole(name, names)
            self.seen.add(name)

    def _check_whole(self, name: str, bucket: set[str]) -> None:
        """MegagrpoError when `name` belongs to a group that SGLang fuses at load and an earlier bucket held
        part of it: the loader would have dropped that part without a word (`sglang_layout.load_groups`).
        The last line of defence, caught before the earlier bucket is sent on every transport (streamed
        ones send bucket N once N + 1 has passed these checks); the export's buckets keep groups whole
        (`bridge.bucketing`). A group that a partial sync leaves incomplete is no split: SGLang loads it
        through `load_weights` as it does any subset."""
        group = self.groups.get(name)
        earlier = [g for g in group if g in self.seen and g not in bucket] if group else []
        if earlier:
            raise MegagrpoError(
                f"weight sync: tensor {name!r} arrives in a later bucket than {earlier}, which SGLang fuses "
                "with it at load: split over two loads, the engine would drop the lone part and keep serving "
                "its old weights. Keep each fused group in one bucket (the export's `together`, "
                "`sync.bucketize`)"
            )

    def finish(self) -> None:
        missing = sorted(set(self.expected) - self.seen)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise MegagrpoError(f"weight sync: tensors missing from the export: {missing[:3]}{more}")


def check_announced(
    expected: Mapping[str, tuple[int, ...]],
    announced: Mapping[str, tuple[int, ...]],
    *,
    partial: bool = False,
) -> None:
    """`validate_buckets` for an export's announced names and shapes, before any of its values exist (meta
    tensors hold none). The common case, an announcement that matches, costs one dict comparison."""
    if all(expected.get(n) == tuple(s) for n, s in announced.items()) and (
        partial or len(announced) == len(expected)
    ):
        return
    checker = _Checker(expected)
    checker.check([(n, torch.empty(s, device="meta")) for n, s in announced.items()], check_finite=False)
    if not partial:
        checker.finish()


def validate_buckets(
    buckets: list[list[NamedTensor]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    partial: bool = False,
    check_finite: bool = True,
) -> None:
    """Raise MegagrpoError naming the first unknown, duplicated, misshapen, non-finite (when check_finite)
    or (unless partial) missing tensor."""
    checker = _Checker(expected)
    for bucket in buckets:
        checker.check(bucket, check_finite=check_finite)
    if not partial:
        checker.finish()


def _check_ok(result: Any, what: str) -> None:
    ok, msg = (result[0], result[1]) if isinstance(result, tuple) else (getattr(result, "success", True), "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg or result}")


def _flatten(bucket: list[NamedTensor]) -> Any:
    """The bucket as SGLang's `FlattenedTensorBucket`: one new buffer holding every tensor's bytes."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return FlattenedTensorBucket(named_tensors=bucket)


def _flattened_payload(flat: Any, tp_size: int) -> list[Any]:
    """One serialized flattened bucket per TP rank (on GPUs a CUDA-IPC handle, not a copy)."""
    from sglang.srt.utils import MultiprocessingSerializer

    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(tp_size)]


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

# The custom weight loader of CPU engines (`rollout.engine` names it in `custom_weight_loader`).
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


# The probe of a CPU engine's real parameter shapes (`rollout.engine` names it in `custom_weight_loader`
# beside `load_packed`). Layout of the probe's one uint8 tensor, both ways: 8 bytes little-endian length,
# then that many bytes of JSON.
SHAPES_PROBE = f"{__name__}.report_shape_mismatches"
_PROBE_NAME = "megagrpo.shape_probe"


def report_shape_mismatches(model: torch.nn.Module, named_tensors: list[NamedTensor]) -> None:
    """SGLang custom weight loader that loads nothing; runs in the CPU engine's scheduler process.

    Its one tensor (`_PROBE_NAME`, in shared memory: the scheduler maps the parent's pages, as for
    `load_packed`) holds `{sglang_param_name: shape}` as JSON; it is overwritten with the JSON list of
    `[name, shape sent, shape the engine holds or None]` for every parameter that differs, which the parent
    reads back when the call returns. Why: the engine's parameters can differ from the checkpoint's
    shapes (SGLang's CPU MoE pads the expert intermediate size), and a packed load of a misshapen tensor
    raises inside the scheduler, which kills the scheduler, whose SIGQUIT then kills the trainer
    (SGLang's process-tree handler) with no error naming the tensor. Asking first keeps the scheduler
    alive and the error ours."""
    ((_, buf),) = named_tensors
    asked = json.loads(_read_probe(buf))
    params = dict(model.named_parameters())
    bad = [
        [name, shape, list(params[name].shape) if name in params else None]
        for name, shape in asked.items()
        if name not in params or list(params[name].shape) != shape
    ]
    _write_probe(buf, json.dumps(bad).encode())


def _read_probe(buf: torch.Tensor) -> bytes:
    n = int.from_bytes(bytes(buf[:8].tolist()), "little")
    return bytes(buf[8 : 8 + n].tolist())


def _write_probe(buf: torch.Tensor, data: bytes) -> None:
    if 8 + len(data) > buf.numel():
        raise ValueError(f"shape probe: {len(data)} bytes do not fit its buffer of {buf.numel()}")
    buf[: 8 + len(data)] = torch.tensor(list(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)


def engine_shape_mismatches(
    eng: Any, plan: Mapping[str, FusedParam]
) -> list[tuple[str, tuple, tuple | None]]:
    """`(sglang name, shape in plan, shape the engine holds or None)` for every parameter of `plan` that the
    engine does not hold as planned, asked of the engine itself (`report_shape_mismatches`) in the
    weight-update session the caller has open. Cost: one update call carrying the plan's names and shapes
    as JSON (tens of KB), and in the scheduler a walk of its parameters; nothing is loaded."""
    asked = json.dumps({fp.name: list(fp.shape) for fp in plan.values()}).encode()
    # Shared memory: the scheduler maps these pages and writes its answer into them.
    buf = torch.zeros(8 + 2 * len(asked) + 4096, dtype=torch.uint8).share_memory_()
    _write_probe(buf, asked)
    result = eng.update_weights_from_tensor([(_PROBE_NAME, buf)], load_format=SHAPES_PROBE, flush_cache=False)
    _check_ok(result, "update_weights_from_tensor (the shape probe)")
    return [(n, tuple(s), None if h is None else tuple(h)) for n, s, h in json.loads(_read_probe(buf))]


def engine_held_shapes(eng: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """{SGLang parameter name: the shape the engine holds} for the packing plan of checkpoint `shapes`
    (None where it lacks the parameter), asked of the engine once (`engine_shape_mismatches`, in a
    weight-update session of its own that loads nothing) and kept: its shapes are fixed for its lifetime.
    Engines started without the probe (not by `rollout.engine` on a CPU) are not asked: {} (the planned
    shapes are taken as theirs). Cost, once per engine: the probe's one call (module doc of the probe)."""
    if SHAPES_PROBE not in (getattr(eng.server_args, "custom_weight_loader", None) or []):
        return {}

    def ask() -> dict[str, tuple[int, ...]]:
        plan = sglang_plan(shapes)
        _check_ok(eng.begin_weight_update(), "begin_weight_update (the shape probe)")
        open_session = True
        try:
            bad = engine_shape_mismatches(eng, plan)
        except EngineFailed:
            open_session = False  # no scheduler is left to end the session: asking would wait forever
            raise
        finally:
            if open_session:
                _check_ok(eng.end_weight_update(), "end_weight_update (the shape probe)")
        held = {fp.name: fp.shape for fp in plan.values()}
        held.update({name: h for name, _, h in bad})
        return held

    return _per_engine(eng, "held_shapes", ask)


def _lay_out(
    touched: Mapping[str, FusedParam],
    held: Mapping[str, tuple[int, ...]],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, FusedParam]:
    """`touched` laid out in the engine's shapes (`sglang_layout.laid_out`: zero-padded slots), or a
    MegagrpoError naming the first parameter the engine holds in a shape that is no padding of the plan's
    (or lacks), before anything is sent."""
    out: dict[str, FusedParam] = {}
    bad: list[tuple[str, tuple[int, ...], Any]] = []
    for name, fp in touched.items():
        h = held.get(name, fp.shape)
        fitted = None if h is None else laid_out(fp, h, shapes)
        if fitted is None:
            bad.append((name, fp.shape, h))
        else:
            out[name] = fitted
    if bad:
        name, sent, h = bad[0]
        held_says = "does not hold it" if h is None else f"holds {tuple(h)}"
        raise MegagrpoError(
            f"weight sync: the engine's parameter {name!r}: the learner's export packs {sent}, the engine "
            f"{held_says}, which is no zero-padding of it ({len(bad)} parameter(s) differ; nothing was sent, "
            "the engine keeps its weights). Set sync.pack=false to send HF-named tensors through SGLang's "
            "own loader"
        )
    return out


def packed_load_format(eng: Any) -> str:
    """`load_packed` when the engine was started with it (`rollout.engine` does so on CPUs), else "direct"."""
    return (
        PACKED_LOADER
        if PACKED_LOADER in (getattr(eng.server_args, "custom_weight_loader", None) or [])
        else "direct"
    )


def _staging_for(eng: Any) -> _Staging:
    return _STAGING.get(eng) or _STAGING.setdefault(eng, _Staging())


# What an engine's model fixes for its lifetime (its checkpoint's shapes, its parameter names, the full-sync
# packing plan), computed on its first sync rather than on every one.
_PER_ENGINE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def _per_engine(eng: Any, key: str, compute: Callable[[], Any]) -> Any:
    known = _PER_ENGINE.setdefault(eng, {})
    if key not in known:
        known[key] = compute()
    return known[key]


def _engine_param_names(eng: Any) -> frozenset[str]:
    """Names of the engine's parameters and buffers (from one checksum pass), cached per engine."""
    return _per_engine(eng, "param_names", lambda: frozenset(engine_checksums(eng)))


def _packing_plan(
    eng: Any, shapes: Mapping[str, tuple[int, ...]], buckets: list[list[NamedTensor]]
) -> dict[str, FusedParam] | None:
    """{hf_name: the SGLang parameter it goes into, in the engine's shapes} when every bucket can be sent
    packed, else None. MegagrpoError when the engine holds a touched parameter in a shape that is no
    zero-padding of the planned one (`_lay_out`); asks the engine its shapes on its first call."""
    sent = {name for b in buckets for name, _ in b}
    owner = {part: fp for fp in sglang_plan(shapes).values() for part in fp.parts}
    touched = {owner[name].name: owner[name] for name in sent}
    held = _engine_param_names(eng)
    unknown = sorted(n for n in touched if n not in held)
    incomplete = sorted(n for n, fp in touched.items() if not sent.issuperset(fp.parts))
    if unknown or incomplete:
        logger.info(
            "weight sync: sending HF-named tensors through load_weights (engine lacks %s; incomplete groups %s)",
            unknown[:3],
            incomplete[:3],
        )
        return None
    fitted = _lay_out(touched, engine_held_shapes(eng, shapes), shapes)
    return {part: fitted[fp.name] for part, fp in owner.items() if fp.name in fitted}


class _Packer:
    """Packs HF tensors, bucket by bucket, into `(sglang_param_name, tensor in dtype)` send buckets, the
    tensors of one send bucket being views of one shared-memory buffer of `staging`; a fused parameter
    travels with the bucket that completes it. Raises MegagrpoError naming the HF tensor when a value is
    NaN/inf, or does not fit `dtype` (inf after the cast)."""

    def __init__(self, owner: Mapping[str, FusedParam], dtype: torch.dtype, staging: _Staging | None = None):
        self.owner, self.dtype, self.staging = owner, dtype, staging or _Staging()
        params = {fp.name: fp for fp in owner.values()}  # room for every parameter that `owner` can fill
        self.staging.begin(
            _Staging.nbytes((fp.shape, sglang_layout.engine_dtype(fp.name, dtype)) for fp in params.values())
        )
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.sends: list[list[NamedTensor]] = []

    def add(self, bucket: list[NamedTensor]) -> None:
        ready: list[tuple[FusedParam, list[torch.Tensor]]] = []
        for name, t in bucket:
            fp = self.owner[name]
            got = self.pending.setdefault(fp.name, {})
            got[name] = t
            if len(got) == len(fp.parts):
                del self.pending[fp.name]
                ready.append((fp, [got[p] for p in fp.parts]))
        if not ready:
            return
        outs = self.staging.views(
            [(fp.shape, sglang_layout.engine_dtype(fp.name, self.dtype)) for fp, _ in ready]
        )
        for (fp, parts), out in zip(ready, outs):
            fuse_into(out, parts, fp.slot)
            if not all_finite(out):
                _raise_non_finite(fp, parts, out.dtype)
        self.sends.append([(fp.name, out) for (fp, _), out in zip(ready, outs)])

    def finish(self) -> list[list[NamedTensor]]:
        assert not self.pending, (
            f"incomplete groups after packing: {sorted(self.pending)[:3]}"
        )  # plan checked
        return self.sends


def _pack(
    buckets: list[list[NamedTensor]],
    owner: Mapping[str, FusedParam],
    dtype: torch.dtype,
    staging: _Staging | None = None,
) -> list[list[NamedTensor]]:
    """Every bucket through one `_Packer` (see there)."""
    packer = _Packer(owner, dtype, staging)
    for bucket in buckets:
        packer.add(bucket)
    return packer.finish()


def _raise_non_finite(fp: FusedParam, parts: list[torch.Tensor], dtype: torch.dtype) -> None:
    for name, t in zip(fp.parts, parts):
        _check_finite(name, t)
    for name, t in zip(fp.parts, parts):
        if not all_finite(t.to(dtype)):
            raise MegagrpoError(
                f"weight sync: tensor {name!r} has values outside the range of the engine's dtype {dtype}"
            )
    raise MegagrpoError(f"weight sync: parameter {fp.name!r} holds NaN or inf values")


def sync_weights(
    engine: Any,
    buckets: Iterable[list[NamedTensor]],
    *,
    checksum: bool = False,
    partial: bool = False,
    pack: bool = True,
    before_send: Callable[[], None] | None = None,
    announced: Mapping[str, tuple[int, ...]] | None = None,
    streamed: bool | None = None,
) -> SyncStats:
    """Send HF-named tensors into a running SGLang engine. Returns `SyncStats` (see `metrics()`).

    engine: a `RolloutEngine` or `sglang.Engine`. buckets: lists of `(hf_name, tensor)` with HF checkpoint
    names and full (unsharded) shapes, any float dtype (cast to the engine's); an iterator (the bridge's
    streaming export) is consumed one bucket at a time. partial: allow sending a subset of the checkpoint.
    checksum: after the update, compare SGLang's per-parameter hashes with hashes of what was sent (TP=1
    engines). pack: on a CPU TP=1 engine, send in SGLang's parameter layout (see the module doc); False
    always sends HF names through SGLang's `load_weights`. announced: the names and shapes the export will
    yield (`bridge.maps.hf_shapes`), checked against the engine's checkpoint before the first bucket is
    read, so that a streamed sync can fail on a name or shape after its first send only if the export
    breaks its own announcement. streamed: the GPU transport (flattened buckets, one in flight); None =
    when the tensors are on a GPU; True forces it for CPU tensors (its memory bound is tested there).

    Nothing is overwritten before everything is checked, so a bad export (an unknown, misshapen, missing or
    NaN/inf tensor, named in the error) leaves the engine serving its old weights. Only then is
    `before_send` called (e.g. to resume the engine's released `weights` region: with SGLang's memory saver
    a resumed region holds garbage until written, so a bad export must be caught while it is released).
    How, by transport:
    - packed (full sync on a CPU TP=1 engine): each bucket is checked and packed into the engine's
      shared-memory staging (`_Staging`, one model in the engine's dtype, kept while the engine lives) as
      it arrives and then dropped; the staged buckets are sent after the last one. Extra memory held: the
      staging and one export bucket.
    - GPU (flattened buckets over CUDA IPC): streamed, one bucket checked and sent at a time
      (`_sync_streamed`), so the sending rank holds two export buckets at most. The values were checked
      on the learner's own shards before the export (`trainer.weights.check_learner_weights`) and its names and shapes as
      `announced` before any send; the check of each bucket catches an export that breaks its
      announcement, at the cost that a bucket failing it after the first was sent leaves a partly
      updated engine (the error says so).
    - HF-named on the CPU, and partial syncs: the buckets are held until all are checked (a debugging
      transport and small partial updates).

    On any error `buckets` is still consumed to its end (each bucket dropped as it comes) before the error
    is raised: the streaming export's gathers are collectives that the other ranks of this owner's replica
    are in, so they finish the export and reach the caller's agreement on the failure (`dist.agree`).
    """
    it = iter(buckets)
    try:
        return _sync_weights(
            engine, it, checksum=checksum, partial=partial, pack=pack, before_send=before_send,
            announced=announced, streamed=streamed,
        )  # fmt: skip
    except Exception:
        for _ in it:
            pass
        raise


def _sync_weights(
    engine: Any,
    buckets: Iterator[list[NamedTensor]],
    *,
    checksum: bool,
    partial: bool,
    pack: bool,
    before_send: Callable[[], None] | None,
    announced: Mapping[str, tuple[int, ...]] | None,
    streamed: bool | None,
) -> SyncStats:
    t0 = time.perf_counter()
    eng = _sglang_engine(engine)
    shapes = _per_engine(eng, "shapes", lambda: checkpoint_shapes(eng.server_args.model_path))
    tp_size = int(eng.server_args.tp_size)
    if announced is not None:
        check_announced(shapes, announced, partial=partial)
    stream = _nonempty(buckets)
    first = next(stream, None)
    if first is None:
        raise MegagrpoError("weight sync got no tensors; the export yielded nothing")
    on_gpu = any(t.is_cuda for _, t in first)
    checker = _Checker(shapes, _per_engine(eng, "groups", lambda: load_groups(shapes)))
    rest = _prepend([first], stream)
    del first  # from here on only `rest` holds it, and drops it once the next bucket is asked for
    if (on_gpu if streamed is None else streamed) and not partial:
        return _sync_streamed(eng, rest, checker, tp_size, checksum, before_send, t0)
    packable = pack and not on_gpu and tp_size == 1
    dtype = eng.tokenizer_manager.model_config.dtype
    owner = _full_packing_plan(eng, shapes) if packable and not partial else None
    if owner is not None:  # staged: check and pack as the buckets arrive
        packer = _Packer(owner, dtype, _staging_for(eng))
        nbytes = tensors = 0
        for bucket in rest:
            checker.check(bucket, check_finite=False)  # finiteness is checked on the packed tensors
            packer.add(bucket)
            nbytes += sum(tensor_bytes(t) for _, t in bucket)
            tensors += len(bucket)
        checker.finish()
        sends = packer.finish()
        held: list[list[NamedTensor]] | None = None
    else:
        held = list(rest)
        for bucket in held:
            checker.check(bucket, check_finite=False)
        if not partial:
            checker.finish()
        owner = _packing_plan(eng, shapes, held) if packable else None
        if owner is None:
            for bucket in held:  # names and shapes were checked above
                for name, t in bucket:
                    _check_finite(name, t)
            sends = held
        else:
            sends = _pack(held, owner, dtype, _staging_for(eng))
        nbytes = sum(tensor_bytes(t) for b in held for _, t in b)
        tensors = sum(map(len, held))

    if before_send is not None:
        before_send()
    _check_ok(eng.begin_weight_update(), "begin_weight_update")
    fmt = packed_load_format(eng)
    open_session = True
    try:
        for i, bucket in enumerate(sends):
            last = i == len(sends) - 1
            try:
                if owner is not None:
                    result = eng.update_weights_from_tensor(bucket, load_format=fmt, flush_cache=last)
                else:
                    result = eng.update_weights_from_tensor(bucket, flush_cache=last)
            except (EngineFailed, RuntimeError) as e:  # RuntimeError: the failed engine stopped its loop
                failed = getattr(engine, "failed", None)  # a RolloutEngine's (module doc of rollout.engine)
                if failed is None:
                    raise
                open_session = False  # no scheduler is left to end it: asking would wait forever
                raise EngineFailed(f"weight sync: {failed}. {_loading(bucket, i, len(sends))}") from e
            _check_ok(result, "update_weights_from_tensor")
    except (EngineFailed, RuntimeError) as e:
        if isinstance(e, EngineFailed) or getattr(engine, "failed", None) is not None:
            open_session = False
            if not isinstance(e, EngineFailed):
                raise EngineFailed(f"weight sync: {engine.failed}") from e
        raise
    finally:
        if open_session:
            _check_ok(eng.end_weight_update(), "end_weight_update")
    seconds = time.perf_counter() - t0
    ok = None
    if checksum:
        ok = verify_checksum(eng, held) if held is not None else _verify_packed(eng, sends)
    return SyncStats(
        bytes=nbytes,
        seconds=seconds,
        buckets=len(sends),
        tensors=tensors,
        checksum_ok=ok,
        packed=owner is not None,
    )


def _loading(bucket: list[NamedTensor], index: int, count: int, shown: int = 4) -> str:
    """What the engine was loading when it failed, for the error: the bucket and its first tensors."""
    names = ", ".join(f"{n} {tuple(t.shape)}" for n, t in bucket[:shown])
    more = f" and {len(bucket) - shown} more" if len(bucket) > shown else ""
    return f"It failed loading bucket {index + 1} of {count}: {names}{more}; the engine is partly updated"


def _full_packing_plan(eng: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FusedParam] | None:
    """The packing plan of a full sync (every checkpoint tensor sent), None when the engine lacks a packed name."""
    return _per_engine(
        eng, "full_plan", lambda: _packing_plan(eng, shapes, [[(name, None) for name in shapes]])
    )


def _nonempty(buckets: Iterable[Iterable[NamedTensor]]) -> Iterator[list[NamedTensor]]:
    """Each non-empty bucket as a list. Holds no bucket while it asks for the next (a `for` loop or a
    generator expression would keep the last one alive while the export builds the next one)."""
    it = iter(buckets)
    while (bucket := next(it, None)) is not None:
        bucket = list(bucket)
        if bucket:
            yield bucket
        del bucket


def _prepend(box: list[list[NamedTensor]], rest: Iterator[list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
    """`box`'s one bucket, then `rest`; `box` is emptied, so that nothing here holds the first bucket once
    it is consumed (`itertools.chain` would keep it until the end)."""
    yield box.pop()
    yield from rest


class IpcTransport:
    """A colocated GPU engine: each flattened bucket passed as CUDA-IPC handles, one per TP rank."""

    def __init__(self, eng: Any, tp_size: int) -> None:
        self.eng, self.tp_size = eng, tp_size
        self.name = "the engine"

    def begin(self) -> None:
        _check_ok(self.eng.begin_weight_update(), "begin_weight_update")

    def flatten(self, bucket: list[NamedTensor], cast: torch.dtype | None, *, fresh: bool) -> Any:
        """A new buffer per bucket: its CUDA-IPC handle outlives the send until the engine lets it go."""
        return _flatten(bucket if cast is None else [(n, t.to(cast)) for n, t in bucket])

    def send(self, flat: Any, last: bool) -> None:
        result = self.eng.update_weights_from_tensor(
            _flattened_payload(flat, self.tp_size), load_format="flattened_bucket", flush_cache=last
        )
        _check_ok(result, "update_weights_from_tensor")

    def dropped(self) -> None:
        _collect_ipc()  # the sent bucket's last reference here is gone: its device memory can go too

    def end(self) -> None:
        _check_ok(self.eng.end_weight_update(), "end_weight_update")


def _sync_streamed(
    eng, buckets, checker: _Checker, tp_size: int, checksum: bool, before_send, t0
) -> SyncStats:
    if checksum:
        raise MegagrpoError("weight sync checksum needs the CPU engine; set sync.checksum=false on GPUs")
    return stream_buckets(buckets, checker, IpcTransport(eng, tp_size), before_send, t0)


def stream_buckets(
    buckets: Iterable[list[NamedTensor]],
    checker: _Checker,
    transport: Any,
    before_send: Callable[[], None] | None,
    t0: float,
    *,
    cast: torch.dtype | None = None,
    keep: list[Any] | None = None,
) -> SyncStats:
    """Check, flatten and send one bucket at a time (a GPU engine's IPC, or a disaggregated engine's
    broadcast: `transport.begin()`, `flatten(...)`, `send(flat, last)`, `dropped()` once a sent bucket is let go,
    `end()`).

    Bucket N is sent once N + 1 has passed its checks (the last send flushes the cache, so it must know
    that it is the last; and a one-bucket export is sent only after `finish` found nothing missing). Each
    bucket is flattened as soon as the one before it is sent, and its own tensors are dropped then, so
    this rank holds two buckets at most: the flattened N waiting, and N + 1 being built by the export or
    checked; during a send, the flattened N and the checked N + 1; while N + 1 is flattened, N + 1 and
    its flattened copy; plus, with a transport whose send returns before the bucket is received (a
    disaggregated engine's `BroadcastTransport`), the bucket still on the wire. That holds when the export keeps no bucket it has yielded (`bridge.export`,
    `_nonempty`); tensors that alias the learner's parameters (no gather, no cast) are the learner's
    memory, not a bucket's. `cast`: the engine's dtype, applied as the bucket is flattened (a bf16 engine
    receives half an fp32 learner's bytes), by `transport.flatten(bucket, cast, fresh=)`, which may reuse a
    buffer of its own unless `fresh`. `keep`: a list that collects every flattened bucket sent (a checksum
    needs them; it costs a copy of the model)."""
    nbytes = tensors = calls = 0
    pending: Any = None  # the previous bucket, flattened
    begun = False

    def send(flat: Any, last: bool) -> None:
        nonlocal begun, calls
        if not begun:  # the engine's weights are resumed only once a first bucket has passed the checks
            if before_send is not None:
                before_send()
            transport.begin()
            begun = True
        transport.send(flat, last)  # the last send flushes the cache
        calls += 1
        if keep is not None:
            keep.append(flat)

    try:
        it = iter(buckets)
        while (bucket := next(it, None)) is not None:
            checker.check(bucket, check_finite=True)
            nbytes += sum(tensor_bytes(t) for _, t in bucket)
            tensors += len(bucket)
            if pending is not None:
                send(pending, last=False)
                pending = None  # freed before the next flattened copy is made
                transport.dropped()
            pending = transport.flatten(bucket, cast, fresh=keep is not None)
            del bucket  # only its flattened copy is held while the export builds the next bucket
        checker.finish()
        send(pending, last=True)
        begun = False  # ended here, so that a failure of the last bucket (seen by `end`) is reported below
        transport.end()
    except EngineFailed:
        begun = False  # an in-process engine whose scheduler is gone: ending the session would wait forever
        raise
    except MegagrpoError as e:
        if calls:
            raise MegagrpoError(
                f"{e} ({calls} bucket(s) were already sent, the last possibly not received: "
                f"{transport.name} is partly updated)"
            ) from e
        raise
    finally:
        if begun:
            transport.end()
    return SyncStats(
        bytes=nbytes, seconds=time.perf_counter() - t0, buckets=calls, tensors=tensors, checksum_ok=None
    )


def _collect_ipc() -> None:
    """Free the device memory of sent buckets that the engine has already let go of: a CUDA tensor shared
    over IPC outlives its last reference here until the receiver has released it, and torch frees it only
    when asked (or at its next share)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()


def _verify_packed(eng: Any, sends: list[list[NamedTensor]]) -> bool:
    """True when every staged SGLang parameter hashes like the engine's copy of it."""
    held = engine_checksums(eng)
    common = [(n, t) for b in sends for n, t in b if n in held]
    if not common:
        raise MegagrpoError("weight sync checksum: no sent tensor maps onto an engine parameter")
    return all(_hash(t) == held[n] for n, t in common)


def engine_checksums(engine: Any) -> dict[str, str]:
    """SGLang's per-parameter hashes of what the engine holds now ({sglang_param_name: hex}), TP rank 0."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    eng = _sglang_engine(engine)
    ok, msg, ranks, _ = eng.loop.run_until_complete(
        eng.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None)
    )
    if not ok or not ranks:
        raise RuntimeError(f"SGLang check_weights(checksum) failed: {msg}")
    return dict(ranks[0]["checksums"])


def _hash(t: torch.Tensor) -> str:
    # Same digest as sglang.srt.managers.mm_utils.tensor_hash on the CPU: sha256 of the bytes, first 8 bytes.
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], 'big'):016x}"


def verify_checksum(engine: Any, buckets: list[list[NamedTensor]]) -> bool:
    """True when every SGLang parameter built from the sent tensors hashes like the engine's copy.

    The sent tensors are cast to the engine's dtype and fused the way SGLang fuses them (`sglang_layout`).
    Raises MegagrpoError when the engine runs with TP > 1 (its parameters are shards) or when none of the
    sent tensors maps onto an engine parameter.
    """
    eng = _sglang_engine(engine)
    if int(eng.server_args.tp_size) != 1:
        raise MegagrpoError("weight sync checksum supports engines with tp_size=1 only; set checksum=false")
    dtype = eng.tokenizer_manager.model_config.dtype
    sent = {name: t.to(sglang_layout.engine_dtype(name, dtype)) for b in buckets for name, t in b}
    shapes = _per_engine(eng, "shapes", lambda: checkpoint_shapes(eng.server_args.model_path))
    expected = sglang_params(sent, engine_held_shapes(eng, shapes))
    held = engine_checksums(eng)
    common = [n for n in expected if n in held]
    if not common:
        raise MegagrpoError("weight sync checksum: no sent tensor maps onto an engine parameter")
    return all(_hash(expected[n]) == held[n] for n in common)
