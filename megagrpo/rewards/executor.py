"""Run reward calls on daemon worker threads, each with its own deadline.

Why threads and not a process pool:
- user reward functions are arbitrary callables (closures, lambdas, objects holding state); a process
  pool would have to pickle them and re-import math-verify/sympy (seconds) in every worker, and forking a
  trainer that holds torch, gloo and SGLang state is unsafe;
- verifiers are short Python calls, so the GIL costs little next to a generation step.

What a deadline does: the call's result is discarded and the completion scores 0 at once. The stuck
thread is then asked to stop by raising `RewardDeadline` inside it (`PyThreadState_SetAsyncExc`), which
ends pure-Python hangs such as a runaway sympy simplification at their next bytecode. A thread blocked
inside C code cannot be interrupted; it is abandoned (it is a daemon, so it never blocks interpreter
exit) and a fresh worker replaces it, so the pool keeps its capacity either way.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class RewardDeadline(BaseException):  # noqa: N818 - raised asynchronously; BaseException so `except Exception` in user code cannot swallow it
    """Raised inside a worker thread whose reward call ran past its time limit."""


@dataclass
class Outcome:
    """What happened to one call: value (when ok), the error text, or a timeout."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclass
class _Task:
    index: int
    fn: Callable[[], Any]
    timeout_s: float
    started: float | None = None
    done: bool = False
    outcome: Outcome = field(default_factory=Outcome)


class _Worker:
    def __init__(self, pool: DeadlinePool, name: str) -> None:
        self.pool = pool
        self.lock = threading.Lock()  # guards `task` hand-over against a concurrent deadline
        self.task: _Task | None = None
        self.retired = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.retired:
                item = self.pool._queue.get()
                if item is None:
                    return
                self._execute(item)
        except RewardDeadline:
            pass  # a late deadline for a call that already finished: this worker was retired anyway

    def _execute(self, task: _Task) -> None:
        with self.lock:
            self.task = task
            task.started = time.monotonic()
        try:
            value, error = task.fn(), None
        except RewardDeadline:
            return  # the pool already recorded the timeout and retired this worker
        except Exception as e:  # a reward that raises scores 0; the message is kept for the log
            value, error = None, f"{type(e).__name__}: {e}"
        with self.lock:
            if task.done:  # timed out while finishing: the pool's verdict stands
                return
            task.outcome = Outcome(value=value, error=error, seconds=time.monotonic() - task.started)
            task.done = True
            self.task = None
        self.pool._finished.release()


class DeadlinePool:
    """A fixed number of daemon worker threads; `map` runs callables with per-call deadlines."""

    def __init__(self, num_workers: int = 2, name: str = "reward") -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._name = name
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._finished = threading.Semaphore(0)
        self._workers = [_Worker(self, f"{name}-{i}") for i in range(num_workers)]
        self._spawned = num_workers
        self.abandoned_threads = 0  # workers retired by a deadline (a growing count means real hangs)

    def map(self, calls: list[tuple[Callable[[], Any], float]], poll_s: float = 0.01) -> list[Outcome]:
        """Run each (fn, timeout_s); return one Outcome per call in order. Never raises for a call's error."""
        tasks = [_Task(i, fn, t) for i, (fn, t) in enumerate(calls)]
        for t in tasks:
            self._queue.put(t)
        remaining = len(tasks)
        while remaining:
            if self._finished.acquire(timeout=poll_s):
                remaining -= 1
                continue
            remaining -= self._expire()
        return [t.outcome for t in tasks]

    def _expire(self) -> int:
        """Time out every running call past its deadline; return how many were expired."""
        now, expired = time.monotonic(), 0
        for w in list(self._workers):
            with w.lock:
                t = w.task
                if t is None or t.done or t.started is None or now - t.started <= t.timeout_s:
                    continue
                t.outcome = Outcome(timed_out=True, seconds=now - t.started)
                t.done = True
                w.task = None
                w.retired = True
                raise_in_thread(w.thread, RewardDeadline)
            expired += 1
            self._workers.remove(w)
            self.abandoned_threads += 1
            self._spawned += 1
            self._workers.append(_Worker(self, f"{self._name}-{self._spawned}"))
        return expired

    def close(self) -> None:
        """Stop idle workers (stuck ones are daemons and die with the process)."""
        for _ in self._workers:
            self._queue.put(None)
        self._workers = []


def raise_in_thread(thread: threading.Thread, exc: type[BaseException]) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))
