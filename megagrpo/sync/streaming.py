"""Check, flatten and send one bucket at a time: a GPU engine's CUDA-IPC transport, and the loop that a
disaggregated engine's broadcast shares (`stream_buckets`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.engines.engine import EngineFailed
from megagrpo.sync.buckets import NamedTensor, tensor_bytes
from megagrpo.sync.checks import _check_ok, _Checker
from megagrpo.sync.stats import SyncStats


def _flatten(bucket: list[NamedTensor]) -> Any:
    """The bucket as SGLang's `FlattenedTensorBucket`: one new buffer holding every tensor's bytes."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return FlattenedTensorBucket(named_tensors=bucket)


def _flattened_payload(flat: Any, tp_size: int) -> list[Any]:
    """One serialized flattened bucket per TP rank (on GPUs a CUDA-IPC handle, not a copy)."""
    from sglang.srt.utils import MultiprocessingSerializer

    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(tp_size)]


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
