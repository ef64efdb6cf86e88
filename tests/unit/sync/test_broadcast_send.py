"""`BroadcastTransport.send` against a fake engine and a fake broadcast: an engine that answers the bucket's
announcement without joining the broadcast fails the send at once with the engine's answer, instead of
leaving the owner in the broadcast until the engine deadline."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import megagrpo.sync.broadcast as broadcast
from megagrpo.errors import MegagrpoError


class FakeWork:
    def __init__(self, done_after_s: float | None) -> None:
        self.until = None if done_after_s is None else time.monotonic() + done_after_s

    def is_completed(self) -> bool:
        return self.until is not None and time.monotonic() >= self.until

    def wait(self) -> bool:
        return True


def transport(answer: dict) -> broadcast.BroadcastTransport:
    remote = SimpleNamespace(
        name="engine 0 (http://h:1, rank 2 on n2)", index=0, call=lambda path, body: answer
    )
    t = broadcast.BroadcastTransport(remote, timeout_s=1800)
    t.group = object()
    return t


def flat_bucket():
    meta = [SimpleNamespace(name="w", dtype=torch.float32, shape=torch.Size([2]))]
    return SimpleNamespace(
        get_metadata=lambda: meta, get_flattened_tensor=lambda: torch.zeros(8, dtype=torch.uint8)
    )


def test_an_engine_that_answers_without_receiving_fails_the_send_at_once(monkeypatch):
    monkeypatch.setattr(broadcast.dist, "broadcast", lambda *a, **k: FakeWork(None))  # never completes
    t = transport(
        {"success": False, "message": "must run between begin_weight_update() and end_weight_update()"}
    )
    t0 = time.monotonic()
    t.send(flat_bucket(), last=False)  # returns once the broadcast started; the wait finds the answer
    with pytest.raises(MegagrpoError, match="answered without receiving the bucket.*must run between"):
        t._wait_in_flight()
    assert time.monotonic() - t0 < 5  # not the 1800 s deadline
    t._pool.shutdown()


def test_a_send_waits_for_the_broadcast_and_checks_the_answer(monkeypatch):
    monkeypatch.setattr(broadcast.dist, "broadcast", lambda *a, **k: FakeWork(0.05))
    t = transport({"success": True, "message": "ok"})
    t.send(flat_bucket(), last=True)
    t._wait_in_flight()
    assert t._in_flight is None
    t._pool.shutdown()


def test_the_send_buffer_is_reused_and_cast_on_the_copy():
    t = transport({"success": True})
    a = [("x", torch.arange(6, dtype=torch.float64).reshape(2, 3)), ("y", torch.ones(4, dtype=torch.float64))]
    flat = t.flatten(a, torch.float32)
    (nx, x), (ny, y) = flat.reconstruct_tensors()
    assert (nx, ny) == ("x", "y") and x.dtype == y.dtype == torch.float32
    assert torch.equal(x, a[0][1].float()) and torch.equal(y, a[1][1].float())
    first = t._bufs[0]
    t.flatten([("z", torch.zeros(3))], None)  # the second buffer (the first may be on the wire)
    t.flatten([("z", torch.zeros(3))], None)
    assert t._bufs[0] is first  # smaller: the same buffer, in turn
    t._pool.shutdown()


@pytest.mark.parametrize("fresh", [False, True])
def test_a_correction_bias_crosses_a_bf16_engines_broadcast_in_fp32_and_aligned(fresh):
    """The bias decides routing, so a bf16 engine holds it in fp32 (`sglang_layout.FP32_PARAMS`): it must
    arrive unrounded, and SGLang's receiver (which lays the announced tensors out back to back and refuses
    a misaligned one) must rebuild the same tensors from the announced names, dtypes and shapes."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    g = torch.Generator().manual_seed(0)
    bucket = [
        ("model.layers.1.input_layernorm.weight", torch.randn(3, generator=g)),  # 6 bytes in bf16
        (bias, torch.randn(5, generator=g) * 1e-3 + 1),  # not representable in bf16
        ("model.layers.1.mlp.gate.weight", torch.randn(5, 3, generator=g)),
    ]
    t = transport({"success": True})
    flat = t.flatten(bucket, torch.bfloat16, fresh=fresh)
    meta = flat.get_metadata()
    received = FlattenedTensorBucket.empty(
        [m.name for m in meta], [m.dtype for m in meta], [m.shape for m in meta], "cpu"
    )  # raises on a misaligned layout, as the engine would
    received.get_flattened_tensor().copy_(flat.get_flattened_tensor())
    got = dict(received.reconstruct_tensors())
    assert got[bias].dtype == torch.float32 and torch.equal(got[bias], bucket[1][1])
    for name, tensor in (bucket[0], bucket[2]):
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor.to(torch.bfloat16))
    t._pool.shutdown()
