"""`make demo`'s driver: Ctrl-C reaches the running stage, which must be left to checkpoint and exit 75."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STAGE = textwrap.dedent(
    """
    import signal, sys, time
    def stop(*_):
        time.sleep(0.5)  # a checkpoint takes a while; the driver must not kill the stage meanwhile
        sys.exit(75)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    time.sleep(60)
    """
)

DRIVER = textwrap.dedent(
    """
    import sys
    from tools.run_demo import run
    code = run([sys.executable, "-c", sys.argv[1]])
    print("stage exit", code, flush=True)
    sys.exit(code)
    """
)


def test_ctrl_c_lets_the_stage_checkpoint_and_returns_its_exit_code():
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, STAGE],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C would hit
    )
    try:
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "stage exit 75" in out
    assert proc.returncode == 75
