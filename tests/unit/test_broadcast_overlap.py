"""`BroadcastTransport.send` returns once a bucket's broadcast has started (issue 27), against a fake engine
and a fake broadcast whose wire reads the send buffer as late as it can: when the owner next waits for it.

- what arrives is bit for bit what was sent, over 5 buckets in the two reused send buffers: the bucket in
  flight is never overwritten by the next one's copy, and a third buffer is never made;
- one bucket is in flight at most, and `send` returned before its broadcast was done (the overlap);
- a failure of the bucket in flight is raised by the next send (or by `end` for the last bucket), names
  the engine, the bucket and that the engine is partly updated, and the session is still closed;
- an engine that answers without joining fails at once, a broadcast that never ends fails at the deadline;
- `close` with a bucket in flight finishes it, or raises its failure, and still destroys the group.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import megagrpo.sync.broadcast as broadcast
from megagrpo.errors import MegagrpoError
from megagrpo.sync.buckets import NamedTensor

ENGINE = "engine 0 (http://h:1, rank 2 on n2)"
N_BUCKETS = 5


class Wire:
    """The fake group: each broadcast is a `Work` that completes on the owner's second look at it, and
    copies the buffer's bytes only then, as a slow wire would still be reading them."""

    def __init__(self, fail_at: int | None = None, never: bool = False) -> None:
        self.received: list[torch.Tensor] = []
        self.works: list[Work] = []
        self.fail_at, self.never = fail_at, never

    def broadcast(self, tensor, *, group, group_src, async_op):
        assert async_op and group_src == 0
        assert all(w.done for w in self.works), "a second bucket started while one was in flight"
        work = Work(self, tensor, len(self.works) + 1)
        self.works.append(work)
        return work


class Work:
    def __init__(self, wire: Wire, tensor: torch.Tensor, bucket: int) -> None:
        self.wire, self.tensor, self.bucket = wire, tensor, bucket
        self.looks, self.done = 0, False

    def is_completed(self) -> bool:
        if self.wire.never:
            return False
        self.looks += 1
        if self.looks >= 2 and not self.done:
            self.done = True
            self.wire.received.append(self.tensor.clone())
        return self.done

    def wait(self) -> bool:
        if self.wire.fail_at == self.bucket:
            raise RuntimeError("Connection closed by peer")
        return True


class Engine:
    """The engine's HTTP surface: answers every call, or fails the announcement of bucket `fail_at`."""

    def __init__(self, fail_at: int | None = None, answer: bool = True) -> None:
        self.calls: list[str] = []
        self.fail_at, self.answer, self.announced = fail_at, answer, 0

    def call(self, path: str, body: dict) -> dict:
        self.calls.append(path)
        if path == "/update_weights_from_distributed":
            self.announced += 1
            if not self.answer:
                time.sleep(2)  # an engine that does not answer in time: the owner's deadline ends the wait
            if self.announced == self.fail_at:
                return {"success": False, "message": "load_weights failed: boom"}
        return {"success": True, "message": ""}


def _transport(engine: Engine, wire: Wire, monkeypatch, timeout_s: float = 60.0):
    monkeypatch.setattr(broadcast.dist, "broadcast", wire.broadcast)
    destroyed: list = []
    monkeypatch.setattr(broadcast.dist, "destroy_process_group", destroyed.append)
    remote = SimpleNamespace(name=ENGINE, index=0, call=engine.call, cfg=SimpleNamespace(dtype="float32"))
    t = broadcast.BroadcastTransport(remote, timeout_s=timeout_s)
    t.group = object()  # `open` has nothing to do
    t.destroyed = destroyed
    return t


def _buckets(seed: int = 0) -> list[list[NamedTensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [(f"b{i}.w", torch.randn(3, 5, generator=g)), (f"b{i}.v", torch.randn(7, generator=g))]
        for i in range(N_BUCKETS)
    ]


def _sync(t, buckets: list[list[NamedTensor]], **kw):
    t.shapes = {n: tuple(x.shape) for b in buckets for n, x in b}
    return broadcast.sync_remote(t, [[(n, x.clone()) for n, x in b] for b in buckets], **kw)


def _arrived(wire: Wire, buckets: list[list[NamedTensor]]) -> list[list[NamedTensor]]:
    """The received bytes read back with the sent buckets' layout (float32, back to back)."""
    out = []
    for raw, bucket in zip(wire.received, buckets, strict=True):
        values, off = [], 0
        for name, x in bucket:
            n = x.numel() * 4
            values.append((name, raw[off : off + n].view(torch.float32).view(x.shape)))
            off += n
        out.append(values)
    return out


def test_the_bucket_in_flight_is_never_overwritten(monkeypatch):
    engine, wire = Engine(), Wire()
    t = _transport(engine, wire, monkeypatch)
    in_flight_at_flatten: list[bool] = []
    flatten = t.flatten

    def spy(*a, **k):
        in_flight_at_flatten.append(bool(wire.works) and not wire.works[-1].done)
        return flatten(*a, **k)

    t.flatten = spy
    buckets = _buckets()
    stats = _sync(t, buckets)
    assert stats.buckets == N_BUCKETS and len(wire.received) == N_BUCKETS
    for got, sent in zip(_arrived(wire, buckets), buckets, strict=True):
        for (n1, a), (n2, b) in zip(got, sent, strict=True):
            assert n1 == n2 and torch.equal(a, b), n1
    # the two send buffers, in turn: the copy of bucket N + 1 never went into bucket N's
    ptrs = [w.tensor.data_ptr() for w in wire.works]
    assert len(set(ptrs)) == 2 and all(a != b for a, b in zip(ptrs, ptrs[1:], strict=False))
    # every send but the last returned before its broadcast was done: the next bucket was copied meanwhile
    assert in_flight_at_flatten == [False] + [True] * (N_BUCKETS - 1)
    assert engine.calls[0] == "/begin_weight_update" and engine.calls[-1] == "/end_weight_update"
    # a second sync reuses the CPU buffers (no new allocation) and still arrives bit for bit
    wire.received.clear()
    wire.works.clear()
    _sync(t, _buckets(seed=1))
    assert {w.tensor.data_ptr() for w in wire.works} == set(ptrs)
    for got, sent in zip(_arrived(wire, _buckets(seed=1)), _buckets(seed=1), strict=True):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, sent, strict=True))
    t.close()


def test_a_checksum_sync_keeps_every_bucket_in_a_buffer_of_its_own(monkeypatch):
    t = _transport(Engine(), Wire(), monkeypatch)
    buckets = _buckets()
    kept: list = []
    monkeypatch.setattr(broadcast, "verify_remote", lambda remote, sent: kept.extend(sent) or True)
    assert _sync(t, buckets, checksum=True).checksum_ok is True
    for got, sent in zip(kept, buckets, strict=True):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, sent, strict=True))
    t.close()


@pytest.mark.parametrize("fail_at", [2, N_BUCKETS])
def test_a_failed_bucket_in_flight_is_reported_not_swallowed(monkeypatch, fail_at):
    engine, wire = Engine(fail_at=fail_at), Wire()
    t = _transport(engine, wire, monkeypatch)
    with pytest.raises(MegagrpoError) as err:
        _sync(t, _buckets())
    message = str(err.value)
    assert ENGINE in message and "partly updated" in message, message
    assert f"bucket {fail_at} of this sync" in message and "load_weights failed: boom" in message, message
    # raised by the next send: nothing after the failed bucket was broadcast; the session is still closed
    assert len(wire.works) == fail_at and engine.calls[-1] == "/end_weight_update"
    assert t._in_flight is None
    t.close()
    assert t.destroyed


def test_a_failed_broadcast_in_flight_names_the_engine(monkeypatch):
    engine, wire = Engine(), Wire(fail_at=3)
    t = _transport(engine, wire, monkeypatch)
    with pytest.raises(MegagrpoError, match="weight broadcast failed.*Connection closed.*bucket 3 of this"):
        _sync(t, _buckets())
    assert len(wire.works) == 3
    t.close()


def test_an_engine_that_answers_without_joining_fails_at_once(monkeypatch):
    engine, wire = Engine(fail_at=1), Wire(never=True)
    t = _transport(engine, wire, monkeypatch, timeout_s=1800)
    t0 = time.monotonic()
    with pytest.raises(MegagrpoError, match="answered without receiving the bucket.*load_weights failed"):
        _sync(t, _buckets())
    assert time.monotonic() - t0 < 10  # not the 1800 s deadline
    t.close()


def test_a_broadcast_that_never_ends_fails_at_the_deadline(monkeypatch):
    engine, wire = Engine(answer=False), Wire(never=True)
    t = _transport(engine, wire, monkeypatch, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(MegagrpoError, match="bucket 1 of this sync was not received within"):
        _sync(t, _buckets())
    assert time.monotonic() - t0 < 10
    t._pool.shutdown(wait=False, cancel_futures=True)


def test_close_finishes_the_bucket_in_flight_or_raises_its_failure(monkeypatch):
    bucket = [("w", torch.arange(4.0))]
    for fail in (False, True):
        engine, wire = Engine(fail_at=1 if fail else None), Wire()
        t = _transport(engine, wire, monkeypatch)
        t.send(t.flatten(bucket, None), last=True)
        assert not wire.works[0].done
        if fail:
            with pytest.raises(MegagrpoError, match="partly updated"):
                t.close()
        else:
            t.close()
            assert torch.equal(wire.received[0].view(torch.float32), bucket[0][1])
        assert t.destroyed and t.group is None
