"""The engine owner's watch over its colocated engine: a dead, stopped or hung engine fails with an error
naming it and the cause, instead of leaving the round waiting on it for ever (docs/reliability.md).

Two checks, one look every `probe_interval_s` from a thread of the owner:

- liveness: every process the engine started (its schedulers, its detokenizer) is running. One that has
  exited (SIGKILL, the OOM killer, a crash) fails the engine at the next look; one that is stopped
  (SIGSTOP, a frozen cgroup) fails it once it has stayed stopped for `probe_deadline_s`. A stopped
  scheduler never dies, so SGLang's own watchdog (which waits for a child to exit) never sees it.
- hang: requests are in flight and the engine has answered nothing for `hang_s` (a scheduler alive but
  stuck). An answer is any message the tokenizer manager receives from the detokenizer.

`FailureDetector` judges the looks and knows nothing of SGLang or threads (unit-tested with made-up
looks); `EngineWatch` takes the looks of one `RolloutEngine` and fails it (`RolloutEngine.fail`).

Host cost: one thread per engine owner, and per look one /proc read per engine process plus two
attribute reads of the tokenizer manager.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping

import psutil

GONE = "gone"  # no such process (reaped), a state of our own beside psutil's
_EXITED = (GONE, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


@dataclasses.dataclass(frozen=True)
class Look:
    """What the watch sees of an engine at `now` (monotonic seconds): each process's (name, status), the
    requests in flight, and a stamp that changes whenever the engine answers."""

    now: float
    processes: Mapping[int, tuple[str, str]]
    in_flight: int
    answers: float


class FailureDetector:
    """Liveness and hang verdicts over a sequence of looks (module doc): `judge` returns the cause of the
    engine's failure, or None while it serves."""

    def __init__(self, *, probe_deadline_s: float, hang_s: float) -> None:
        self.probe_deadline_s = probe_deadline_s
        self.hang_s = hang_s
        self._stopped_since: dict[int, float] = {}
        self._quiet_since: float | None = None  # since when requests wait with no answer
        self._answers: float | None = None

    def judge(self, look: Look) -> str | None:
        for pid, (name, status) in look.processes.items():
            if status in _EXITED:
                return f"its process {pid} ({name}) exited"
            if status in _STOPPED:
                since = self._stopped_since.setdefault(pid, look.now)
                if look.now - since >= self.probe_deadline_s:
                    return (
                        f"its process {pid} ({name}) has been stopped for {look.now - since:.0f} s "
                        f"(rollout.fault_tolerance.probe_deadline_s={self.probe_deadline_s:g})"
                    )
            else:
                self._stopped_since.pop(pid, None)
        if look.in_flight == 0:
            self._quiet_since, self._answers = None, look.answers
            return None
        if self._quiet_since is None or look.answers != self._answers:
            self._quiet_since, self._answers = look.now, look.answers
        quiet = look.now - self._quiet_since
        if quiet >= self.hang_s:
            return (
                f"{look.in_flight} requests in flight and no answer for {quiet:.0f} s "
                f"(rollout.fault_tolerance.hang_s={self.hang_s:g})"
            )
        return None


def process_states(pids: list[int]) -> dict[int, tuple[str, str]]:
    """(name, psutil status) of each pid; `GONE` for one that no longer exists."""
    out = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out[pid] = (p.name(), p.status())
        except psutil.NoSuchProcess:
            out[pid] = ("?", GONE)
    return out


class EngineWatch:
    """A daemon thread that looks at `engine` every `probe_interval_s` and calls `engine.fail(cause)` once
    `FailureDetector` finds a cause; then it ends. `stop()` ends it first (before a shutdown, whose killed
    processes are no failure)."""

    def __init__(
        self,
        engine,
        *,
        probe_interval_s: float,
        probe_deadline_s: float,
        hang_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.interval = probe_interval_s
        self.detector = FailureDetector(probe_deadline_s=probe_deadline_s, hang_s=hang_s)
        self.clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megagrpo-engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    def look(self) -> Look:
        in_flight, answers = self.engine.request_progress()
        return Look(self.clock(), process_states(self.engine.pids), in_flight, answers)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.engine.failed is not None:
                return
            cause = self.detector.judge(self.look())
            if cause is not None and not self._stop.is_set():
                self.engine.fail(cause)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
