"""One disaggregated engine server in a subprocess, for tests of the weight path without learners.

`engine_server(model_dir, log)` plays the launch's part: this process hosts the TCP store (as learner rank 0
does under srun/mpirun), and a child runs `megagrpo.rollout.engines.server.serve` for engine 0 with the rollout
settings the CPU tests use (fp32, 4096 KV tokens, routes on as the trainer asks), then publishes its URL in
that store. The context yields the URL; on exit it asks the server to stop (`rendezvous.request_stop`) and
kills what is left only if it did not exit within the deadline. The child is `python -m
tests.integration.engine_server MODEL_DIR --port P`, run from the repository root.

`nnodes=n` starts an engine of tp_size n over n "nodes" of one rank each: n children, child k running
`serve(..., node_rank=k, nnodes=n)` as the first engine rank on node k of a launch does (`trainer.entry`):
node 0 publishes where the nodes meet (`dist_init_addr`) and serves HTTP, the others wait for it in the
store and run their scheduler only. The nodes are this host, so they meet on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINE = 0
STOP_TIMEOUT_S = 90  # serve() kills the SGLang children with a 30 s grace, then the process exits


class ServerDied(RuntimeError):
    """The server's process exited before it published its URL."""


@dataclass
class EngineServer:
    proc: subprocess.Popen
    store: Any  # the launch's store, under rendezvous.PREFIX
    url: str
    where: str
    key: str  # the bearer key the server requires (`rollout.engines.server`, "Access")
    log: Path
    nodes: tuple[subprocess.Popen, ...] = ()  # the further nodes of an engine over several (nnodes > 1)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Ask the server to stop, as the learners do at the end of a run; its exit code (the worst of
        its nodes')."""
        from megagrpo.rollout.engines import rendezvous

        if any(p.poll() is None for p in (self.proc, *self.nodes)):
            rendezvous.request_stop(self.store)
        return max(abs(p.wait(timeout=timeout_s)) for p in (self.proc, *self.nodes))

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def engine_server(
    model_dir: Path | str, log: Path, *, timeout_s: float = 600.0, nnodes: int = 1
) -> Iterator[EngineServer]:
    """Start the server for `model_dir` (over `nnodes` nodes: module doc), yield it once its URL is
    published, stop it at the end. Node k > 0 logs to `log` with the suffix `.node<k>`."""
    import torch.distributed as dist

    from megagrpo.rollout.engines import rendezvous

    master = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    store = dist.PrefixStore(rendezvous.PREFIX, master)
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.engine_server",
        str(model_dir),
        "--port",
        str(master.port),
    ]
    cmd += ["--timeout", str(timeout_s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = []
    try:
        for k in range(nnodes):
            node_log = log if k == 0 else log.with_name(f"{log.name}.node{k}")
            with open(node_log, "w") as out:
                node = ["--node-rank", str(k), "--nnodes", str(nnodes)] if nnodes > 1 else []
                procs.append(
                    subprocess.Popen(cmd + node, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
                )
        yield EngineServer(
            procs[0], store, *_wait_for_url(store, procs, log, timeout_s), log, nodes=tuple(procs[1:])
        )
    finally:
        if any(p.poll() is None for p in procs):
            rendezvous.request_stop(store)
        for p in procs:
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill_tree(p.pid)
                p.wait()


def rollout_config(model_dir: Path | str, tp_size: int = 1) -> Any:
    """The engine's settings, on both sides: what `trainer.components.rollout_config` gives a CPU test run
    (fp32, a fixed KV-cache size, routes on)."""
    from megagrpo.rollout.config import RolloutConfig

    return RolloutConfig(
        model_path=str(model_dir), dtype="float32", max_total_tokens=4096, seed=0, tp_size=tp_size
    )


def _wait_for_url(store: Any, procs: list[subprocess.Popen], log: Path, timeout_s: float) -> Any:
    from megagrpo.errors import MegagrpoError
    from megagrpo.rollout.engines import rendezvous

    deadline = time.monotonic() + timeout_s
    while True:
        for k, proc in enumerate(procs):
            if proc.poll() is not None:
                node_log = log if k == 0 else log.with_name(f"{log.name}.node{k}")
                raise ServerDied(
                    f"the engine server (node {k}) exited with {proc.returncode}:\n{node_log.read_text()[-4000:]}"
                )
        try:
            return rendezvous.wait_for(store, ENGINE, 1.0)
        except MegagrpoError:
            # a published failure or the caller's deadline ends the wait; a short wait's own deadline does not
            if rendezvous.failure_of(store, ENGINE) is not None or time.monotonic() > deadline:
                raise


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve engine 0 of a disaggregated launch (tests only).")
    p.add_argument("model_dir")
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--nnodes", type=int, default=1)
    a = p.parse_args(argv)
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)  # before sglang.srt is imported, as trainer.entry does
    from megagrpo.rollout.engines.server import serve

    return serve(
        rollout_config(a.model_dir, tp_size=a.nnodes),  # one rank per node
        engine=ENGINE,
        first=True,
        addr=a.addr,
        port=a.port,
        timeout_s=a.timeout,
        node_rank=a.node_rank,
        nnodes=a.nnodes,
    )


if __name__ == "__main__":
    sys.exit(main())
