"""Process bootstrap for ranks started by the Slurm templates (slurm/*.sbatch): stop file and requeue marker.

The batch shell receives the preemption signal and creates `MEGAGRPO_STOP_FILE` on the shared log
directory (see slurm/lib.sh for why the signal is not sent to the job steps). `watch_stop_file` turns the
file's appearance into a SIGUSR1 raised in this process only, once the trainer has installed its handler
(`megagrpo.trainer.signals.StopRequest`), so the trainer checkpoints at the next step boundary.

`ignore_step_signals` makes SIGUSR1 ignored until the trainer installs its handler. An ignored signal stays
ignored across fork and exec, so the subprocesses a rank starts early (SGLang's scheduler and detokenizer)
survive a step-wide `scancel --signal=USR1`, which would otherwise kill them.

`mark_requeue` leaves `MEGAGRPO_REQUEUE_MARKER` when the trainer exits for a requeue: torchrun reports any
non-zero worker exit as its own exit code 1, so the exit code alone does not reach the batch script.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

STOP_FILE_ENV = "MEGAGRPO_STOP_FILE"
REQUEUE_MARKER_ENV = "MEGAGRPO_REQUEUE_MARKER"


def ignore_step_signals(environ: dict[str, str] | None = None) -> bool:
    """Ignore SIGUSR1 when running under a megagrpo Slurm script (the stop file is the signal path)."""
    env = os.environ if environ is None else environ
    if not env.get(STOP_FILE_ENV):
        return False
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    return True


def _handler_installed(signum: int) -> bool:
    return callable(signal.getsignal(signum))


def watch_stop_file(
    path: str | Path | None = None, *, poll_s: float = 1.0, signum: int = signal.SIGUSR1
) -> threading.Event | None:
    """Start a daemon thread that raises `signum` in this process when `path` appears.

    Returns an Event that stops the watcher, or None when no stop file is configured. The signal is sent
    only once a Python handler is installed for it (before that it would be ignored or fatal), and once.
    """
    path = path if path is not None else os.environ.get(STOP_FILE_ENV)
    if not path:
        return None
    stop_file, done = Path(path), threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if stop_file.exists() and _handler_installed(signum):
                os.kill(os.getpid(), signum)
                return

    threading.Thread(target=watch, name="megagrpo-stop-file", daemon=True).start()
    return done


def mark_requeue(exit_code: int, requeue_exit_code: int, environ: dict[str, str] | None = None) -> bool:
    """Create the requeue marker if the trainer exited with `requeue_exit_code` and a marker is configured."""
    env = os.environ if environ is None else environ
    marker = env.get(REQUEUE_MARKER_ENV)
    if exit_code != requeue_exit_code or not marker:
        return False
    Path(marker).touch()
    return True
