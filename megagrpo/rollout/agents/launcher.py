"""The launcher of one command agent (`rollout.agents.endpoint`): runs the agent, and ends its whole process
tree when it ends, whatever the agent left running.

    python -I -S launcher.py <owner pid> -- <agent argv...>

run by the engine owner with the agent's environment and standard streams (files: the data row, its
output). The launcher is a child subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux 3.4): every process the
agent starts, in its own session (`setsid`) or orphaned by a double fork, stays a descendant of the launcher,
since an orphan is handed to its nearest subreaper instead of to init. The agent runs in a process group of
its own. When it exits the launcher kills its group, then every process left below the launcher (its
children, read from /proc, again and again as killed parents hand theirs down), reaps them, and exits with
the agent's status: 0..255 as the agent's exit code, a signal re-raised on itself. SIGTERM (the owner's, at
the session's deadline, or PR_SET_PDEATHSIG's, when the thread that started it exits) ends the tree the same
way, and the launcher then exits 143. An agent that cannot be started (no such program, no file
descriptor left) is reported on standard error after `START_FAILED_MARK` with exit code `START_FAILED`.

Stdlib only, run isolated (-I -S): it starts in a few milliseconds and imports nothing of the trainer's.
Host cost: one small Python process per running command agent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

START_FAILED = 125  # exit code: the agent could not be started (the reason on stderr)
START_FAILED_MARK = "megagrpo-launcher: cannot start"
END_DEADLINE_S = 10.0  # an unkillable process (uninterruptible sleep) is left after this long
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    """SIGTERM arrived: end the tree now."""


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _children() -> set[int]:
    """This process's children (live or zombie), from /proc."""
    me = os.getpid()
    try:
        kids: set[int] = set()
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children") as f:
                kids.update(int(x) for x in f.read().split())
        return kids
    except OSError:  # a kernel without /proc/<pid>/task/<tid>/children: every process's parent
        kids = set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                    kids.add(int(name))
        return kids


def end_tree(group: int | None) -> None:
    """Kill the agent's process group and every process below this one, and reap them all."""
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + END_DEADLINE_S
    while time.monotonic() < deadline:
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:  # nothing below this process any more
            return
        time.sleep(0.005)


def _exit_as(code: int) -> None:
    """Exit with the agent's status: its exit code, or the signal that ended it."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to end a process
    sys.stdout.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit(f"usage: {argv[0]} <owner pid> -- <agent argv...>")
    owner, command = int(argv[1]), argv[3:]

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the tree is being ended
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != owner:  # the owner's thread was gone before PR_SET_PDEATHSIG was set
        sys.exit(143)
    try:
        agent = subprocess.Popen(command, start_new_session=True)
    except _Stop:
        end_tree(None)
        os._exit(143)
    except OSError as e:
        print(f"{START_FAILED_MARK} {command[0]}: {e}", file=sys.stderr, flush=True)
        os._exit(START_FAILED)
    try:
        while True:  # reap whatever is handed down to this subreaper until the agent itself exits
            pid, status = os.waitpid(-1, 0)
            if pid == agent.pid:
                agent.returncode = os.waitstatus_to_exitcode(status)
                break
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent has ended: end its tree, whatever comes
    except _Stop:
        end_tree(agent.pid)
        os._exit(143)
    end_tree(agent.pid)
    _exit_as(agent.returncode)


if __name__ == "__main__":
    main(sys.argv)
