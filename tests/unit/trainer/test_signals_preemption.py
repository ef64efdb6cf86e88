"""Issue 25, items 1 and 5: a stop signal at any moment ends in a checkpoint and exit 75, never exit 0.

Item 1: SIGTERM during the engine's first request must reach the trainer's handler, not SGLang's drain and
exit(0). The engine here is a stand-in for `sglang.Engine` on a uvloop loop (as SGLang's), whose tokenizer
manager arms the SIGTERM callback at its first request as SGLang's does; the real engine is covered by
tests/integration/test_trainer_e2e.py::test_sigterm_checkpoints_and_exits_for_requeue.

Item 5: the loop's save/stop logic, with a counting saver in place of the checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvloop

from megagrpo.rollout.config import RolloutConfig, SamplingConfig
from megagrpo.rollout.engines.engine import RolloutEngine
from megagrpo.trainer.session import Session
from megagrpo.trainer.signals import REQUEUE_EXIT_CODE, StopRequest


@pytest.fixture
def process_signals():
    """Whatever a test does to the process's handlers and wakeup fd is undone after it."""
    sigs = (signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in sigs}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    yield
    for s, h in before.items():
        signal.signal(s, h)
    signal.set_wakeup_fd(wakeup)


class FakeTokenizerManager:
    """What SGLang's `TokenizerManager.auto_create_handle_loop` does at the first request
    (sglang/srt/managers/tokenizer_manager.py): create the request loop's task and, on the main thread,
    register on the running loop a SIGTERM callback that sets `gracefully_exit` (its watchdog then drains,
    kills the schedulers and calls sys.exit(0)) and a SIGQUIT one."""

    def __init__(self) -> None:
        self.event_loop = None
        self.gracefully_exit = False
        self.tasks: list[asyncio.Task] = []
        self.model_config = SimpleNamespace(
            hf_config=SimpleNamespace(num_hidden_layers=1, vocab_size=16, num_experts_per_tok=0)
        )
        self.context_len = 64
        self.tokenizer = None

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.tasks.append(loop.create_task(asyncio.Event().wait()))  # handle_loop
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self._sigterm)
            loop.add_signal_handler(signal.SIGQUIT, lambda: None)

    def _sigterm(self) -> None:
        self.gracefully_exit = True


class FakeSGLangEngine:
    """`sglang.Engine` as `RolloutEngine` uses it; each request is SIGTERMed while it is in flight."""

    run_scheduler_process_func = staticmethod(
        print
    )  # wrapped by `rollout.engines.engine.engine_class`, never run

    def __init__(self, **kwargs) -> None:
        self.loop = uvloop.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager()
        self.server_args = SimpleNamespace(enable_return_routed_experts=False)

    async def async_generate(self, input_ids, sampling_params, **kwargs) -> list[dict]:
        self.tokenizer_manager.auto_create_handle_loop()  # generate_request's first call
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(5):  # loop turns: a callback registered on the loop runs in one of them
            await asyncio.sleep(0.01)
        out = {"output_ids": [3], "meta_info": {"output_token_logprobs": [(-0.5, 3, None)]}}
        out["meta_info"]["finish_reason"] = {"type": "length"}
        return [out for _ in input_ids]

    def close(self) -> None:
        async def teardown() -> None:
            self.loop.remove_signal_handler(signal.SIGTERM)
            self.loop.remove_signal_handler(signal.SIGQUIT)
            for t in self.tokenizer_manager.tasks:
                t.cancel()

        self.loop.run_until_complete(teardown())
        self.loop.close()


@pytest.fixture
def engine(tmp_path, monkeypatch, process_signals):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 0}))
    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine"):
        fake = types.ModuleType(name)
        fake.Engine = FakeSGLangEngine
        monkeypatch.setitem(sys.modules, name, fake)
    eng = RolloutEngine(RolloutConfig(model_path=str(tmp_path))).start()
    yield eng
    inner, eng._engine = eng._engine, None
    inner.close()


@pytest.mark.parametrize("worker_first", [False, True])
def test_sigterm_during_the_first_request_reaches_the_trainer(engine, worker_first):
    """The trainer installs its handler after the engine started (Session.loop); the first request (the
    step-0 evaluation, or a rollout after a requeue) is SIGTERMed. The trainer must get the stop, and
    SGLang's drain-and-exit(0) must never start. `worker_first`: async rollout's worker thread made a
    request before the main thread's first one."""
    if worker_first:
        signal.signal(signal.SIGTERM, lambda *a: None)  # the worker's request is signalled too
        t = threading.Thread(target=engine.generate, args=([[1, 2]], SamplingConfig(max_new_tokens=1)))
        t.start()
        t.join()
    stop = StopRequest().install()
    try:
        groups = engine.generate([[1, 2]], SamplingConfig(max_new_tokens=1), group_size=2)
        assert stop.requested and stop.name() == "SIGTERM"
        assert not engine.engine.tokenizer_manager.gracefully_exit, "SGLang's drain and exit(0) armed"
        assert signal.getsignal(signal.SIGTERM) == stop._handle  # and so for every later signal
        assert [len(g) for g in groups] == [2]
    finally:
        stop.uninstall()


# -- item 5: the loop's save/stop logic ---------------------------------------------------------------


def loop_session(total_saves: list[int], *, save_every: int, on_save=None, on_step=None) -> Session:
    """A Session with only what `loop` touches: the step runs `on_step(step)`, the save records the step
    it saved and runs `on_save(step)` (a signal arriving during the save)."""
    s = object.__new__(Session)
    s.cfg = SimpleNamespace(
        schedule=SimpleNamespace(eval_every=0, save_every=save_every),
        logging=SimpleNamespace(console=False),
    )
    s.stop, s.step, s.stage, s.rank0, s.needs_engine = StopRequest(), 0, "train", True, False
    s.learner = SimpleNamespace(mesh=SimpleNamespace(device="cpu"))
    s._log = lambda step, metrics, progress: None

    def save() -> Path:
        total_saves.append(s.step)
        if on_save is not None:
            on_save(s.step)
        return Path(f"ckpt/step_{s.step:08d}")

    def step_fn() -> dict[str, float]:
        if on_step is not None:
            on_step(s.step + 1)
        return {}

    s.save, s.step_fn = save, step_fn
    return s


def sigterm_at(step: int):
    return lambda now: signal.raise_signal(signal.SIGTERM) if now == step else None


def test_a_stop_during_a_save_does_not_save_that_step_again(process_signals, capsys):
    saves: list[int] = []
    s = loop_session(saves, save_every=1, on_save=sigterm_at(2))
    assert s.loop(s.step_fn, total=5) == REQUEUE_EXIT_CODE
    assert saves == [1, 2]
    assert "SIGTERM: saved ckpt/step_00000002 at step 2" in capsys.readouterr().out


def test_a_stop_during_a_step_saves_that_step_once(process_signals):
    saves: list[int] = []
    s = loop_session(saves, save_every=0, on_step=sigterm_at(2))
    assert s.loop(s.step_fn, total=5) == REQUEUE_EXIT_CODE
    assert saves == [2]


@pytest.mark.parametrize("during", ["last step", "last save"])
def test_a_stop_after_the_last_step_finds_the_run_complete(process_signals, during):
    """The last step always saves; a stop then has nothing left to save or to requeue: exit 0."""
    saves: list[int] = []
    hook = {"on_step" if during == "last step" else "on_save": sigterm_at(3)}
    s = loop_session(saves, save_every=0, **hook)
    assert s.loop(s.step_fn, total=3) == 0
    assert saves == [3]


def test_a_libraries_exit_0_inside_the_loop_is_an_error_not_a_finished_run(process_signals):
    saves: list[int] = []

    def exit_0(step: int) -> None:
        if step == 2:
            sys.exit(0)  # what SGLang's SIGTERM watchdog does once it has drained

    s = loop_session(saves, save_every=1, on_step=exit_0)
    with pytest.raises(RuntimeError, match="SystemExit\\(0\\).*step 1 of 4"):
        s.loop(s.step_fn, total=4)
    assert signal.getsignal(signal.SIGTERM) != s.stop._handle  # the handlers were uninstalled
