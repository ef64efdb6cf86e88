"""Where each disaggregated engine listens, told through the launch's own key-value store.

Disaggregated placement (`rollout.placement.kind`) splits one launch into learner ranks and engine ranks.
They meet in the TCP store the launch already has at MASTER_ADDR:MASTER_PORT (torchrun's agent store, or
the one learner rank 0 hosts for its process group under srun/mpirun), so no extra port or file is
needed: an engine rank publishes its server's URL when the server is ready, the learner rank that owns the
engine waits for it (with the engine deadline), and at the end the owner asks its engine to stop.

Keys (under the prefix `megagrpo/`): `engine/<e>/url`, `engine/<e>/where` (rank and host, for errors),
`engine/<e>/key` (the bearer key its server requires, made by the engine rank for this launch),
`engine/<e>/failed` (the engine rank's last words when its server could not start), `stop`; and for an
engine over several nodes, `engine/<e>/dist_init` (host:port where its nodes' schedulers meet, published
by node 0's rank before its server starts, read by the ranks that start the other nodes).

The key keeps clients outside the launch from driving the engine (generating, or writing its weights);
the store itself is torch's TCPStore, without authentication, so a process that speaks its protocol on
MASTER_ADDR:MASTER_PORT can read it: the launch's network is trusted that far, as for the process groups.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch.distributed as dist

from megagrpo.errors import MegagrpoError

PREFIX = "megagrpo/"


def connect(addr: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the launch's store (it exists once the launcher or learner rank 0 is up)."""
    store = dist.TCPStore(
        addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return dist.PrefixStore(PREFIX, store)


class Endpoint(NamedTuple):
    """Where engine e listens, as its rank published it."""

    url: str
    where: str  # its rank and host, for errors
    key: str  # the bearer key its server requires (`Authorization: Bearer <key>`)


class StoreGone(MegagrpoError):
    """The launch's store stopped answering: the process that hosts it has exited."""


@contextlib.contextmanager
def answering(store: dist.Store) -> Iterator[None]:
    """The store's own errors (a closed connection, a broken pipe: `DistError`) as one `StoreGone` that
    names the store and what its silence means."""
    try:
        yield
    except dist.DistError as e:
        base = getattr(store, "underlying_store", store)
        at = f" at {base.host}:{base.port}" if hasattr(base, "host") else ""
        raise StoreGone(
            f"the launch's store{at} (MASTER_ADDR:MASTER_PORT) does not answer ({type(e).__name__}: {e}): "
            "the process that hosts it, the launch's rank 0 (or torchrun's agent), is gone, so no rank can "
            "go on. Rank 0's log says why; resume from the last checkpoint"
        ) from None


def publish(store: dist.Store, engine: int, url: str, where: str, key: str) -> None:
    store.set(f"engine/{engine}/where", where)
    store.set(f"engine/{engine}/key", key)
    store.set(f"engine/{engine}/url", url)  # last: the owner waits for it


def publish_failure(store: dist.Store, engine: int, message: str) -> None:
    store.set(f"engine/{engine}/failed", message[-4000:])


def publish_dist_init(store: dist.Store, engine: int, addr: str) -> None:
    store.set(f"engine/{engine}/dist_init", addr)


def wait_dist_init(store: dist.Store, engine: int, timeout_s: float) -> str:
    """host:port where the nodes of multi-node engine `engine` meet (SGLang's dist_init_addr), once node
    0's rank has published it; MegagrpoError past the deadline or when that rank reported a failure."""
    key, failed = f"engine/{engine}/dist_init", f"engine/{engine}/failed"
    deadline = time.monotonic() + timeout_s
    while True:
        with answering(store):
            if store.check([failed]):
                raise MegagrpoError(f"engine {engine}: its node 0 failed: {store.get(failed).decode()}")
            if store.check([key]):
                return store.get(key).decode()
        if time.monotonic() > deadline:
            raise MegagrpoError(
                f"engine {engine}: its node 0 did not publish where its nodes meet within "
                f"rollout.placement.engine_timeout_s={timeout_s:.0f} s; see that rank's log"
            )
        time.sleep(0.2)


def wait_for(store: dist.Store, engine: int, timeout_s: float) -> Endpoint:
    """Where engine `engine` listens, once its server is ready; MegagrpoError past the deadline or when
    the engine rank reported that its server failed to start."""
    deadline = time.monotonic() + timeout_s
    while True:
        with answering(store):
            found = _published(store, engine)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise MegagrpoError(
                f"engine {engine} did not come up within rollout.placement.engine_timeout_s={timeout_s:.0f} s; "
                "see its rank's log (the last ranks of the launch), or raise the deadline"
            )
        time.sleep(0.2)


def _published(store: dist.Store, engine: int) -> Endpoint | None:
    """Engine `engine`'s endpoint, or None while it is not published; MegagrpoError when its rank reported
    that its server failed to start."""
    url_key, failed_key = f"engine/{engine}/url", f"engine/{engine}/failed"
    if store.check([failed_key]):
        raise MegagrpoError(
            f"engine {engine}: its SGLang server failed to start: {store.get(failed_key).decode()}"
        )
    if not store.check([url_key]):
        return None
    url, where, key = store.multi_get([url_key, f"engine/{engine}/where", f"engine/{engine}/key"])
    return Endpoint(url.decode(), where.decode(), key.decode())


def request_stop(store: dist.Store) -> None:
    """Tell the engine ranks to stop. A store already gone needs no word (and must not hide the error
    that ends the run): the engine ranks stop when it goes (`rollout.engines.server`)."""
    with contextlib.suppress(dist.DistError):
        store.set("stop", "1")


def stop_requested(store: dist.Store) -> bool:
    return store.check(["stop"])


def failure_of(store: dist.Store, engine: int) -> str | None:
    """What engine `engine`'s rank reported when its server died, or None; `StoreGone` when the store
    does not answer (read while the owner's requests wait: `RemoteEngine`)."""
    key = f"engine/{engine}/failed"
    with answering(store):
        return store.get(key).decode() if store.check([key]) else None
