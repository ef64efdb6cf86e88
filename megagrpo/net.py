"""Network helpers of a launch's processes: the address this node advertises to the others, a free port.

Used wherever a process hosts something the others connect to: a disaggregated engine's HTTP server
(`rollout.server`), a weights group's store (`sync.broadcast`), a lone process's rendezvous
(`learner.mesh`, `convert`). Stdlib only, so every layer may import it.
"""

from __future__ import annotations

import os
import socket


def advertised_host() -> str:
    """An address of this node that the other nodes of the job reach: the name's address, or loopback
    on a one-node launch (MEGAGRPO_ENGINE_HOST overrides, for hosts with several interfaces)."""
    if os.environ.get("MEGAGRPO_ENGINE_HOST"):
        return os.environ["MEGAGRPO_ENGINE_HOST"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now ("" = every interface); another process may take it before it is
    bound again, so the caller binds it at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
