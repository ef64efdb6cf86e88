"""Network helpers of a launch's processes: the address this node advertises to the others, a free port.

Used wherever a process hosts something the others connect to: a disaggregated engine's HTTP server
(`rollout.engines.server`), a weights group's store (`sync.broadcast`), a lone process's rendezvous
(`learner.mesh`, `convert`). Stdlib and `errors` only, so every layer may import it.

Which address. The host name's address (`gethostbyname(gethostname())`) is 127.0.1.1 on many images
(Debian's /etc/hosts), so on a launch of several nodes the others would be told to connect to their own
loopback: an owner then reports a dead engine, or a weights group waits for its deadline. The address
advertised is instead the one of the interface that routes to the peer (the rendezvous host, or the engine
a weights group feeds): a datagram socket connected there, which sends nothing, has it as its own address.
`MEGAGRPO_ENGINE_HOST` sets it outright (hosts with several networks), and a loopback address on a launch
of several nodes is refused, naming the fix.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from megagrpo.errors import MegagrpoError

HOST_ENV = "MEGAGRPO_ENGINE_HOST"


def route_to(peer: str) -> str | None:
    """This node's address on the interface that routes to `peer` (a host name or an address), or None
    when `peer` does not resolve or no route leads there. Nothing is sent: connecting a datagram socket
    only chooses the route and the source address."""
    try:
        infos = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name
        return False


def advertised_host(peer: str, *, nodes: int = 1) -> str:
    """The address the launch's other processes reach this node at (module doc): `MEGAGRPO_ENGINE_HOST`
    when set, else the address of the interface that routes to `peer`, else the host name's address.
    `nodes`: how many nodes the launch spans; on more than one, a loopback address is a MegagrpoError
    naming this host, `peer` and the variable that fixes it."""
    explicit = os.environ.get(HOST_ENV)
    if explicit:
        return explicit
    addr = route_to(peer)
    if addr is None or is_loopback(addr):
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = addr or "127.0.0.1"
    if nodes > 1 and is_loopback(addr):
        raise MegagrpoError(
            f"{socket.gethostname()}: the address this node would advertise to the launch's other nodes is "
            f"{addr}, a loopback address (the route to the rendezvous host {peer} and the host name's address "
            f"are both local); set {HOST_ENV} to this node's address on the network the {nodes} nodes share"
        )
    return addr


def free_port(host: str = "") -> int:
    """A TCP port free on `host` now ("" = every interface); another process may take it before it is
    bound again, so the caller binds it at once."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
