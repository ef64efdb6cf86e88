"""A disaggregated engine as its owner sees it, without a server: where it is found (`rendezvous`), and how a
waiting request learns that the engine died (`RemoteEngine._request`)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.engines import rendezvous
from megagrpo.rollout.engines.remote import EngineUnreachable, RemoteEngine


def store() -> dist.Store:
    return dist.PrefixStore(rendezvous.PREFIX, dist.HashStore())


def test_an_engine_is_found_once_published_and_its_failure_is_reported():
    s = store()
    with pytest.raises(MegagrpoError, match="engine 1 did not come up within .*engine_timeout_s=0"):
        rendezvous.wait_for(s, 1, timeout_s=0.0)
    rendezvous.publish(s, 0, "http://h:1", "rank 2 on n2", "k3y")
    assert rendezvous.wait_for(s, 0, timeout_s=1.0) == ("http://h:1", "rank 2 on n2", "k3y")
    rendezvous.publish_failure(s, 1, "its server stopped: OSError: no port")
    with pytest.raises(
        MegagrpoError, match="engine 1: its SGLang server failed to start: its server stopped"
    ):
        rendezvous.wait_for(s, 1, timeout_s=60.0)
    assert rendezvous.failure_of(s, 0) is None and "no port" in rendezvous.failure_of(s, 1)
    assert not rendezvous.stop_requested(s)
    rendezvous.request_stop(s)
    assert rendezvous.stop_requested(s)


class Hanging(RemoteEngine):
    """A request that an engine whose scheduler died never answers."""

    async def _post(self, request):
        await asyncio.sleep(3600)


def test_a_waiting_request_fails_within_a_poll_when_the_engine_reports_its_death(tmp_path):
    said: list[str | None] = [None]
    e = Hanging(
        RolloutConfig(model_path=str(tmp_path)), index=0, url="http://h:1", where="rank 2 on n2",
        timeout_s=3600, reported_failure=lambda: said[0],
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    try:
        loop.call_later(
            0.3, lambda: said.__setitem__(0, "an SGLang process of the server died (rank 2 on n2)")
        )
        t0 = time.monotonic()
        with pytest.raises(
            EngineUnreachable, match=r"engine 0 \(http://h:1, rank 2 on n2\): an SGLang process"
        ):
            loop.run_until_complete(e._request(input_ids=[1, 2]))
        assert time.monotonic() - t0 < 5  # a poll or two, not the hour of the deadline
    finally:
        loop.close()


def test_a_refused_connection_names_the_engine_and_the_way_on(tmp_path):
    e = RemoteEngine(
        RolloutConfig(model_path=str(tmp_path)), index=3, url="http://127.0.0.1:9", where="rank 5 on n2",
        timeout_s=5,
    )  # fmt: skip
    with pytest.raises(EngineUnreachable, match=r"engine 3 .*rank 5 on n2.*/server_info failed.*resume"):
        e.call("/server_info", None, method="GET")


@pytest.fixture
def recording_server():
    """An HTTP server on loopback that answers every POST with `{}` and records each request's
    Authorization header, as SGLang's key check reads it."""
    import http.server
    import threading

    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_every_request_carries_the_launch_key(tmp_path, recording_server):
    """Issue 36, item 7: control requests (weights, checksums) and generation both send the key the
    engine's rank published, in the header SGLang's api_key/admin_api_key check."""
    url, seen = recording_server
    e = RemoteEngine(
        RolloutConfig(model_path=str(tmp_path)), index=0, url=url, where="rank 2 on n2", key="k3y",
        timeout_s=30,
    )  # fmt: skip
    assert e.call("/update_weights_from_distributed", {"names": []}) == {}
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(e._post({"input_ids": [1, 2]})) == {}
        loop.run_until_complete(e._session.close())
    finally:
        loop.close()
    assert seen == [("/update_weights_from_distributed", "Bearer k3y"), ("/generate", "Bearer k3y")]


class DeadStore:
    """The launch's store once the process that hosts it has exited: every call fails as torch's
    TCPStore client does then."""

    underlying_store = SimpleNamespace(host="10.0.0.1", port=29500)

    def __init__(self) -> None:
        self.calls = 0

    def _gone(self, *args):
        self.calls += 1
        raise dist.DistNetworkError("Broken pipe")

    check = get = set = multi_get = _gone


STORE_GONE = (
    r"the launch's store at 10\.0\.0\.1:29500 .*does not answer \(DistNetworkError: Broken pipe\).*rank 0"
)


def test_a_dead_store_is_one_clear_error_for_every_waiting_request(tmp_path):
    """Issue 36, item 9: a multi-turn round's requests all wait on the engine while the store is read for
    its failure; when the store's host is gone, each request ends with the same error naming the store
    and what it means, read once, not a raw DistNetworkError per request."""
    dead = DeadStore()
    e = Hanging(
        RolloutConfig(model_path=str(tmp_path)), index=0, url="http://h:1", where="rank 2 on n2",
        timeout_s=3600, reported_failure=lambda: rendezvous.failure_of(dead, 0),
    )  # fmt: skip

    async def round_of(n):
        return await asyncio.gather(*(e._request(input_ids=[i]) for i in range(n)), return_exceptions=True)

    loop = asyncio.new_event_loop()
    try:
        errors = loop.run_until_complete(asyncio.wait_for(round_of(16), 30))
    finally:
        loop.close()
    assert all(isinstance(x, rendezvous.StoreGone) for x in errors), errors
    assert len({str(x) for x in errors}) == 1 and dead.calls == 1
    with pytest.raises(rendezvous.StoreGone, match=STORE_GONE):
        raise errors[0]


def test_a_dead_store_while_waiting_for_an_engine_and_at_the_stop():
    with pytest.raises(rendezvous.StoreGone, match=STORE_GONE):
        rendezvous.wait_for(DeadStore(), 0, timeout_s=60)
    rendezvous.request_stop(DeadStore())  # nobody to tell: the engine ranks stop when the store goes
