"""Disaggregated weights from every pipeline stage (`sync.stages`): who feeds which engine, and how the
stages' statistics make one engine's."""

from __future__ import annotations

import pytest

from megagrpo.config.mesh_rules import StageRoute, engines_fed, stage_routes
from megagrpo.errors import MegagrpoError
from megagrpo.sync.stages import FanOut, merge_stage_stats
from megagrpo.sync.stats import SyncStats


def test_the_engines_are_spread_over_the_replicas_each_rank_with_its_own_stage():
    # 4 learners, PP 2 x DP 2 (megatron's order: pipeline groups [0, 2] and [1, 3])
    groups = [[1, 3], [0, 2]]  # in any order
    assert stage_routes(2, groups, 0) == [StageRoute(0, 0)]
    assert stage_routes(2, groups, 2) == [StageRoute(0, 1)]
    assert stage_routes(2, groups, 1) == [StageRoute(1, 0)]  # engine 1 from the other replica
    assert stage_routes(2, groups, 3) == [StageRoute(1, 1)]
    # more engines than replicas: a rank feeds several
    assert stage_routes(3, groups, 0) == [StageRoute(0, 0), StageRoute(1, 0)]
    assert stage_routes(3, groups, 3) == [StageRoute(2, 1)]
    # one engine: one replica sends, the other does nothing
    assert stage_routes(1, groups, 1) == []
    # the plan's count of the same rule
    assert engines_fed(4, 2, 2) == 1 and engines_fed(4, 2, 3) == 2
    assert engines_fed(16, 2, 4) == 1 and engines_fed(16, 1, 4) == 1
    for learners, pp, engines in ((8, 2, 3), (8, 4, 5), (16, 2, 8), (12, 3, 7)):
        per_stage = learners // pp
        groups = [[g + s * per_stage for s in range(pp)] for g in range(per_stage)]
        most = max(len(stage_routes(engines, groups, r)) for r in range(learners))
        assert engines_fed(learners, pp, engines) == most, (learners, pp, engines)


def test_one_engines_metrics_sum_the_stages_bytes_and_take_the_slowest_stage():
    stage0 = {0: SyncStats(100, 1.0, 2, 10, True), 1: SyncStats(100, 3.0, 2, 10, True)}
    stage1 = {0: SyncStats(60, 2.0, 1, 6, True), 1: SyncStats(60, 0.5, 1, 6, False)}
    m = merge_stage_stats([stage0, None, stage1], 2)
    assert m[0] == SyncStats(160, 2.0, 3, 16, True).metrics()
    assert m[1]["sync/bytes"] == 160 and m[1]["sync/seconds"] == 3.0 and m[1]["sync/checksum_ok"] == 0.0
    assert merge_stage_stats([None], 1) == [None]
    assert "sync/checksum_ok" not in merge_stage_stats([{0: SyncStats(1, 1.0, 1, 1, None)}], 1)[0]


class _Transport:
    def __init__(self, name: str, fail_end: bool = False) -> None:
        self.name, self.fail_end, self.log = name, fail_end, []

    def begin(self):
        self.log.append("begin")

    def flatten(self, bucket, cast, *, fresh=False):
        return (self.name, [n for n, _ in bucket])

    def send(self, flat, last):
        self.log.append(("send", flat, last))

    def dropped(self):
        self.log.append("dropped")

    def end(self):
        self.log.append("end")
        if self.fail_end:
            raise MegagrpoError(f"{self.name}: end failed")


def test_fan_out_sends_each_engine_its_own_flattened_copy_and_ends_every_one():
    a, b = _Transport("a", fail_end=True), _Transport("b")
    fan = FanOut([a, b])
    fan.begin()
    fan.send(fan.flatten([("w", None)], None), last=True)
    with pytest.raises(MegagrpoError, match="a: end failed"):
        fan.end()
    assert a.log == ["begin", ("send", ("a", ["w"]), True), "end"]
    assert b.log == ["begin", ("send", ("b", ["w"]), True), "end"]  # ended although a's end failed
    assert fan.name == "a; b"


class _Remote:
    def __init__(self) -> None:
        self.name, self.calls = "engine 0 (fake)", []
        self.cfg = type("Cfg", (), {"dtype": "float32", "model_path": "unused"})()

    def call(self, path, body):
        self.calls.append(path)
        return {"success": True}


class _StageTransport(_Transport):
    def __init__(self, shapes) -> None:
        super().__init__("engine 0, pipeline stage 1")
        self.remote, self.shapes, self.groups = _Remote(), shapes, None

    def open(self):
        self.log.append("open")


def _sync(transport, buckets, owner=True):
    from megagrpo.sync.stages import sync_stages

    announced = transport.shapes
    owned = (0, transport.remote) if owner else None
    return sync_stages(
        [(StageRoute(0, 1), transport)], buckets, num_engines=1, owned=owned, announced=announced
    )


def test_a_bad_bucket_before_the_first_send_sends_nothing_and_closes_the_session():
    import torch

    t = _StageTransport({"a": (2,), "b": (2,)})
    with pytest.raises(MegagrpoError, match="'b' holds NaN"):
        _sync(t, [[("a", torch.ones(2))], [("b", torch.tensor([0.0, float("nan")]))]])
    assert not any(isinstance(x, tuple) for x in t.log)  # no send
    assert t.remote.calls == ["/begin_weight_update", "/end_weight_update"]


def test_stages_that_miss_a_tensor_report_the_engine_partly_updated():
    import torch

    t = _StageTransport({"a": (2,), "b": (2,)})
    with pytest.raises(MegagrpoError, match="sent 1 of the model's 2 tensors; the engine is partly updated"):
        _sync(t, [[("a", torch.ones(2))]])
    assert t.remote.calls == ["/begin_weight_update", "/end_weight_update"]
    stats = _sync(t, [[("a", torch.ones(2))], [("b", torch.ones(2))]])
    assert stats[0].tensors == 2 and stats[0].bytes == 16 and stats[0].checksum_ok is None
    # a sender that does not own the engine neither opens nor closes its session, nor counts
    other = _StageTransport({"a": (2,), "b": (2,)})
    _sync(other, [[("a", torch.ones(2))]], owner=False)
    assert other.remote.calls == []
