"""Issue 45, detection: the owner's watch (`rollout.engines.watch`) fails a killed, stopped or hung engine
with an error naming it and the cause, and the loop exits with `ENGINE_LOST_EXIT_CODE` instead of waiting.

The verdicts are checked on made-up looks (`FailureDetector`); the whole path (watch thread ->
`RolloutEngine.fail` -> the waiting request raises `EngineFailed`) on a `RolloutEngine` around a stand-in
for `sglang.Engine` whose request never gets an answer, with a real child process as its scheduler, signalled
through the test seam (`rollout.engines.faults`). The real engine in a real run: the option matrix's fault
case (tests/integration/test_option_matrix.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import RolloutConfig, SamplingConfig
from megagrpo.rollout.engines import faults
from megagrpo.rollout.engines.engine import EngineFailed, RolloutEngine
from megagrpo.rollout.engines.watch import GONE, FailureDetector, Look
from megagrpo.trainer.session import engine_failure
from megagrpo.trainer.signals import ENGINE_LOST_EXIT_CODE
from tests.unit.trainer.test_signals_preemption import loop_session, process_signals  # noqa: F401

RUNNING = {7: ("sglang::scheduler", psutil.STATUS_SLEEPING)}


def look(now: float, status: str = psutil.STATUS_SLEEPING, in_flight: int = 0, answers: float = 0.0) -> Look:
    return Look(now, {7: ("sglang::scheduler", status)}, in_flight, answers)


# -- the verdicts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [GONE, psutil.STATUS_ZOMBIE])
def test_an_exited_process_fails_the_engine_at_the_first_look(status):
    d = FailureDetector(probe_deadline_s=10, hang_s=100)
    assert d.judge(look(0.0, status)) == "its process 7 (sglang::scheduler) exited"


def test_a_stopped_process_fails_the_engine_after_the_probe_deadline():
    d = FailureDetector(probe_deadline_s=10, hang_s=100)
    assert d.judge(look(0.0, psutil.STATUS_STOPPED)) is None
    assert d.judge(look(9.9, psutil.STATUS_STOPPED)) is None
    cause = d.judge(look(10.0, psutil.STATUS_STOPPED))
    assert (
        cause
        == "its process 7 (sglang::scheduler) has been stopped for 10 s (rollout.fault_tolerance.probe_deadline_s=10)"
    )


def test_a_brief_stop_is_forgiven():
    """A stop that ends (a debugger's, a job-control one) restarts the deadline."""
    d = FailureDetector(probe_deadline_s=10, hang_s=100)
    assert d.judge(look(0.0, psutil.STATUS_STOPPED)) is None
    assert d.judge(look(5.0)) is None
    assert d.judge(look(6.0, psutil.STATUS_STOPPED)) is None
    assert d.judge(look(15.0, psutil.STATUS_STOPPED)) is None
    assert d.judge(look(16.0, psutil.STATUS_STOPPED)) is not None


def test_requests_with_no_answer_for_hang_s_fail_the_engine():
    d = FailureDetector(probe_deadline_s=10, hang_s=30)
    assert d.judge(look(0.0, in_flight=4, answers=1.0)) is None
    assert d.judge(look(29.0, in_flight=4, answers=1.0)) is None
    assert d.judge(look(30.0, in_flight=4, answers=1.0)) == (
        "4 requests in flight and no answer for 30 s (rollout.fault_tolerance.hang_s=30)"
    )


def test_answers_and_idle_stretches_are_no_hang():
    d = FailureDetector(probe_deadline_s=10, hang_s=30)
    for t in range(0, 300, 20):  # answers every 20 s: a long round that progresses
        assert d.judge(look(float(t), in_flight=3, answers=float(t))) is None
    assert d.judge(look(400.0, in_flight=0, answers=280.0)) is None  # idle between rounds: nothing waits
    assert d.judge(look(420.0, in_flight=2, answers=280.0)) is None  # the quiet starts with the round
    assert d.judge(look(449.0, in_flight=2, answers=280.0)) is None
    assert d.judge(look(450.0, in_flight=2, answers=280.0)) is not None


# -- the seam -----------------------------------------------------------------------------------------


def test_the_fault_seam_parses_its_one_form_and_refuses_others():
    assert faults.planned({}) is None
    assert faults.planned({faults.FAULT_ENV: "kill@step1"}) == faults.Fault("kill", 1)
    assert faults.planned({faults.FAULT_ENV: "stop@step0"}).signal == signal.SIGSTOP
    with pytest.raises(MegagrpoError, match="MEGAGRPO_FAULT_INJECT='kill@2'.*<kill\\|stop>@step<N>"):
        faults.planned({faults.FAULT_ENV: "kill@2"})


# -- the whole path, on a stand-in engine -------------------------------------------------------------


class SilentTokenizerManager:
    """The two fields the watch reads, and what `RolloutEngine.start` calls."""

    def __init__(self) -> None:
        self.rid_to_state: dict[str, object] = {}
        self.last_receive_tstamp = 0.0
        self.model_config = SimpleNamespace(
            hf_config=SimpleNamespace(num_hidden_layers=1, vocab_size=16, num_experts_per_tok=0)
        )
        self.context_len = 64
        self.tokenizer = None

    def auto_create_handle_loop(self) -> None:
        pass


class SilentEngine:
    """`sglang.Engine` whose requests are accepted and never answered (a stopped or stuck scheduler)."""

    run_scheduler_process_func = staticmethod(print)  # wrapped by `engine_class`, never run

    def __init__(self, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = SilentTokenizerManager()
        self.server_args = SimpleNamespace(enable_return_routed_experts=False)

    async def async_generate(self, input_ids, sampling_params, **kwargs):
        self.tokenizer_manager.rid_to_state["r0"] = object()
        await asyncio.sleep(30)  # without a watch the request would wait for ever: fail the test instead
        raise TimeoutError("the request waited 30 s and no watch failed the engine")


@pytest.fixture
def silent_engine(tmp_path, monkeypatch, process_signals):  # noqa: F811
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 0}))
    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine"):
        fake = types.ModuleType(name)
        fake.Engine = SilentEngine
        monkeypatch.setitem(sys.modules, name, fake)
    eng = RolloutEngine(RolloutConfig(model_path=str(tmp_path)), name="engine 0 of 1: a stand-in").start()
    # a real process in the scheduler's place: its title names it as SGLang's does
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "sglang::scheduler"])
    eng._child_pids = [proc.pid]
    yield eng, proc
    if eng._watch is not None:
        eng._watch.stop()
    proc.kill()
    proc.wait()
    inner, eng._engine = eng._engine, None
    inner.loop.close()


@pytest.mark.parametrize(
    ("kind", "cause"),
    [("kill", "exited"), ("stop", "has been stopped for"), (None, "no answer for")],
)
def test_a_killed_stopped_or_hung_engine_fails_the_waiting_request(silent_engine, kind, cause):
    """SIGKILL, SIGSTOP (by the test seam, once the request is in flight), or no signal and no answer:
    the request ends with EngineFailed naming the engine and the cause, within the deadlines, and the
    engine's processes are gone (a stopped one too)."""
    eng, proc = silent_engine
    eng.start_watch(probe_interval_s=0.05, probe_deadline_s=0.5, hang_s=1.0)
    if kind is not None:
        faults.inject_when_busy(eng, faults.Fault(kind, 0))
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as e:
        eng.generate([[1, 2]], SamplingConfig(max_new_tokens=1))
    took = time.monotonic() - t0
    assert cause in str(e.value) and "engine 0 of 1: a stand-in" in str(e.value)
    assert took < 5.0, f"found after {took:.1f} s"
    assert proc.poll() is not None  # ended by the failure (SIGKILL ends a stopped process too)
    with pytest.raises(EngineFailed):  # every later use fails at once
        eng.generate([[1, 2]], SamplingConfig(max_new_tokens=1))


def test_a_healthy_idle_engine_is_left_alone(silent_engine):
    eng, proc = silent_engine
    eng.start_watch(probe_interval_s=0.05, probe_deadline_s=0.2, hang_s=0.2)
    time.sleep(0.6)
    assert eng.failed is None and proc.poll() is None


# -- the loop's exit ----------------------------------------------------------------------------------


def test_an_engine_lost_mid_step_exits_with_its_own_code(process_signals, capsys):  # noqa: F811
    """The loop ends with ENGINE_LOST_EXIT_CODE and a line naming the engine and the cause, also when the
    error arrives wrapped (the weight sync names its engine around EngineFailed); nothing is saved
    mid-step."""
    saves: list[int] = []

    def lose(step: int) -> None:
        if step == 2:
            try:
                raise EngineFailed("engine 0 of 1: its process 7 (sglang::scheduler) exited")
            except EngineFailed as e:
                raise MegagrpoError("engine 0 of 1 (colocated, rank 0): weight sync failed") from e

    s = loop_session(saves, save_every=1, on_step=lose)
    assert s.loop(s.step_fn, total=4) == ENGINE_LOST_EXIT_CODE == 69
    assert saves == [1]
    err = capsys.readouterr().err
    assert (
        "rollout engine lost at step 1 of 4: engine 0 of 1: its process 7 (sglang::scheduler) exited" in err
    )
    assert "--resume auto" in err


def test_other_errors_are_not_an_engine_loss(process_signals):  # noqa: F811
    s = loop_session([], save_every=1, on_step=lambda step: (_ for _ in ()).throw(MegagrpoError("bad")))
    with pytest.raises(MegagrpoError, match="bad"):
        s.loop(s.step_fn, total=2)
    assert engine_failure(ValueError("x")) is None


# -- the knobs ----------------------------------------------------------------------------------------


def test_the_knobs_default_and_refuse_a_deadline_shorter_than_a_look():
    from megagrpo.config.loader import load_config

    reference = Path(__file__).resolve().parents[3] / "configs" / "reference.yaml"
    ft = load_config(reference, [], check_paths=False).rollout.fault_tolerance
    assert (ft.probe_interval_s, ft.probe_deadline_s, ft.hang_s) == (1.0, 10.0, 1800.0)
    with pytest.raises(
        MegagrpoError, match="rollout.fault_tolerance.probe_deadline_s.*below probe_interval_s=5"
    ):
        load_config(
            reference,
            ["rollout.fault_tolerance={probe_interval_s: 5, probe_deadline_s: 2}"],
            check_paths=False,
        )


# -- the replacement (owner side), on stand-ins -------------------------------------------------------


def owner(max_restarts: int, fails: list[bool], checksum_ok: float = 1.0):
    """A Session with only what `generate_recovering` touches: each round fails while `fails` says so;
    the engine's start and the weight sync are recorded."""
    from megagrpo.trainer.session import Session

    s = object.__new__(Session)
    s.cfg = SimpleNamespace(
        rollout=SimpleNamespace(engine_tp=1, fault_tolerance=SimpleNamespace(max_restarts=max_restarts))
    )
    s.engine_restarts, s.placement, s.needs_engine = 0, None, True
    s.recovery = dict.fromkeys(
        ("rollout/engine_restarts", "rollout/regenerated_requests", "perf/recovery_seconds"), 0.0
    )
    s.learner = SimpleNamespace(mesh=SimpleNamespace(device="cpu"))
    s.events = []

    def generate_with(prompts, sampling, group_size, index_offset):
        s.events.append(("generate", sampling, index_offset))
        if fails.pop(0):
            raise EngineFailed("engine 0 of 1: its process 7 (sglang::scheduler) exited")
        return [["done"] * group_size for _ in prompts]

    s.generate_with = generate_with
    s.engine = SimpleNamespace(name="engine 0 of 1", shutdown=lambda: s.events.append(("shutdown",)))

    def start_local_engine(placement):
        s.events.append(("start",))
        return SimpleNamespace(name="engine 0 of 1", shutdown=lambda: None)

    s.start_local_engine = start_local_engine
    s.learner_phase = lambda: s.events.append(("learner_phase",))
    s.sync_weights = lambda: s.events.append(("sync", s.checksum_forced)) or {"sync/checksum_ok": checksum_ok}
    return s


def test_a_failed_round_is_sent_again_to_a_replacement_with_the_current_weights(capsys):
    s = owner(max_restarts=1, fails=[True, False])
    groups = s.generate_recovering(["p0", "p1"], "sampling(seed=41)", 4, 8)
    assert groups == [["done"] * 4] * 2
    assert s.events == [
        ("generate", "sampling(seed=41)", 8),
        ("shutdown",),
        ("start",),
        ("learner_phase",),
        ("sync", True),  # checksummed, whatever sync.checksum says
        ("generate", "sampling(seed=41)", 8),  # the same seeds, the same global indices
    ]
    m = s.recovery_metrics()
    assert m["rollout/engine_restarts"] == 1.0 and m["rollout/regenerated_requests"] == 8.0
    assert m["perf/recovery_seconds"] >= 0.0 and s.recovery_metrics()["rollout/engine_restarts"] == 0.0
    assert "; its weights checksummed; 8 requests sent again" in capsys.readouterr().out


def test_a_spent_budget_ends_the_run_with_the_engine_named():
    s = owner(max_restarts=1, fails=[True, True])
    with pytest.raises(EngineFailed, match="exited; its restart budget is spent .*max_restarts=1"):
        s.generate_recovering(["p0"], "sampling", 2, 0)
    assert [e[0] for e in s.events].count("start") == 1


def test_a_replacement_whose_weights_fail_their_checksum_is_not_used():
    s = owner(max_restarts=1, fails=[True, False], checksum_ok=0.0)
    with pytest.raises(EngineFailed, match="exited; the weights synced into the replacement .* checksum"):
        s.generate_recovering(["p0"], "sampling", 2, 0)
    assert [e[0] for e in s.events] == ["generate", "shutdown", "start", "learner_phase", "sync"]


def test_no_budget_is_todays_clear_error():
    """max_restarts=0 (the default): the round's EngineFailed goes up as it is, nothing is replaced."""
    s = owner(max_restarts=0, fails=[True])
    with pytest.raises(EngineFailed, match="engine 0 of 1: its process 7 .* exited$"):
        s.generate_recovering(["p0"], "sampling", 2, 0)
    assert s.events == [("generate", "sampling", 0)] and s.recovery_metrics() == {}


def test_replacement_is_refused_where_it_is_not_built():
    from megagrpo.config.loader import load_config

    reference = Path(__file__).resolve().parents[3] / "configs" / "reference.yaml"
    with pytest.raises(MegagrpoError, match="max_restarts.*rollout.mode=async.*max_restarts=0"):
        load_config(
            reference, ["rollout.fault_tolerance.max_restarts=1", "rollout.mode=async"], check_paths=False
        )
