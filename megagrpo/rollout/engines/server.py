"""An engine rank of a disaggregated launch: SGLang's HTTP server, serving until the learner says stop.

`rollout.placement.kind: disaggregated` gives the last `num_engines * engine_tp` ranks of a launch to the
samplers (`config.mesh_rules.rank_roles`). The first rank of each engine runs SGLang's own HTTP server
(`sglang.srt.entrypoints.http_server.launch_server`, the server slime and miles drive) on its devices,
with the same engine arguments a colocated engine gets (`RolloutEngine.engine_kwargs`), and publishes its
URL in the launch's store (`rollout.engines.rendezvous`) once it is ready; the other ranks of a TP group only
wait (their GPUs are the server's). An engine over several nodes (`config.mesh_rules.engine_nodes`,
GPUs or CPU ranks) is started by its first rank on each node: node 0's rank publishes where the nodes meet
(`dist_init_addr`, a free port on its host) and runs the HTTP server; the first rank on node k starts
SGLang's node k (`nnodes`, `node_rank`), whose schedulers join node 0's and serve no HTTP.

Access. The server listens on the address it advertises (`net.advertised_host`), not on every interface,
and requires a key made here for this launch (`secrets.token_urlsafe`), published in the store beside the
URL: SGLang's `api_key` guards its ordinary endpoints (`/generate`, `/server_info`, ...) and its
`admin_api_key` the ones that change the engine (`/update_weights_from_distributed`,
`/init_weights_update_group`, `/weights_checker`, ...), which accept only the admin key once it is set;
both are this one key, sent as `Authorization: Bearer <key>` by every client of the launch
(`RemoteEngine`). Only `/health*`, `/ready*` and `/metrics*` answer without it (SGLang's rule). The learner rank that owns the engine talks to it over HTTP
(`rollout.engines.remote.RemoteEngine`) and sends weights over a broadcast group (`sync.broadcast`).

Signals. The server runs on a worker thread, so neither uvicorn nor SGLang installs its SIGTERM handler
(both do so on the main thread only): a preemption's SIGTERM reaches every rank of the job, and the engine
must keep serving while the learners finish their step and checkpoint; the learner then asks it to stop.
SIGTERM and SIGINT are therefore ignored here. SIGQUIT is what SGLang's children send their parent when
they fail: the failure is published in the store, where the owner's waiting request sees it within a
second (`RemoteEngine`), so the learner's error, naming the engine, ends the run; this rank waits for the
stop like any other.

Exit. When the store says stop, or the store is gone (learner rank 0, which may host it, has exited), the
server's processes are killed and the rank exits 0: the learners' exit codes are the job's.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from megagrpo.errors import MegagrpoError
from megagrpo.net import advertised_host, free_port
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.engines import rendezvous

POLL_S = 0.5


def server_args(rc: RolloutConfig, host: str, port: int, key: str) -> Any:
    """SGLang's ServerArgs of a disaggregated engine: a colocated engine's arguments (one code path for
    what the engine computes), an HTTP address and the launch's key (module doc, "Access"; set over any
    `extra_engine_args`). No warm-up request: the first rollout warms it."""
    from sglang.srt.server_args import ServerArgs

    from megagrpo.rollout.engines.engine import RolloutEngine

    kw = RolloutEngine(rc).engine_kwargs()
    kw.pop("enable_memory_saver", None)  # the engine owns its devices: nothing is ever released
    kw.update(host=host, port=port, api_key=key, admin_api_key=key, skip_server_warmup=True)
    return ServerArgs(**kw)


REDACTED = "<redacted>"


def redact_in_logs(secret: str) -> None:
    """Every log record of this process, whatever its logger, with `secret` replaced by `REDACTED`: SGLang logs
    its whole ServerArgs at log_level info (`server_args=` from `Engine._launch_subprocesses`), the launch's
    key among them (`api_key`, `admin_api_key`). By value, through the record factory, so it holds for any
    logger and any handler SGLang configures later (its `configure_logger` replaces the root's handlers)."""
    make = logging.getLogRecordFactory()

    def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        r = make(*args, **kwargs)
        try:
            text = r.getMessage()
        except (TypeError, ValueError):  # a malformed record: logging reports it as it would
            return r
        if secret in text:
            r.msg, r.args = text.replace(secret, REDACTED), None
        return r

    logging.setLogRecordFactory(record)


def serve(
    rc: RolloutConfig,
    *,
    engine: int,
    first: bool,
    addr: str,
    port: int,
    timeout_s: float,
    rank: int | None = None,
    nodes: int = 1,
    node_rank: int = 0,
    nnodes: int = 1,
) -> int:
    """Run engine `engine`'s server (its first rank) or wait beside it (`first=False`) until stopped.
    `addr`, `port`: the launch's store (MASTER_ADDR, MASTER_PORT); `nodes`: how many nodes the launch
    spans (the server's address must reach the others: `net.advertised_host`). An engine over `nnodes`
    nodes: `first` on each node's first rank, which starts SGLang node `node_rank` (module doc)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    # torchrun tells its workers to find the store of any tcp:// rendezvous at the agent's; the weights
    # group that SGLang's schedulers join is hosted by the learner rank that sends, so they must not.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    store = rendezvous.connect(addr, port, timeout_s)
    from megagrpo.rollout.groups import node_name

    where = f"rank {rank if rank is not None else os.environ.get('RANK', '?')} on {node_name()}"
    if first:
        try:
            host = advertised_host(addr, nodes=nodes)
            if nnodes > 1:
                rc = _node_config(rc, store, engine, host, node_rank, nnodes, timeout_s)
            _start_server(rc, store, engine, where, host)
        except MegagrpoError as e:  # a user error (the address, the config): one line, here and at the owner
            rendezvous.publish_failure(store, engine, str(e))
            print(f"megagrpo: error: engine {engine}: {e}", file=sys.stderr, flush=True)
            return 1
        except Exception as e:  # noqa: BLE001 - reported to the owner, which names the engine
            rendezvous.publish_failure(store, engine, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            return 1
    return _wait_for_stop(store, engine, where)


def _node_config(
    rc: RolloutConfig, store: Any, engine: int, host: str, node_rank: int, nnodes: int, timeout_s: float
) -> RolloutConfig:
    """`rc` for SGLang node `node_rank` of a multi-node engine: node 0 picks where the nodes meet (a free
    port on its host) and publishes it; the others wait for it in the store."""
    from dataclasses import replace

    if node_rank == 0:
        dist_init = f"[{host}]:{free_port(host)}" if ":" in host else f"{host}:{free_port(host)}"
        rendezvous.publish_dist_init(store, engine, dist_init)
    else:
        dist_init = rendezvous.wait_dist_init(store, engine, timeout_s)
    return replace(rc, nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init)


def _start_server(rc: RolloutConfig, store: Any, engine: int, where: str, host: str) -> None:
    from sglang.srt.entrypoints import http_server
    from sglang.srt.entrypoints.engine import Engine

    from megagrpo.rollout.engines.engine import RolloutEngine, engine_class
    from megagrpo.rollout.engines.startup import (
        DISABLED_ARCHS_ENV,
        FAILURE_DIR_ENV,
        failure_cause,
        skipped_model_modules,
    )

    skipped = skipped_model_modules(rc.model_path)
    if skipped and not os.environ.get(DISABLED_ARCHS_ENV):
        os.environ[DISABLED_ARCHS_ENV] = ",".join(skipped)  # this process serves one model for its life
    # where its schedulers leave the cause of their death (`rollout.engines.startup`), for the owner's error
    failures = os.environ[FAILURE_DIR_ENV] = tempfile.mkdtemp(prefix=f"megagrpo-engine{engine}-")
    atexit.register(shutil.rmtree, failures, True)
    what = f"{rc.model_path}, tp_size={rc.tp_size}, {where}"

    port, key = free_port(host), secrets.token_urlsafe(32)
    redact_in_logs(key)
    RolloutEngine(rc).export_cpu_threads_bind()  # inherited by the schedulers
    sa = server_args(rc, host=host, port=port, key=key)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    if rc.nnodes > 1:
        # the job's log says which process started which SGLang node (a node >= 1 serves no URL to print)
        per = rc.tp_size // rc.nnodes
        lo = rc.node_rank * per
        print(
            f"engine {engine}: SGLang node {rc.node_rank} of {rc.nnodes}, TP ranks {lo}-{lo + per - 1} of "
            f"{rc.tp_size}, meeting at {rc.dist_init_addr} ({where})",
            flush=True,
        )

    def ready() -> None:
        if rc.node_rank:  # a further node of a multi-node engine: node 0's server is the engine's URL
            return
        rendezvous.publish(store, engine, url, where, key)
        print(f"engine {engine}: SGLang server at {url} ({where})", flush=True)

    def run() -> None:
        try:
            http_server.launch_server(
                sa,
                run_scheduler_process_func=engine_class(Engine).run_scheduler_process_func,
                run_detokenizer_process_func=Engine.run_detokenizer_process_func,
                launch_callback=ready,
            )
        except BaseException as e:  # noqa: BLE001 - the main thread reports it
            cause = failure_cause(failures)
            said = f"its scheduler failed with {cause}" if cause else f"{type(e).__name__}: {e}"
            rendezvous.publish_failure(store, engine, f"its server ({what}) stopped: {said}")
            traceback.print_exc()

    def child_failed(signum: int, frame: Any) -> None:
        # Reported through the store, where the owner's waiting request looks; this rank stays until the
        # learner stops it, so the learner's error (naming the engine), not the launcher's, ends the run.
        cause = failure_cause(failures)
        message = f"an SGLang process of the server ({what}) died" + (f" with {cause}" if cause else "")
        print(f"megagrpo: error: engine {engine}: {message}", file=sys.stderr, flush=True)
        rendezvous.publish_failure(store, engine, message)
        _kill_children()

    signal.signal(signal.SIGQUIT, child_failed)
    threading.Thread(target=run, name=f"sglang-server-{engine}", daemon=True).start()


def _wait_for_stop(store: Any, engine: int, where: str) -> int:
    while True:
        try:
            if rendezvous.stop_requested(store):
                break
        except Exception:  # noqa: BLE001 - the store's host (a learner rank) has exited: so must we
            break
        time.sleep(POLL_S)
    _kill_children()
    return 0


def _kill_children() -> None:
    import psutil

    from megagrpo.rollout.engines.engine import _kill_pids

    _kill_pids([p.pid for p in psutil.Process().children()], timeout=30)
