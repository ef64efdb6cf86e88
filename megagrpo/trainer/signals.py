"""Signal-driven checkpoints: SIGTERM/SIGUSR1 (Slurm preemption) and SIGINT (Ctrl-C) set a flag.

The loop polls the flag between steps, saves a checkpoint and exits with `REQUEUE_EXIT_CODE`, which the
sbatch templates map to `scontrol requeue`. Handling the signal between steps, never inside one, keeps
every checkpoint at a step boundary and so resumable bit for bit. A step already saved is not saved again,
and a stop that finds the last step done ends the run with exit 0 (`Session.loop`).

The handlers must stay the process's for the whole loop, engine calls included: SGLang's engine would
otherwise take SIGTERM for itself, drain and exit 0 (`RolloutEngine._keep_sigterm` keeps it from doing so).
"""

from __future__ import annotations

import signal
from types import FrameType

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
# EX_UNAVAILABLE: a rollout engine failed (died, stopped or hung: `rollout.engines.watch`) and the run
# cannot go on without it; distinct from a crash (1), a user error (2) and a preemption (75), so a launcher
# can tell "resume once the engine's cause is fixed" from the rest (docs/reliability.md).
ENGINE_LOST_EXIT_CODE = 69


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.signum = signum

    def install(self) -> StopRequest:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reassert(self) -> None:
        """Put our handlers back if a library replaced them; called at every step boundary. (SGLang's
        SIGTERM callback is never armed, see `RolloutEngine._keep_sigterm`; this guards against others.)"""
        for sig in self._previous:
            if signal.getsignal(sig) is not self._handle:
                signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""
