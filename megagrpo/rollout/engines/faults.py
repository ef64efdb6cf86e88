"""Fault injection, a TEST SEAM: the one place that reads `MEGAGRPO_FAULT_INJECT` (docs/reliability.md).

`MEGAGRPO_FAULT_INJECT=<kill|stop>@step<N>` makes every colocated engine owner of the run signal its
engine's scheduler in the middle of step N's first round (N counts completed steps, from 0): once the
round's requests are in flight, the owner sends SIGKILL (`kill`) or SIGSTOP (`stop`) to the scheduler by
pid, as a crash or a frozen process would. The owner's watch (`rollout.engines.watch`) must then find the
engine failed. Unset, nothing is injected; a value of another form is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time

import psutil

from megagrpo.errors import MegagrpoError

FAULT_ENV = "MEGAGRPO_FAULT_INJECT"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # a key of SIGNALS
    step: int

    @property
    def signal(self) -> int:
        return SIGNALS[self.kind]


def planned(environ: dict[str, str] | None = None) -> Fault | None:
    """The fault `MEGAGRPO_FAULT_INJECT` asks for (module doc), or None when it is unset or empty."""
    value = (os.environ if environ is None else environ).get(FAULT_ENV, "").strip()
    if not value:
        return None
    m = re.fullmatch(r"(kill|stop)@step(\d+)", value)
    if m is None:
        raise MegagrpoError(
            f"{FAULT_ENV}={value!r}: the test seam takes <kill|stop>@step<N> (e.g. kill@step1); unset it "
            "outside fault-injection tests"
        )
    return Fault(kind=m.group(1), step=int(m.group(2)))


def scheduler_pid(pids: list[int]) -> int:
    """The engine's (TP rank 0) scheduler among its processes, by the title SGLang gives it."""
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if "scheduler" in p.name() or "scheduler" in " ".join(p.cmdline()):
                return pid
        except psutil.NoSuchProcess:
            continue
    raise MegagrpoError(f"{FAULT_ENV}: no scheduler among the engine's processes {pids}")


def inject_when_busy(engine, fault: Fault, timeout_s: float = 600.0) -> threading.Thread:
    """A thread that, once `engine` has requests in flight, sends `fault.signal` to its scheduler (module
    doc); it gives up silently after `timeout_s` (the round ended first, or never started)."""
    pid = scheduler_pid(engine.pids)

    def inject() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and engine.failed is None:
            if engine.request_progress()[0] > 0:
                os.kill(pid, fault.signal)
                print(
                    f"{FAULT_ENV}: sent {signal.Signals(fault.signal).name} to {engine.name}'s scheduler "
                    f"(pid {pid}) at step {fault.step}",
                    flush=True,
                )
                return
            time.sleep(0.005)

    t = threading.Thread(target=inject, name="megagrpo-fault-inject", daemon=True)
    t.start()
    return t
