"""Where each disaggregated engine listens, told through the launch's own key-value store.

Disaggregated placement (`rollout.placement.kind`) splits one launch into learner ranks and engine ranks.
They meet in the TCP store the launch already has at MASTER_ADDR:MASTER_PORT (torchrun's agent store, or
the one learner rank 0 hosts for its process group under srun/mpirun), so no extra port or file is
needed: an engine rank publishes its server's URL when the server is ready, the learner rank that owns the
engine waits for it (with the engine deadline), and at the end the owner asks its engine to stop.

Keys (under the prefix `megagrpo/`): `engine/<e>/url`, `engine/<e>/where` (rank and host, for errors),
`engine/<e>/key` (the bearer key its server requires, made by the engine rank for this launch),
`engine/<e>/failed` (the engine rank's last words when its server could not start), `stop`.

The key keeps clients outside the launch from driving the engine (generating, or writing its weights);
the store itself is torch's TCPStore, without authentication, so a process that speaks its protocol on
MASTER_ADDR:MASTER_PORT can read it: the launch's network is trusted that far, as for the process groups.
"""

from __future__ import annotations

import datetime
import time
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


def publish(store: dist.Store, engine: int, url: str, where: str, key: str) -> None:
    store.set(f"engine/{engine}/where", where)
    store.set(f"engine/{engine}/key", key)
    store.set(f"engine/{engine}/url", url)  # last: the owner waits for it


def publish_failure(store: dist.Store, engine: int, message: str) -> None:
    store.set(f"engine/{engine}/failed", message[-4000:])


def wait_for(store: dist.Store, engine: int, timeout_s: float) -> Endpoint:
    """Where engine `engine` listens, once its server is ready; MegagrpoError past the deadline or when
    the engine rank reported that its server failed to start."""
    deadline = time.monotonic() + timeout_s
    url_key, failed_key = f"engine/{engine}/url", f"engine/{engine}/failed"
    while True:
        if store.check([failed_key]):
            raise MegagrpoError(
                f"engine {engine}: its SGLang server failed to start: {store.get(failed_key).decode()}"
            )
        if store.check([url_key]):
            url, where, key = store.multi_get([url_key, f"engine/{engine}/where", f"engine/{engine}/key"])
            return Endpoint(url.decode(), where.decode(), key.decode())
        if time.monotonic() > deadline:
            raise MegagrpoError(
                f"engine {engine} did not come up within rollout.placement.engine_timeout_s={timeout_s:.0f} s; "
                "see its rank's log (the last ranks of the launch), or raise the deadline"
            )
        time.sleep(0.2)


def request_stop(store: dist.Store) -> None:
    store.set("stop", "1")


def stop_requested(store: dist.Store) -> bool:
    return store.check(["stop"])


def failure_of(store: dist.Store, engine: int) -> str | None:
    """What engine `engine`'s rank reported when its server died, or None."""
    key = f"engine/{engine}/failed"
    return store.get(key).decode() if store.check([key]) else None
