"""Issue 16, items 5-6: who holds the device memory when. The session's start order, its phase changes
around a step, a weight sync and a checkpoint, with a recording learner and engine in place of the real
ones (the real CPU engine's order is tested in tests/integration/test_sync_weights.py, the real offload on
CUDA in tests/gpu/test_gpu_offload.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megagrpo.config.schema import FaultToleranceConfig
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.groups import EngineGroups
from megagrpo.trainer import samplers as samplers_module
from megagrpo.trainer import session as session_module
from megagrpo.trainer.session import Session


class FakeLearner:
    def __init__(self, log: list[str]) -> None:
        self.log, self.offloaded = log, False

    def init_optimizer_state(self) -> None:
        self.log.append("learner.init_optimizer_state")

    def offload(self) -> None:
        self.log.append("learner.offload")
        self.offloaded = True

    def reload(self) -> None:
        self.log.append("learner.reload")
        self.offloaded = False


class FakeEngine:
    """Records release/resume like RolloutEngine: a tag is resumed only when it was released."""

    def __init__(self, log: list[str], cfg=None) -> None:
        self.log, self.released = log, set()

    def start(self) -> FakeEngine:
        self.log.append("engine.start")
        return self

    def start_watch(self, **knobs) -> None:
        self.log.append("engine.watch")

    def release(self, tags=None) -> None:
        for t in tags or ("kv_cache", "weights"):
            if t not in self.released:
                self.released.add(t)
                self.log.append(f"engine.release.{t}")

    def resume(self, tags=None) -> None:
        for t in tags or ("weights", "kv_cache"):
            if t in self.released:
                self.released.discard(t)
                self.log.append(f"engine.resume.{t}")


@pytest.fixture
def log() -> list[str]:
    return []


@pytest.fixture
def session(log, monkeypatch) -> Session:
    import megagrpo.rollout.engines.engine as engine_module

    monkeypatch.setattr(engine_module, "RolloutEngine", lambda cfg, name="engine": FakeEngine(log, cfg))
    monkeypatch.setattr(samplers_module, "rollout_config", lambda cfg, path: RolloutConfig(model_path=path))
    s = object.__new__(Session)
    s.cfg = SimpleNamespace(
        sync=SimpleNamespace(bucket_mb=1, checksum=False, pack=True),
        checkpoint=SimpleNamespace(keep_last=2),
        model=SimpleNamespace(hf_path="hf"),
        rollout=SimpleNamespace(
            mode="colocated",
            placement=SimpleNamespace(engine_cores=None, disaggregated=False),
            fault_tolerance=FaultToleranceConfig(),
        ),
    )
    s.async_rollout, s.placement, s.sync_wait_seconds = None, None, 0.0
    s.learner, s.engine, s.rank0, s.model_path = FakeLearner(log), None, True, "hf"
    s.step = 0
    s.engines = EngineGroups(world=1, rank=0, num_engines=1)
    s.ckpt_root = "ckpt"
    s.extra_state = lambda: {}
    return s


def test_the_learner_reaches_its_steady_state_and_leaves_before_the_engine_starts(session, log):
    session.start_engine()
    assert log == ["learner.init_optimizer_state", "learner.offload", "engine.start", "engine.watch"]


def test_without_an_engine_the_learner_stays(session, log):
    session.needs_engine = False
    session.start_engine()
    assert log == ["learner.init_optimizer_state"]
    assert session.engine is None


def test_a_step_and_its_weight_sync(session, log, monkeypatch):
    """Rollout with the learner offloaded; release, reload, train; export, CHECK, resume weights, write,
    offload, resume the KV cache."""
    import megagrpo.bridge.maps as maps_module
    import megagrpo.sync.weights as sync_module

    def fake_export(learner, nbytes, *, receive):
        assert receive  # this rank owns the engine
        log.append("export")
        yield [("w", torch.zeros(1))]

    def fake_sync(engine, buckets, *, checksum, pack, before_send, announced):
        assert announced == {"w": (1,)}  # the export's names and shapes, announced before any bucket
        list(buckets)
        log.append("sync.check")
        before_send()
        log.append("sync.write")
        return SimpleNamespace(metrics=lambda: {"sync/bytes": 4.0})

    monkeypatch.setattr(samplers_module, "export_buckets", fake_export)
    monkeypatch.setattr(samplers_module, "check_learner_weights", lambda learner: log.append("check"))
    monkeypatch.setattr(sync_module, "sync_weights", fake_sync)
    monkeypatch.setattr(maps_module, "hf_shapes", lambda arch: {"w": (1,)})
    session.arch = None
    session.start_engine()
    log.clear()
    session.engine.release(["kv_cache", "weights"])  # GRPOTrainer.train_step, rank 0, after the rollout
    session.learner_phase()
    log.append("train")
    assert session.sync_weights() == {"sync/bytes": 4.0}
    assert log == [
        "engine.release.kv_cache",
        "engine.release.weights",
        "learner.reload",
        "train",
        "check",
        "export",
        "sync.check",
        "engine.resume.weights",
        "sync.write",
        "learner.offload",
        "engine.resume.kv_cache",
    ]
    assert not session.engine.released and session.learner.offloaded


def test_async_swaps_no_memory_and_syncs_at_a_request_boundary(session, log, monkeypatch):
    """rollout.mode=async: the engine has its own cores, so the learner never leaves and the engine is
    never released; the sync first waits for the sampler's queued round (drain), then writes."""
    import megagrpo.bridge.maps as maps_module
    import megagrpo.sync.weights as sync_module

    def fake_sync(engine, buckets, *, checksum, pack, before_send, announced):
        assert before_send is None  # nothing to resume: nothing was released
        list(buckets)
        log.append("sync.write")
        return SimpleNamespace(metrics=lambda: {"sync/bytes": 4.0})

    monkeypatch.setattr(
        samplers_module, "export_buckets", lambda learner, nbytes, *, receive: iter([[("w", torch.zeros(1))]])
    )
    monkeypatch.setattr(samplers_module, "check_learner_weights", lambda learner: log.append("check"))
    monkeypatch.setattr(sync_module, "sync_weights", fake_sync)
    monkeypatch.setattr(maps_module, "hf_shapes", lambda arch: {"w": (1,)})
    monkeypatch.setattr(session_module.Session, "core_placement", lambda self: None)
    session.arch, session.needs_engine, session.stage = None, True, "train"
    session.cfg.rollout.mode = "async"
    session.async_rollout = SimpleNamespace(queue=SimpleNamespace(drain=lambda: log.append("drain") or 0.5))
    session.start_engine()
    session.learner_phase()
    session.sync_weights()
    session.sampler_phase()
    assert log == [
        "learner.init_optimizer_state",
        "engine.start",
        "engine.watch",
        "check",
        "drain",
        "sync.write",
    ]
    assert session.sync_wait_seconds == 0.5


def test_a_checkpoint_between_steps_keeps_the_engine_weights(session, log, monkeypatch):
    """No sync follows a save, so the engine must not drop its weights: only the KV cache makes room."""
    from megagrpo.trainer import checkpointing

    monkeypatch.setattr(checkpointing, "save", lambda *a, **k: log.append("save") or "ckpt/step_1")
    session.start_engine()
    log.clear()
    assert session.save() == "ckpt/step_1"
    assert log == [
        "engine.release.kv_cache",
        "learner.reload",
        "save",
        "learner.offload",
        "engine.resume.kv_cache",
    ]


def test_sync_metrics_are_one_engines_the_slowest_time_and_every_checksum():
    from megagrpo.trainer.samplers import merge_engine_metrics

    a = {"sync/bytes": 100.0, "sync/seconds": 1.0, "sync/gbps": 1e-7, "sync/checksum_ok": 1.0}
    b = {"sync/bytes": 100.0, "sync/seconds": 2.0, "sync/gbps": 5e-8, "sync/checksum_ok": 0.0}
    m = merge_engine_metrics([a, None, b])
    assert m == {
        "sync/bytes": 100.0,
        "sync/seconds": 2.0,
        "sync/gbps": 100.0 / 2.0 / 1e9,
        "sync/checksum_ok": 0.0,
    }
    assert merge_engine_metrics([None, None]) == {}


def test_a_nan_in_the_learner_is_refused_before_any_export():
    from megagrpo.errors import MegagrpoError
    from megagrpo.trainer.weights import check_learner_weights

    lin = torch.nn.Linear(3, 2)
    learner = SimpleNamespace(chunks=[lin], mesh=SimpleNamespace(device=torch.device("cpu")))
    check_learner_weights(learner)  # finite: nothing happens
    with torch.no_grad():
        lin.bias[1] = float("inf")
    with pytest.raises(MegagrpoError, match=r"parameter 'bias' \(rank 0\) holds NaN or inf"):
        check_learner_weights(learner)


def test_the_weight_checksum_runs_on_the_first_sync_then_every_nth_step():
    fake = SimpleNamespace(cfg=SimpleNamespace(sync=SimpleNamespace(checksum=True, checksum_every=3)), step=5)
    due = []
    for step in (5, 6, 7, 8, 9):  # a resume at step 5: its first sync is checked whatever the step
        fake.step = step
        due.append(Session.checksum_due(fake))
    assert due == [True, True, False, False, True]
    fake.cfg.sync.checksum = False
    assert not Session.checksum_due(fake)


def test_a_failed_sync_names_the_colocated_engine(session, log, monkeypatch):
    """The sync's error (e.g. the engine's shape probe, issue 36 item 9) says which engine it was."""
    import megagrpo.bridge.maps as maps_module
    import megagrpo.sync.weights as sync_module
    from megagrpo.errors import MegagrpoError

    def fake_sync(engine, buckets, **kw):
        list(buckets)
        raise MegagrpoError("weight sync: the engine's parameter 'w13': the learner's export packs (2,)")

    monkeypatch.setattr(
        samplers_module, "export_buckets", lambda learner, nbytes, *, receive: iter([[("w", torch.zeros(1))]])
    )
    monkeypatch.setattr(samplers_module, "check_learner_weights", lambda learner: None)
    monkeypatch.setattr(sync_module, "sync_weights", fake_sync)
    monkeypatch.setattr(maps_module, "hf_shapes", lambda arch: {"w": (1,)})
    session.arch = None
    session.start_engine()
    with pytest.raises(MegagrpoError) as e:
        session.sync_weights()
    assert str(e.value) == (
        "engine 0 of 1 (colocated, rank 0): weight sync: the engine's parameter 'w13': the learner's export "
        "packs (2,)"
    )
