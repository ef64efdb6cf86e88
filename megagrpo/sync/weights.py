"""Weight sync learner -> SGLang: validate, send bucket by bucket, optionally verify by checksum.

`sync_weights` takes buckets of `(hf_name, tensor)` (the bridge's streaming export, consumed one bucket at
a time, or `bucketize(...)`) and checks every name, shape and value (finite) before the engine's weights are
overwritten, so a bad export leaves the engine serving the old weights. `sync_weights` says how each
transport manages that without holding the whole export: the CPU engine stages, the GPU engine streams
(its values were checked on the learner's shards first).

This module joins the rooms that do the work: `checks` (names, shapes, values, fused groups), `packing`
into SGLang's layout, `staging` (the shared memory and the scheduler-side loader), `shape_probe` (the
engine's padded shapes), `streaming` (one bucket at a time: the IPC transport, and the broadcast's loop),
`checksums`, and `engine_state` (what an engine fixes for its lifetime).

Transport, CPU engine (TP=1): the parent packs each bucket into SGLang's own parameter layout
(`sglang_layout`: q/k/v fused, gate/up fused, one `w13_weight [E, 2I, H]` and one `w2_weight [E, H, I]` per
MoE layer), in the engine's dtype, directly in shared memory, and sends it with `load_format="direct"` (or
`staging.load_packed`, the same load that also keeps the shared memory mapped in the scheduler): the scheduler
copies each tensor into its parameter with one `copy_`. Why: the HF-named path costs a constant
per TENSOR on both sides (one fd handshake with the parent's resource sharer per tensor, and in SGLang's MoE
`load_weights` a narrow + copy per expert shard after a linear scan of the expert map, so O(E^2) string
tests per layer), and on a loaded CPU every small torch op also pays an OpenMP barrier. Packed, a sync is
about 10 tensors per layer whatever the number of experts, so its time follows the bytes. The packed
path is used when the engine holds every packed name (looked up once per engine) and, for `partial`
syncs, when every fused group is complete; otherwise the HF-named path (`load_weights`) is used.
Padding: SGLang's CPU engine pads MLP intermediate sizes (`sglang_layout` module doc, "Padding"), so the
engine's shapes are asked once, before the first packing (`shape_probe.engine_held_shapes`), and each parameter is
packed in them, its parts in zeroed slots: padded on send rather than loaded into the padded view by a
loader of ours, because the engine's copy then stays one contiguous `copy_` per parameter (SGLang's own
`direct` load works unchanged) and the staged bytes hash like the engine's; the cost is the padding's
zeros in the staging buffer and in both copies, (Ip - I) / I of the expert bytes (none at TP 1 for
every released checkpoint we know of: their sizes are multiples of 32). The HF-named transports send the
checkpoint's shapes (the fewest bytes per rank) and SGLang's loader pads, per TP shard where a GPU kernel
asks for it. All buckets are packed (and checked) before the first is sent, into one shared-memory
staging buffer kept per engine (`staging._Staging`): one extra copy of the model in the engine's dtype, held while
the engine lives.

Transport, GPU engine: one `FlattenedTensorBucket` per bucket (`load_format="flattened_bucket"`), so each
bucket is a single CUDA-IPC handle per TP rank instead of one per tensor; SGLang's `load_weights` shards it
(`streaming.IpcTransport`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.engines.engine import EngineFailed
from megagrpo.sync.buckets import NamedTensor, tensor_bytes
from megagrpo.sync.checks import _check_finite, _check_ok, _Checker, check_announced, checkpoint_shapes
from megagrpo.sync.checksums import _verify_packed, verify_checksum
from megagrpo.sync.engine_state import _per_engine, _sglang_engine
from megagrpo.sync.packing import _full_packing_plan, _pack, _Packer, _packing_plan
from megagrpo.sync.sglang_layout import load_groups
from megagrpo.sync.staging import _staging_for, packed_load_format
from megagrpo.sync.stats import SyncStats
from megagrpo.sync.streaming import _sync_streamed


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
                failed = getattr(
                    engine, "failed", None
                )  # a RolloutEngine's (module doc of rollout.engines.engine)
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
