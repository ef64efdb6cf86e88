"""Issue 25, item 17: the GPU weight stream holds two export buckets at most, as docs/scaling.md and the
memory plan count (it held three: the pending bucket, its flattened copy and the next); and a failing
sync still consumes the export, whose gathers are collectives (item 18). Run on the CPU with the streamed
transport forced, counting the live buckets with weak references."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import save_file

from megagrpo.errors import MegagrpoError
from megagrpo.sync.weights import sync_weights

N, SIZE = 6, 256


class _Live:
    """Weak references to every bucket tensor the export yielded and every flattened copy made."""

    def __init__(self) -> None:
        self.yielded: list[weakref.ref] = []
        self.flat: list[weakref.ref] = []

    def count(self) -> tuple[int, int]:
        alive = lambda refs: sum(r() is not None for r in refs)  # noqa: E731
        return alive(self.yielded), alive(self.flat)


class _Engine:
    """SGLang's engine surface that a streamed sync uses; records what is alive at every send."""

    def __init__(self, model_dir: str, live: _Live) -> None:
        self.server_args = type("Args", (), {"model_path": model_dir, "tp_size": 1})()
        self.live, self.at_send, self.calls = live, [], []

    def begin_weight_update(self):
        self.calls.append("begin")
        return True, ""

    def update_weights_from_tensor(self, payload, load_format, flush_cache):
        self.at_send.append(self.live.count())
        self.calls.append(f"update:{load_format}:{int(flush_cache)}")
        return True, ""

    def end_weight_update(self):
        self.calls.append("end")
        return True, ""


@pytest.fixture
def setup(tmp_path, monkeypatch):
    save_file({f"w{i}": torch.zeros(SIZE) for i in range(N)}, str(tmp_path / "model.safetensors"))
    live = _Live()
    from sglang.srt.weight_sync import tensor_bucket

    class Tracked(tensor_bucket.FlattenedTensorBucket):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            live.flat.append(weakref.ref(self.flattened_tensor))

    monkeypatch.setattr(tensor_bucket, "FlattenedTensorBucket", Tracked)
    return _Engine(str(tmp_path), live), live


def _export(live: _Live, at_fill: list, bad: int | None = None):
    """One tensor per bucket, built only when asked for, like the bridge's export: nothing of a yielded
    bucket is kept here once the next is asked for. Records what is alive before each bucket is built."""
    for i in range(N):
        at_fill.append(live.count())
        t = torch.full((SIZE,), float(i))
        if i == bad:
            t[3] = float("nan")
        live.yielded.append(weakref.ref(t))
        yield [(f"w{i}", t)]
        del t


def test_the_gpu_stream_holds_two_buckets_at_most(setup):
    eng, live = setup
    at_fill: list = []
    stats = sync_weights(eng, _export(live, at_fill), streamed=True)
    assert stats.buckets == N and stats.tensors == N
    assert eng.calls == [
        "begin",
        *["update:flattened_bucket:0"] * (N - 1),
        "update:flattened_bucket:1",
        "end",
    ]
    # while a bucket is sent: its flattened copy and the next bucket (checked), nothing else
    assert eng.at_send[:-1] == [(1, 1)] * (N - 1), eng.at_send
    assert eng.at_send[-1] == (0, 1)  # the last: its own tensors already dropped
    # while the export builds the next bucket: only the previous one's flattened copy
    assert at_fill == [(0, 0)] + [(0, 1)] * (N - 1), at_fill


def test_a_failing_sync_consumes_the_whole_export(setup):
    """The bad bucket raises after two sends (its own is checked before the one before it goes); the export still runs to its end (on a learner its gathers
    are collectives that the replica's other ranks are in), and the error says the engine is partly
    updated."""
    eng, live = setup
    at_fill: list = []
    with pytest.raises(MegagrpoError, match=r"'w3' holds NaN or inf.*2 bucket\(s\) were already sent"):
        sync_weights(eng, _export(live, at_fill, bad=3), streamed=True)
    assert len(at_fill) == N
    assert eng.calls == ["begin", *["update:flattened_bucket:0"] * 2, "end"]
