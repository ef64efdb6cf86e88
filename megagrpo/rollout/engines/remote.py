"""A disaggregated engine seen from the learner rank that owns it: the engine's requests over HTTP.

The engine runs on ranks of its own (`rollout.engines.server`); its owner sends the same requests a colocated
engine gets (`rollout.engines.engine.EngineRequests`: `generate`, `generate_turn`, `score` build them, one code
path for seeds, checks and the decoding of logprobs and routes) as JSON to SGLang's `/generate`, on an
aiohttp session bound to this object's own event loop, so a multi-turn rollout's coroutines share one
connection pool.

Deadlines. Every call waits at most `rollout.placement.engine_timeout_s`; a refused or dropped connection
(the engine's process is gone) fails at once. Either way the error names the engine, its rank and host,
and what was asked, and the owner's failure stops every rank (`dist.agree`, or the launcher).

Access. Every request carries the launch's key for this engine (`rendezvous.Endpoint.key`) as
`Authorization: Bearer <key>`, the header SGLang's `api_key`/`admin_api_key` check (`rollout.engines.server`).

Memory. The engine owns its devices: it never releases any (no `release`/`resume`; the session's memory
phases skip an engine with devices of its own), and the learner is never offloaded.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import RolloutConfig
from megagrpo.rollout.engines.engine import EngineRequests

FAILURE_POLL_S = 1.0


class EngineUnreachable(MegagrpoError):
    """A disaggregated engine did not answer: its process died, or it passed the deadline."""


class RemoteEngine(EngineRequests):
    """Engine `index` of a disaggregated launch, reached at `url` (published by its rank)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        index: int,
        url: str,
        where: str,
        timeout_s: float,
        key: str | None = None,
        reported_failure: Callable[[], str | None] | None = None,
    ) -> None:
        """`key`: the bearer key its server requires (published with its URL). `reported_failure`: what
        the engine's rank said when its server's processes died, or None (read while a request waits: a
        dead scheduler leaves the HTTP server up and the request unanswered)."""
        super().__init__(cfg)  # validated by the engine rank (`RolloutEngine`) before its server started
        self.index, self.url, self.where, self.timeout_s = index, url.rstrip("/"), where, timeout_s
        self.reported_failure = reported_failure
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}
        self._failure_read_at, self._failure_seen = float("-inf"), None
        self._unreadable: MegagrpoError | None = None  # why `reported_failure` cannot be read (the store)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: Any = None
        self._routes = False

    @property
    def name(self) -> str:
        return f"engine {self.index} ({self.url}, {self.where})"

    # ---------------------------------------------------------------- life cycle

    def start(self) -> RemoteEngine:
        if self._loop is not None:
            return self
        from transformers import AutoTokenizer

        info = self.get("/server_info")
        models = self.get("/v1/models")
        self._read_dims(self._hf_config().get)
        self._routes = bool(info.get("enable_return_routed_experts")) and self.num_experts is not None
        self.context_len = int(models["data"][0]["max_model_len"])
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.cfg.model_path, trust_remote_code=self.cfg.trust_remote_code
        )
        self._loop = asyncio.new_event_loop()
        return self

    def shutdown(self) -> None:
        """Close this side's connections; the engine rank stops when the launch's store says so."""
        loop, self._loop = self._loop, None
        if loop is not None:
            if self._session is not None:
                loop.run_until_complete(self._session.close())
                self._session = None
            loop.close()

    # ---------------------------------------------------------------- transport

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise MegagrpoError(f"{self.name} is not connected; call start() first")
        return self._loop

    @property
    def routes_num_experts(self) -> int | None:
        return self.num_experts if self._routes else None

    async def _request(self, **request: Any) -> Any:
        """The request, or EngineUnreachable as soon as the engine's rank reports its server dead."""
        task = asyncio.ensure_future(self._post(request))
        while True:
            done, _ = await asyncio.wait({task}, timeout=FAILURE_POLL_S)
            if done:
                return task.result()
            try:
                failure = self._failure()
            except MegagrpoError:
                task.cancel()
                raise
            if failure:
                task.cancel()
                raise EngineUnreachable(
                    f"{self.name}: {failure}. The run stops; resume from the last checkpoint"
                )

    def _failure(self) -> str | None:
        """`reported_failure`, read at most once per poll interval whatever the number of requests waiting
        (a multi-turn round has one per trajectory). When it cannot be read (the launch's store is gone:
        `rendezvous.StoreGone`), that one error, read once, ends every waiting request."""
        now = time.monotonic()
        if (
            self.reported_failure is not None
            and self._unreadable is None
            and now - self._failure_read_at >= FAILURE_POLL_S
        ):
            self._failure_read_at = now
            try:
                self._failure_seen = self.reported_failure()
            except MegagrpoError as e:
                self._unreadable = e
        if self._unreadable is not None:
            raise self._unreadable
        return self._failure_seen

    async def _post(self, request: dict[str, Any]) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                # A connection per request: uvicorn drops an idle keep-alive connection after 5 s, and a
                # request sent on it as it closes fails as if the engine had died (seen between steps).
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
            )
        what = "a generate request"
        try:
            async with self._session.post(f"{self.url}/generate", json=request, headers=self._auth) as r:
                body = await r.text()
                if r.status != 200:
                    raise EngineUnreachable(self._refused(what, r.status, body[:500]))
                return json.loads(body)
        except TimeoutError:
            raise EngineUnreachable(
                f"{self.name}: {what} passed rollout.placement.engine_timeout_s={self.timeout_s:.0f} s"
            ) from None
        except aiohttp.ClientError as e:
            raise EngineUnreachable(
                f"{self.name}: {what} failed ({type(e).__name__}: {e}); the engine's process has died or "
                "is unreachable. Its rank's log says why; resume from the last checkpoint"
            ) from e

    def _refused(self, what: str, status: int, body: str) -> str:
        why = ""
        if status in (401, 403):  # SGLang's answer to a missing or wrong key
            why = (
                "; the server refused this launch's key for it: the process at that address is not this "
                "launch's engine (check the engine rank's log for the URL it published)"
            )
        return f"{self.name}: {what} failed with HTTP {status}: {body}{why}"

    def get(self, path: str) -> Any:
        return self.call(path, None, method="GET")

    def call(self, path: str, body: Any, *, method: str = "POST", timeout_s: float | None = None) -> Any:
        """One blocking control request (server info, weight updates, checksums): JSON in, JSON out. Safe
        from any thread: it does not use the event loop that generation runs on."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **self._auth},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:1000]
            raise EngineUnreachable(self._refused(path, e.code, detail)) from None
        except (urllib.error.URLError, OSError) as e:
            raise EngineUnreachable(
                f"{self.name}: {path} failed ({e}); the engine's process has died, is unreachable or passed "
                f"rollout.placement.engine_timeout_s={self.timeout_s:.0f} s. Its rank's log says why; resume "
                "from the last checkpoint"
            ) from None
