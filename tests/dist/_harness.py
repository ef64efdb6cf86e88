"""Launch a distributed CPU test body in N processes, forked from a process that has imported megatron once
(import dominates start-up; forking from a parent that has done no compute is safe).

Importing torch, megatron-core and the CPU patches costs about 12 s of CPU per process here, and a
`tests/dist` run makes a dozen launches. So each pytest process starts one import server (`--serve`, the
first time it launches): it imports those once, does no compute, and forks a launcher per request; the
launcher imports the target's module, forks the ranks and exits with their verdict. Every launch thus
starts from the same clean, freshly-imported state, as a process of its own would.

Usage from a test: `launch("tests.dist.workers_smoke:main", 2, tmp_path, timeout=300)`; the worker is
called as `fn(rank, world, outdir, **kwargs)` with RANK/WORLD_SIZE/MASTER_* exported, and writes its
results under outdir. A non-zero exit (any rank raised) fails the test with the captured output.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(target: str, nprocs: int, outdir: Path, *, timeout: float = 600, **kwargs: Any) -> str:
    """Run `target` ("module:function") on `nprocs` forked ranks; returns combined output."""
    outdir = Path(outdir)
    log = outdir / "launch.log"
    rc = run(target, nprocs, outdir, log, timeout=timeout, **kwargs)
    if rc is None:
        raise AssertionError(f"{target} on {nprocs} ranks timed out after {timeout}s:\n{_tail(log, 8000)}")
    if rc != 0:
        raise AssertionError(f"{target} on {nprocs} ranks failed (exit {rc}):\n{_tail(log, 12000)}")
    return log.read_text(errors="replace")


def run(target: str, nprocs: int, outdir: Path, log: Path, *, timeout: float, **kwargs: Any) -> int | None:
    """Run `target` on `nprocs` forked ranks with their output in `log`; the launcher's exit code (non-zero
    when a rank raised or was killed), None on timeout. The launcher's whole process group is killed
    afterwards: dist_checkpointing's writer spawns helper processes that outlive the ranks (which is also
    why the output goes to a file, not a pipe: they would hold it open)."""
    Path(outdir).mkdir(parents=True, exist_ok=True)
    request = dict(
        target=target,
        nprocs=nprocs,
        port=free_port(),
        outdir=str(outdir),
        kwargs=kwargs,
        log=str(log),
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )
    server = _Server.get()
    pid = server.ask(request, timeout=600)["pid"]
    try:
        reply = server.answer(timeout=timeout)
        _kill_group(pid)
        if reply is None:  # timed out: the group is killed, so the launcher's exit is reported at once
            server.answer(timeout=60)
            return None
        return int(reply["rc"])
    except BaseException:  # interrupted (pytest-timeout, ^C): its reply would answer the next request
        _kill_group(pid)
        server.close()
        raise


class _Server:
    """The pytest side of the import server: one per pytest process, one request at a time."""

    _current: _Server | None = None

    def __init__(self) -> None:
        self.log = Path(tempfile.mkstemp(prefix="dist-harness-", suffix=".log")[1])
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        with open(self.log, "w") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.dist._harness", "--serve"],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=sink,
                start_new_session=True,
            )
        self.pending = b""
        atexit.register(self.close)

    @classmethod
    def get(cls) -> _Server:
        if cls._current is None or cls._current.proc.poll() is not None:
            cls._current = cls()
        return cls._current

    def ask(self, request: dict, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        reply = self.answer(timeout)
        if reply is None:
            raise AssertionError(
                f"the dist import server did not answer in {timeout}s:\n{_tail(self.log, 8000)}"
            )
        return reply

    def answer(self, timeout: float) -> dict | None:
        """The server's next reply line, or None after `timeout` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise AssertionError(
                    f"the dist import server exited ({self.proc.wait()}):\n{_tail(self.log, 8000)}"
                )
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # the server exits at end of input
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
        with contextlib.suppress(FileNotFoundError):
            self.log.unlink()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _tail(path: Path, n: int) -> str:
    return Path(path).read_text(errors="replace")[-n:]


def _child(rank: int, target: str, world: int, port: int, outdir: str, kwargs: dict[str, Any]) -> None:
    import torch

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    modname, fname = target.split(":")
    getattr(importlib.import_module(modname), fname)(rank, world, Path(outdir), **kwargs)


def _launcher(request: dict) -> None:
    """The forked launcher of one request: a process group of its own, its output in the request's log,
    the environment of the pytest process that asked; never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(request["env"])
        import torch.multiprocessing as mp

        target = request["target"]
        importlib.import_module(target.split(":")[0])
        args = (target, request["nprocs"], request["port"], request["outdir"], request["kwargs"])
        mp.start_processes(_child, args=args, nprocs=request["nprocs"], start_method="fork", join=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """Import once, then fork a launcher per request line on stdin; reply {"pid"} at its start and {"rc"}
    at its end on stdout. Ends at end of input."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the imports' prints must not mix with the replies
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat()
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch.multiprocessing  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _launcher(request)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"{request['target']}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python -m tests.dist._harness --serve (requests on stdin; see launch())")
    serve()
