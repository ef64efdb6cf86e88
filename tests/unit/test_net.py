"""Issue 36, item 8: the address a node advertises to the launch's other processes (`megagrpo.net`).

`gethostbyname(gethostname())` is 127.0.1.1 on many images; the address must be the one of the interface
that routes to the rendezvous host, and a loopback address on a launch of several nodes is refused."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from megagrpo import net
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.engines import rendezvous, server


@pytest.fixture
def debian_hosts(monkeypatch):
    """The host name resolves to 127.0.1.1 (Debian's /etc/hosts), and no address is set outright."""
    monkeypatch.delenv(net.HOST_ENV, raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "node07")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")


class RoutedSocket:
    """A datagram socket whose route to any peer leaves through the interface 10.1.2.3."""

    peers: list = []

    def __init__(self, family, kind):
        assert kind == socket.SOCK_DGRAM

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def connect(self, address):
        self.peers.append(address)

    def getsockname(self):
        return ("10.1.2.3", 40000)


def test_the_address_is_the_interface_that_routes_to_the_rendezvous_host(debian_hosts, monkeypatch):
    monkeypatch.setattr(socket, "socket", RoutedSocket)
    RoutedSocket.peers = []
    assert net.advertised_host("10.9.8.7", nodes=3) == "10.1.2.3"
    assert RoutedSocket.peers == [("10.9.8.7", 9)]  # connected (nothing is sent) to the rendezvous host


def test_the_route_to_a_local_peer_is_loopback_for_real():
    assert net.route_to("127.0.0.1") == "127.0.0.1"
    assert net.route_to("no-such-host.invalid") is None


def test_loopback_is_refused_on_several_nodes_only(debian_hosts):
    assert net.advertised_host("127.0.0.1", nodes=1) == "127.0.1.1"  # one node: every process is local
    with pytest.raises(MegagrpoError) as e:
        net.advertised_host("127.0.0.1", nodes=2)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("node07: ") and "127.0.1.1, a loopback address" in message
    assert "rendezvous host 127.0.0.1" in message and f"set {net.HOST_ENV}" in message


def test_an_address_set_outright_wins(debian_hosts, monkeypatch):
    monkeypatch.setenv(net.HOST_ENV, "192.168.7.7")
    assert net.advertised_host("127.0.0.1", nodes=4) == "192.168.7.7"


def test_the_engine_rank_refuses_loopback_and_its_owner_reads_why(debian_hosts, monkeypatch, tmp_path):
    """Before any SGLang import: the refusal is published in the launch's store, where the owner waiting
    for the engine's URL reads it at once instead of waiting for its deadline."""
    store = dist.PrefixStore(rendezvous.PREFIX, dist.HashStore())
    monkeypatch.setattr(rendezvous, "connect", lambda addr, port, timeout_s: store)
    monkeypatch.setattr(server.signal, "signal", lambda *a: None)  # the test process keeps its handlers
    code = server.serve(
        RolloutConfig(model_path=str(tmp_path)), engine=0, first=True, addr="127.0.0.1", port=1,
        timeout_s=5, rank=4, nodes=2,
    )  # fmt: skip
    assert code == 1
    with pytest.raises(MegagrpoError, match=rf"engine 0: .*node07: .*127\.0\.1\.1.*{net.HOST_ENV}"):
        rendezvous.wait_for(store, 0, timeout_s=60)
