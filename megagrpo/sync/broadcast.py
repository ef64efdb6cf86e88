"""Weights to a disaggregated engine: a broadcast group per engine, fed bucket by bucket.

The learner rank that owns engine e (it receives the whole export from its model-parallel replica,
`bridge.export`) hosts a process group of 1 + engine_tp ranks: itself as rank 0 and the engine's TP
workers as ranks 1.. (SGLang's `init_weights_update_group`, over HTTP). gloo on the CPU, NCCL on GPUs.
Each bucket is announced over HTTP (`update_weights_from_distributed`: names, dtypes, shapes, as one
`flattened_bucket`) while the owner broadcasts its bytes; SGLang receives into a fresh buffer and loads it.

Cost per sync, at the owner: the model's bytes in the engine's dtype, once per engine (the broadcast
reaches every TP rank of the engine at once), in buckets of `sync.bucket_mb`. `send` returns once a
bucket's broadcast has started, so bucket N is on the wire and loaded by SGLang while N + 1 is checked,
cast and copied; one bucket is in flight at most (the next `send`, and `end`, wait for it). The owner
therefore holds three buckets at most: the export's N + 2 being built or checked
(`sync.streaming.stream_buckets`) and two send buffers of `sync.bucket_mb` in the engine's dtype each
(`flatten`), the one in flight and the one being filled; a blocking send would need one. At the engine:
one received bucket beside its weights.

Safety. Names and shapes are checked against the engine's checkpoint before the first byte is sent, the
values were checked on the learner's shards (`trainer.weights.check_learner_weights`), and each bucket is
checked again before it is sent: a bad bucket found before the first send leaves the engine serving its
old weights; one found later (an export that breaks its own announcement) stops the run with an error that
names the engine, the tensor and how many buckets were sent, since the engine is then partly updated.
Every wait (the group's set-up, each bucket, the checksum) has the engine deadline
(`rollout.placement.engine_timeout_s`); a dead engine fails the HTTP call or the broadcast at once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import threading
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.errors import MegagrpoError
from megagrpo.net import advertised_host, free_port
from megagrpo.rollout.engines.remote import RemoteEngine
from megagrpo.sync.buckets import NamedTensor
from megagrpo.sync.checks import _Checker, check_announced, checkpoint_shapes
from megagrpo.sync.checksums import _hash
from megagrpo.sync.sglang_layout import load_groups
from megagrpo.sync.stats import SyncStats
from megagrpo.sync.streaming import stream_buckets

GROUP_PREFIX = "megagrpo-weights-"
POLL_S = 0.002  # how often a broadcast in flight looks at the engine's answer


@dataclasses.dataclass
class _InFlight:
    """A bucket whose broadcast was started by `send` and not yet waited for."""

    work: Any  # the broadcast's `dist.Work`
    announced: concurrent.futures.Future  # the engine's answer to the announcement
    bucket: int  # 1-based, in this sync
    buffer: int | None  # which of the two send buffers holds its bytes (None: a fresh one)
    issued: float  # time.monotonic() when the broadcast started


class BroadcastTransport:
    """Engine `remote`'s weights group, hosted by this rank (group rank 0)."""

    def __init__(self, remote: RemoteEngine, *, timeout_s: float, stage: int | None = None) -> None:
        """`stage`: the pipeline stage whose tensors this rank sends (its own group per stage; None: the
        whole model, PP 1). With a stage, `begin`/`end` leave the engine's weight-update session alone:
        the engine's owner opens and closes it around every stage's sends (`sync.stages`)."""
        self.remote, self.timeout_s = remote, timeout_s
        self.session = stage is None  # whether `begin`/`end` open and close the engine's session
        self.name = remote.name if stage is None else f"{remote.name}, pipeline stage {stage}"
        self.group_name = f"{GROUP_PREFIX}{remote.index}" + ("" if stage is None else f"-stage{stage}")
        self.group: Any = None
        self._store: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"weights-{remote.index}")
        self._bufs: list[torch.Tensor | None] = [None, None]  # the two send buffers (`flatten`)
        self._next_buf = 0  # the one `flatten` fills next: never the bucket's in flight
        self._in_flight: _InFlight | None = None  # the bucket `send` started and nobody waited for yet
        self._sent = 0  # buckets started in this sync, to name the one that fails
        self.shapes: dict[str, tuple[int, ...]] | None = None  # the engine checkpoint's names and shapes
        self.groups: dict[str, tuple[str, ...]] | None = None  # what it fuses at load (`load_groups`)

    def open(self) -> None:
        """Create the group: this rank hosts its store on a free port, the engine's TP workers join. The
        group forms on a thread of its own while the engine's answer to `/init_weights_update_group` is
        awaited here: an engine that refuses (HTTP 400, say a group of that name exists) ends the wait at
        once with its answer, rather than leaving this rank in the group's rendezvous until
        `engine_timeout_s` and a bare `DistStoreError`. Cost: one HTTP round trip, the group's rendezvous
        over this rank's store (1 + engine_tp ranks), and on a refusal one thread left in that rendezvous
        until its deadline (the run stops)."""
        if self.group is not None:
            return
        tp = int(self.remote.cfg.tp_size)
        # the engine's TP workers join this rank's store: the address of the interface that routes to them
        host, port = (
            advertised_host(urllib.parse.urlsplit(self.remote.url).hostname or "127.0.0.1"),
            free_port(),
        )
        timeout = datetime.timedelta(seconds=self.timeout_s)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._store = dist.TCPStore(
            host, port, 1 + tp, is_master=True, timeout=timeout, wait_for_workers=False
        )
        joined = self._pool.submit(
            self.remote.call,
            "/init_weights_update_group",
            dict(
                master_address=host,
                master_port=port,
                rank_offset=1,
                world_size=1 + tp,
                group_name=self.group_name,
                backend=backend,
            ),
        )
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        formed: concurrent.futures.Future = concurrent.futures.Future()
        store = dist.PrefixStore(self.group_name, self._store)

        def form() -> None:
            try:
                formed.set_result(weights_group(backend, store, 1 + tp, self.group_name, timeout, device))
            except BaseException as e:  # noqa: BLE001 - read by `open`, which names the engine
                formed.set_exception(e)

        threading.Thread(target=form, name=f"{self.group_name}-rendezvous", daemon=True).start()
        self.group = self._formed(formed, joined, f"{backend}, {1 + tp} ranks")
        print(f"{self.name}: weights group {self.group_name} over {backend}, {1 + tp} ranks", flush=True)

    def _formed(self, formed: concurrent.futures.Future, joined: concurrent.futures.Future, what: str) -> Any:
        """The group once it formed and the engine answered success; MegagrpoError naming the engine as
        soon as its answer is a refusal, or when the group did not form (with the engine's answer, if
        any)."""
        path = "/init_weights_update_group"
        pending = {formed, joined}
        while pending:
            _, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            if joined.done() and not self._succeeded(joined):
                raise MegagrpoError(
                    f"{self.name}: the engine refused {path} (group {self.group_name}, {what}): "
                    f"{self._answer(joined)}. The run stops; its rank's log says more"
                )
            if formed.done() and formed.exception() is not None:
                e = formed.exception()
                answer = self._answer(joined) if joined.done() else "no answer yet"
                raise MegagrpoError(
                    f"{self.name}: its weights group {self.group_name} ({what}) did not form within "
                    f"rollout.placement.engine_timeout_s={self.timeout_s:.0f} s ({type(e).__name__}: {e}); "
                    f"the engine's answer to {path}: {answer}. The run stops; its rank's log says why"
                ) from e
        return formed.result()

    def begin(self) -> None:
        self.open()
        if self.session:
            engine_call(self.remote, "/begin_weight_update")

    def send(self, flat: Any, last: bool) -> None:
        """Start bucket `flat`'s broadcast and return: its announcement goes to the pool's thread, its bytes
        to an asynchronous broadcast, so the caller flattens the next bucket while the wire and SGLang's
        load run. The bucket sent before it is waited for first (`_wait_in_flight`): one bucket in flight
        at most, whose failure is raised here or by `end`. Cost: the bucket's bytes from this rank, once
        (the broadcast reaches every TP rank of the engine), and one HTTP round trip."""
        self._wait_in_flight()
        meta = flat.get_metadata()
        announced = self._pool.submit(
            self.remote.call,
            "/update_weights_from_distributed",
            dict(
                names=[m.name for m in meta],
                dtypes=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
                group_name=self.group_name,
                flush_cache=last,  # the radix cache holds prefixes computed with the old weights
                load_format="flattened_bucket",
            ),
        )
        self._sent += 1
        try:
            work = dist.broadcast(flat.get_flattened_tensor(), group=self.group, group_src=0, async_op=True)
        except Exception as e:
            raise self._broadcast_failed(self._sent, e) from e
        ptr = flat.get_flattened_tensor().data_ptr()
        buffer = next((i for i, b in enumerate(self._bufs) if b is not None and b.data_ptr() == ptr), None)
        self._in_flight = _InFlight(work, announced, self._sent, buffer, time.monotonic())

    def _wait_in_flight(self) -> None:
        """Wait for the bucket in flight, if any: its broadcast done and its announcement answered with
        success, each within `timeout_s`. It is forgotten before anything is raised, so that `end` after a
        failed `send` does not wait for it again."""
        f, self._in_flight = self._in_flight, None
        if f is None:
            return
        deadline = f.issued + self.timeout_s
        try:
            # An engine that answers the announcement without joining the broadcast (no update session, an
            # unknown group, a failed receive buffer) never will: its answer is the error, not the deadline.
            while not f.work.is_completed():
                if f.announced.done() and not self._succeeded(f.announced):
                    break
                if time.monotonic() > deadline:
                    raise MegagrpoError(
                        f"{self.name}: bucket {f.bucket} of this sync was not received within "
                        f"rollout.placement.engine_timeout_s={self.timeout_s:.0f} s; the engine is partly "
                        "updated or hung. The run stops; resume from the last checkpoint"
                    )
                time.sleep(POLL_S)
            else:
                f.work.wait()
        except MegagrpoError:
            raise
        except Exception as e:
            raise self._broadcast_failed(f.bucket, e) from e
        if not f.work.is_completed():
            raise MegagrpoError(
                f"{self.name}: /update_weights_from_distributed answered without receiving the bucket "
                f"({f.bucket} of this sync): {self._answer(f.announced)}; its weights group is unusable and "
                "the engine is partly updated. The run stops; resume from the last checkpoint"
            )
        try:
            result = f.announced.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            result = (
                f"no answer within rollout.placement.engine_timeout_s={self.timeout_s:.0f} s after the "
                "broadcast"
            )
        except MegagrpoError as e:  # the call's own error (SGLang answers a failed load with HTTP 400)
            raise MegagrpoError(
                f"{e} (bucket {f.bucket} of this sync); the engine is partly updated. The run stops; resume "
                "from the last checkpoint"
            ) from e
        if not (isinstance(result, dict) and result.get("success", False)):
            raise MegagrpoError(
                f"{self.name}: /update_weights_from_distributed failed: {result} (bucket {f.bucket} of this "
                "sync); the engine is partly updated. The run stops; resume from the last checkpoint"
            )

    def _broadcast_failed(self, bucket: int, e: Exception) -> MegagrpoError:
        return MegagrpoError(
            f"{self.name}: the weight broadcast failed ({type(e).__name__}: {e}) at bucket {bucket} of this "
            "sync; the engine is partly updated or gone. The run stops; resume from the last checkpoint"
        )

    @staticmethod
    def _succeeded(announced: concurrent.futures.Future) -> bool:
        if announced.exception() is not None:
            return False
        result = announced.result()
        return isinstance(result, dict) and bool(result.get("success", False))

    @staticmethod
    def _answer(announced: concurrent.futures.Future) -> str:
        e = announced.exception()
        return f"{type(e).__name__}: {e}" if e is not None else str(announced.result())

    def flatten(self, bucket: list[NamedTensor], cast: torch.dtype | None, *, fresh: bool = False) -> Any:
        """The bucket in SGLang's flattened layout, cast on the copy, in one of TWO buffers used in turn
        from bucket to bucket and, on the CPU, kept from sync to sync (a fresh buffer per bucket costs its
        page faults every time: 0.11 s of 0.52 at 205 MB here). Two, because the bucket sent last may still
        be on the wire while this one is built (`send` returns once its broadcast has started): the owner
        holds one bucket more than a blocking send would, 2 x `sync.bucket_mb` in the engine's dtype. On a
        GPU both are dropped at the end of the sync: torch's caching allocator reuses the blocks without
        faults, and training gets them back. `fresh`: a buffer of the bucket's own, which outlives the next
        one (a checksum keeps every bucket sent)."""
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

        from megagrpo.sync.streaming import _flatten

        # Each tensor in the dtype the engine holds it in (a correction bias stays fp32 in a bf16 engine:
        # rounded, it would route differently from the learner), the widest first: SGLang's receiver lays
        # the tensors out back to back in the announced order and refuses one its offset does not align.
        bucket, dtypes = _in_engine_dtypes(bucket, cast)
        if fresh:
            return _flatten([(n, t.to(d)) for (n, t), d in zip(bucket, dtypes, strict=True)])

        total = sum(t.numel() * d.itemsize for (_, t), d in zip(bucket, dtypes, strict=True))
        device = bucket[0][1].device
        i = self._next_buf
        if self._in_flight is not None and self._in_flight.buffer == i:
            self._wait_in_flight()  # a second flatten before a send: the overlap is lost, not the bytes
        buf = self._bufs[i]
        if buf is None or buf.numel() < total or buf.device != device:
            self._bufs[i] = buf = None  # the old one goes before the new one is made
            self._bufs[i] = buf = torch.empty(total, dtype=torch.uint8, device=device)
        meta, off = [], 0
        for (name, t), dtype in zip(bucket, dtypes, strict=True):
            n = t.numel() * dtype.itemsize
            if off % dtype.itemsize:  # SGLang's receive refuses unaligned tensors (mixed dtypes, no cast)
                raise MegagrpoError(f"{self.name}: tensor {name!r} would be unaligned in its bucket")
            buf[off : off + n].view(dtype).view(t.shape).copy_(t)
            meta.append(FlattenedTensorMetadata(name, t.shape, dtype, off, off + n, n))
            off += n
        self._next_buf = 1 - i
        return FlattenedTensorBucket(flattened_tensor=buf[:off], metadata=meta)

    def dropped(self) -> None:
        pass

    def end(self) -> None:
        """Wait for the last bucket in flight, drop the GPU send buffers and close the engine's update
        session, also after a failed bucket (as `stream_buckets` does after a failed send); the bucket's
        failure is then what is raised."""
        failure: MegagrpoError | None = None
        try:
            self._wait_in_flight()
        except MegagrpoError as e:
            failure = e
        finally:
            self._sent = 0
            if any(b is not None and b.is_cuda for b in self._bufs):
                self._bufs = [None, None]
        if self.session:
            try:
                engine_call(self.remote, "/end_weight_update")
            except MegagrpoError as e:
                if failure is None:
                    raise
                failure.add_note(f"then: {e}")
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Finish a bucket still in flight (raising its failure once the group is gone), then release the
        group and the pool."""
        try:
            self._wait_in_flight()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None


def weights_group(
    backend: str, store: Any, world_size: int, name: str, timeout: datetime.timedelta, device: Any
) -> Any:
    """Rank 0 of a weights group with an engine's TP workers (SGLang's own `init_custom_process_group`,
    the one its workers call): returns once every rank joined, DistStoreError past `timeout`."""
    from sglang.srt.utils.common import init_custom_process_group

    kw = {} if device is None else {"device_id": device}
    return init_custom_process_group(
        backend=backend, store=store, world_size=world_size, rank=0, group_name=name, timeout=timeout, **kw
    )


def engine_call(remote: RemoteEngine, path: str) -> None:
    """A control request without a body (`/begin_weight_update`, `/end_weight_update`); MegagrpoError
    naming the engine unless SGLang answers success."""
    result = remote.call(path, {})
    if not (isinstance(result, dict) and result.get("success", False)):
        raise MegagrpoError(f"{remote.name}: {path} failed: {result}")


def engine_dtype(remote: RemoteEngine) -> torch.dtype:
    return getattr(torch, remote.cfg.dtype)


def _in_engine_dtypes(
    bucket: list[NamedTensor], cast: torch.dtype | None
) -> tuple[list[NamedTensor], list[torch.dtype]]:
    """The bucket ordered widest dtype first, and each tensor's dtype on the wire: `cast` (the engine's)
    where SGLang holds the parameter in it, fp32 for the few it keeps in fp32 (`sglang_layout.FP32_PARAMS`),
    the tensor's own without a cast. A stable sort: a single-dtype bucket keeps its order."""
    from megagrpo.sync.sglang_layout import engine_dtype as held_dtype

    dtypes = [t.dtype if cast is None else held_dtype(n, cast) for n, t in bucket]
    order = sorted(range(len(bucket)), key=lambda i: -dtypes[i].itemsize)
    return [bucket[i] for i in order], [dtypes[i] for i in order]


def sync_remote(
    transport: BroadcastTransport,
    buckets: Iterable[list[NamedTensor]],
    *,
    announced: Mapping[str, tuple[int, ...]] | None = None,
    checksum: bool = False,
) -> SyncStats:
    """Stream the export's buckets to a disaggregated engine (module doc). With `checksum`, compare the
    engine's per-parameter hashes (SGLang's `weights_checker`) with those of what was sent, bit for bit;
    it holds the sent buckets until then (a copy of the model at the owner), so it is for checks every
    few steps, not for every sync of a large model. On any error `buckets` is consumed to its end first
    (the export's gathers are collectives the rest of the replica is in)."""
    it = iter(buckets)
    try:
        t0 = time.perf_counter()
        remote = transport.remote
        if transport.shapes is None:  # the engine's checkpoint: read once, every sync announces the same
            transport.shapes = checkpoint_shapes(remote.cfg.model_path)
        if transport.groups is None:
            transport.groups = load_groups(transport.shapes)
        shapes = transport.shapes
        if announced is not None:
            check_announced(shapes, announced)
        kept: list[Any] | None = [] if checksum else None
        stats = stream_buckets(
            it, _Checker(shapes, transport.groups), transport, None, t0, cast=engine_dtype(remote), keep=kept
        )
    except Exception:
        for _ in it:
            pass
        raise
    if kept is None:
        return stats
    ok = verify_remote(remote, [flat.reconstruct_tensors() for flat in kept])
    return SyncStats(stats.bytes, stats.seconds, stats.buckets, stats.tensors, ok)


def remote_checksums(remote: RemoteEngine) -> dict[str, str]:
    """SGLang's per-parameter hashes of what the engine holds now, TP rank 0."""
    result = remote.call("/weights_checker", {"action": "checksum"})
    if not isinstance(result, dict) or not result.get("success") or not result.get("ranks"):
        raise MegagrpoError(f"{remote.name}: weights_checker(checksum) failed: {result}")
    return dict(result["ranks"][0]["checksums"])


def verify_remote(remote: RemoteEngine, sent: list[list[NamedTensor]]) -> bool:
    """True when every SGLang parameter built from the sent tensors hashes like the engine's copy
    (TP 1: a TP engine's parameters are shards). The sent tensors are laid out as the engine holds them:
    a CPU engine zero-pads every MLP intermediate size to SGLang's multiple (`sglang_layout` module doc,
    "Padding"; its shapes cannot be asked over HTTP, so its rule is applied); a GPU engine at TP 1 is
    taken to hold the checkpoint's shapes. Cost: the engine's hashes and `/server_info` over HTTP."""
    from megagrpo.sync.sglang_layout import padded_mlp_shapes, sglang_params, sglang_plan

    if int(remote.cfg.tp_size) != 1:
        raise MegagrpoError("sync.checksum supports engines with engine_tp=1 only; set sync.checksum=false")
    hf = {n: t for b in sent for n, t in b}
    engine_shapes = None
    if remote.get("/server_info").get("device") == "cpu":
        from sglang.srt.configs.update_config import DEFAULT_MOE_PADDING_SIZE

        padded = padded_mlp_shapes({n: tuple(t.shape) for n, t in hf.items()}, DEFAULT_MOE_PADDING_SIZE)
        engine_shapes = {fp.name: fp.shape for fp in sglang_plan(padded).values()}
    expected = sglang_params(hf, engine_shapes)
    held = remote_checksums(remote)
    common = [n for n in expected if n in held]
    if not common:
        raise MegagrpoError(f"{remote.name}: checksum: no sent tensor maps onto an engine parameter")
    return all(_hash(expected[n]) == held[n] for n in common)
