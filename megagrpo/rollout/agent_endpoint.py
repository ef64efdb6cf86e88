"""Bring your own agent: an OpenAI-compatible endpoint on the rollout's engine, one session per trajectory,
whose requests are recorded token for token (`rollout.agent_session`).

`rollout_sessions(engine, rows, agent, sampling, limits, ...)` is the endpoint's `rollout_episodes`: the same
`[n_rows][G]` episodes and counters, the same global indices and seeds, but each trajectory is driven by an
agent (`AgentRunner`) instead of an environment. On the engine's own loop it

  starts an HTTP server (aiohttp) on `options.host` (default 127.0.0.1: the rollout host only) at a free
  port, serving per session `http://<host>:<port>/s/<token>/v1`: `POST .../chat/completions` (tools,
  tool_choice, stream false or true as server-sent events, n=1) and `GET .../models`; the token
  (`secrets.token_urlsafe`, 192 bits) is the session's only credential, and a path without a live token
  is answered 404;
  runs every session's agent at once (a Python callable on a daemon thread, or a command as a child
  process in its own process group), each with its wall budget `options.timeout_s`;
  ends each session when its agent returns, fails or runs out of time: a later request of that session is
  answered 410 (ended) until the server stops at the end of the call; requests in flight finish on the
  engine first, so no request is left running when the call returns.

Faults (`options.on_failure`). An agent that raises or exits non-zero ("error"), runs past its budget
("timeout": a command's process group is killed; a callable's thread cannot be, so it is left behind as a
daemon whose requests are refused), or returns without one answered request ("no_request") ends its
session, counted (`rollout/agent_errors`, `agent_timeouts`, `agent_no_request`); its row is then dropped
(takes no loss; reward 0 in its group's baseline, as `trainer.episodes` drops an interrupted row) or scored 0
and trained ("zero"). A session with no answered request is a one-token placeholder row that always takes no
loss. The other sessions and the step go on.

Rewards. The agent's return: a number (or bool), a dict with "reward" (its other keys go to the episode's
info), or None to leave scoring to `rewards.functions` (`rollout.multi_turn.reward`) on the last reply's
content. A command's return is the last line of its standard output, parsed as JSON.

Cost. Host: one thread (callable) or one process (command) per session of this engine owner's share, all at
once; the recorder holds each session's ids and routes as the driver does. Between this process and its
engine: what `rollout_episodes` sends and receives (new route rows only), plus each request's JSON over
loopback. Nothing crosses ranks here; `rollout.groups` splits rows over engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from aiohttp import web

from megagrpo.errors import MegagrpoError
from megagrpo.rewards.registry import import_object
from megagrpo.rollout.agent_session import (
    AgentSession,
    ChatRequest,
    Departure,
    Reply,
    RequestError,
    SessionContext,
)
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.multi_turn import (
    Episode,
    MultiTurnLimits,
    MultiTurnStats,
    ParserCache,
    TurnEngine,
    Version,
    new_trajectory,
)
from megagrpo.rollout.reasoning import ReasoningSplitter
from megagrpo.rollout.tool_calls import check_parser_name
from megagrpo.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)
FIELD = "rollout.multi_turn.agent"
BASE_URL_ENV = "MEGAGRPO_BASE_URL"  # a command agent's environment: its session's base URL
ROW_ENV = "MEGAGRPO_ROW"  # and its data row, as JSON
_FAILURE_METRIC = {"error": "rollout/agent_errors", "timeout": "rollout/agent_timeouts",
                   "no_request": "rollout/agent_no_request"}  # fmt: skip
_WARNED: set[str] = set()  # failure kinds already logged at warning level in this process
_MAX_BODY = 64 << 20  # bytes of one request body: long agent histories pass aiohttp's 1 MiB default


@dataclass(frozen=True)
class EndpointOptions:
    """The endpoint's settings (`rollout.multi_turn.agent`, config/schema.py documents each)."""

    timeout_s: float = 600.0
    on_failure: Literal["drop", "zero"] = "drop"
    on_departure: Departure = "branch"
    host: str = "127.0.0.1"


class AgentFailed(Exception):
    """An agent's session ended without its result: `kind` is "timeout" or "error"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class AgentRunner:
    """The configured agent: `function` ('pkg.module:run', called as run(base_url, row, **options)) or `command` (run
    per session with `MEGAGRPO_BASE_URL`, `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `MEGAGRPO_ROW` in its
    environment). Resolved, and checked, when built: `MegagrpoError` naming the field."""

    def __init__(
        self,
        function: str | Callable[..., Any] | None = None,
        command: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        if (function is None) == (command is None):
            raise MegagrpoError(f"{FIELD}: set exactly one of function ('my_pkg.agent:run') and command")
        self.function: Callable[..., Any] | None = None
        self.options = dict(options or {})
        self.argv: list[str] = []
        if self.options and function is None:
            raise MegagrpoError(f"{FIELD}.options: a command takes no options; pass them on its command line")
        if function is not None:
            try:
                fn = import_object(function) if isinstance(function, str) else function
            except (ImportError, AttributeError) as e:
                raise MegagrpoError(
                    f"{FIELD}.function: cannot import {function!r}: {e}; check the module is on PYTHONPATH"
                ) from None
            try:
                inspect.signature(fn).bind("http://host/v1", {}, **self.options)
            except (TypeError, ValueError) as e:
                raise MegagrpoError(
                    f"{FIELD}.function: {function!r} does not take (base_url, row"
                    f"{', **' + repr(self.options) if self.options else ''}): {e}; write it as "
                    "def run(base_url: str, row: dict, **options) -> float | dict | None"
                ) from None
            self.function = fn
        else:
            try:
                self.argv = shlex.split(command or "")
            except ValueError as e:
                raise MegagrpoError(f"{FIELD}.command: {command!r} does not split into words: {e}") from None
            if not self.argv or shutil.which(self.argv[0]) is None:
                raise MegagrpoError(
                    f"{FIELD}.command: {command!r}: {self.argv[0] if self.argv else 'nothing'} is not an "
                    "executable on PATH; give a command such as 'python -m my_pkg.agent'"
                )

    async def run(self, base_url: str, row: dict, timeout_s: float) -> Any:
        """The agent's result for one session; `AgentFailed` when it fails or runs past `timeout_s`."""
        if self.function is not None:
            return await self._call(base_url, row, timeout_s)
        return await self._exec(base_url, row, timeout_s)

    async def _call(self, base_url: str, row: dict, timeout_s: float) -> Any:
        # A daemon thread, not an executor's: a hung agent must not hold the process at its exit.
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def target() -> None:
            try:
                result, ok = self.function(base_url, row, **self.options), True
            except BaseException as e:  # the user's agent: whatever it raises ends its session, counted
                result, ok = AgentFailed("error", f"{type(e).__name__}: {e}"), False
            with contextlib.suppress(RuntimeError):  # the loop closed while a timed-out agent ran on
                loop.call_soon_threadsafe(settle, ok, result)

        threading.Thread(target=target, name="megagrpo-agent", daemon=True).start()
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            raise AgentFailed("timeout", f"the agent ran past its {timeout_s:g} s budget") from None

    async def _exec(self, base_url: str, row: dict, timeout_s: float) -> Any:
        env = dict(os.environ)
        env.update({
            BASE_URL_ENV: base_url,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": env.get("OPENAI_API_KEY", "megagrpo"),
            ROW_ENV: json.dumps(row, default=str),
        })  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, killed whole at its deadline
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise AgentFailed("timeout", f"the agent ran past its {timeout_s:g} s budget") from None
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no stderr"]
            raise AgentFailed("error", f"{self.argv[0]} exited with {proc.returncode}: {tail[0]}")
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            raise AgentFailed(
                "error", f"its last output line {lines[-1][:80]!r} is not JSON (a reward or an object)"
            ) from None


def agent_reward(result: Any) -> tuple[float | None, dict[str, Any]]:
    """(reward, info) from an agent's return (module doc); `AgentFailed` for anything else."""
    if result is None:
        return None, {}
    if isinstance(result, bool | int | float):
        return float(result), {}
    if isinstance(result, dict):
        reward = result.get("reward")
        if reward is not None and not isinstance(reward, bool | int | float):
            raise AgentFailed("error", f"its 'reward' is a {type(reward).__name__}, not a number")
        return (None if reward is None else float(reward)), {k: v for k, v in result.items() if k != "reward"}
    raise AgentFailed("error", f"it returned a {type(result).__name__}; return a number, a dict or None")


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


def _chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> bytes:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return f"data: {json.dumps(body)}\n\n".encode()


class SessionServer:
    """The HTTP side (module doc): routes a request to its session by the token in its path."""

    def __init__(self, host: str, model: str) -> None:
        self.host, self.model = host, model
        self.sessions: dict[str, AgentSession] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None

    def add(self, session: AgentSession) -> str:
        """A new token for `session`; its base URL is `url(token)`."""
        token = secrets.token_urlsafe(24)
        self.sessions[token] = session
        return token

    def url(self, token: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/s/{token}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_post("/s/{token}/v1/chat/completions", self._chat)
        app.router.add_get("/s/{token}/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, self.host, 0)
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise MegagrpoError(
                f"{FIELD}.host={self.host!r}: the agent endpoint cannot listen there ({e}); use an address of "
                "this host (127.0.0.1 unless the agents run elsewhere)"
            ) from None
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _session(self, request: web.Request) -> AgentSession:
        session = self.sessions.get(request.match_info["token"])
        if session is None:
            raise RequestError(
                404, "no session at this URL; use the base URL your session was given", "no_session"
            )
        return session

    async def _unknown(self, request: web.Request) -> web.Response:
        return _error(404, f"no such endpoint: {request.method} {request.path}", "not_found")

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except RequestError as e:
            return _error(e.status, e.message, e.code)
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "megagrpo"}
        return web.json_response({"object": "list", "data": [card]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
        except RequestError as e:
            return _error(e.status, e.message, e.code)
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(400, f"the request body is not JSON: {e}", "invalid_json") from None
            req = ChatRequest.parse(body)
        except RequestError as e:
            if session.ended is None:
                session.bad_requests += 1
            return _error(e.status, e.message, e.code)
        try:
            reply = await session.complete(req)
        except RequestError as e:
            return _error(e.status, e.message, e.code)
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if not req.stream:
            return web.json_response(self._completion(rid, created, reply))
        return await self._stream(request, rid, created, reply)

    def _completion(self, rid: str, created: int, reply: Reply) -> dict[str, Any]:
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}  # fmt: skip
        choice = {
            "index": 0,
            "message": reply.message,
            "finish_reason": reply.finish_reason,
            "logprobs": None,
        }
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model,
                "choices": [choice], "usage": usage}  # fmt: skip

    async def _stream(self, request: web.Request, rid: str, created: int, reply: Reply) -> web.StreamResponse:
        """The reply as server-sent events: the role, the content, each tool call, the finish reason."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        m = reply.message
        await resp.write(_chunk(rid, created, self.model, {"role": "assistant", "content": ""}, None))
        if m.get("reasoning_content"):
            await resp.write(
                _chunk(rid, created, self.model, {"reasoning_content": m["reasoning_content"]}, None)
            )
        if m.get("content"):
            await resp.write(_chunk(rid, created, self.model, {"content": m["content"]}, None))
        for i, call in enumerate(m.get("tool_calls") or []):
            await resp.write(_chunk(rid, created, self.model, {"tool_calls": [{"index": i, **call}]}, None))
        await resp.write(_chunk(rid, created, self.model, {}, reply.finish_reason))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _placeholder(engine: TurnEngine, prompt_index: int, sample_index: int, version: int) -> Trajectory:
    """The row of a session with no answered request: one token, routes that name real experts; it is
    always dropped (no loss), so only its shape matters."""
    tok = engine.tokenizer
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    t = new_trajectory(engine, [pad], prompt_index, sample_index)
    L, K, experts = t.num_layers, t.topk, t.num_experts
    rows = None if experts is None else (torch.arange(K) % experts).expand(1, L, K).to(torch.int32)
    t.add_turn((), [pad], [0.0], version, rows)
    return t


async def _run_session(
    server: SessionServer, session: AgentSession, agent: AgentRunner, row: dict, opts: EndpointOptions
) -> Episode:
    """One session from its agent's start to its row (module doc)."""
    token = server.add(session)
    failure, detail, reward, info = None, "", None, {}
    try:
        reward, info = agent_reward(await agent.run(server.url(token), row, opts.timeout_s))
    except AgentFailed as e:
        failure, detail = e.kind, str(e)
    if failure == "error" and session.truncation is not None:
        # the endpoint truncated the trajectory and refused its next request; an agent that stops on that
        # error has not failed: the row is a truncated one, as the driver's, unscored
        failure = None
    session.end(failure or "the agent returned")
    async with session.lock:  # a request in flight finishes on the engine before the row is read
        pass
    ep = session.episode()
    if ep is None:
        failure, detail = failure or "no_request", detail or "the agent returned without a request"
        ctx = session.ctx
        version = ctx.version() if callable(ctx.version) else ctx.version
        ep = Episode(_placeholder(ctx.engine, session.prompt_index, session.sample_index, version))
        ep.bad_requests, ep.branch_refusals = session.bad_requests, session.branch_refusals
        ep.dropped = True
    ep.info = info
    if failure is not None:
        # the first failure of each kind in a process says why; the rest are counted (rollout/agent_*)
        level = logging.DEBUG if failure in _WARNED else logging.WARNING
        _WARNED.add(failure)
        log.log(level, "agent session %d: %s (%s); its row is %s; such sessions are counted in %s",
                session.index, failure, detail, "dropped" if opts.on_failure == "drop" or ep.dropped else
                "scored 0", _FAILURE_METRIC[failure])  # fmt: skip
        ep.agent_failure, ep.reward = failure, 0.0
        ep.final_text = ""  # so that rewards.functions score it 0 too (`reward: functions`)
        ep.dropped = ep.dropped or opts.on_failure == "drop"
    else:
        ep.done, ep.reward = True, reward
    return ep


def rollout_sessions(
    engine: TurnEngine,
    rows: Sequence[dict[str, Any]],
    agent: AgentRunner,
    sampling: SamplingConfig,
    limits: MultiTurnLimits,
    *,
    options: EndpointOptions = EndpointOptions(),
    tool_parser: str = "qwen25",
    reasoning_parser: str | None = None,
    group_size: int = 1,
    index_offset: int = 0,
    version: Version = 0,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[list[Episode]], MultiTurnStats]:
    """G = `group_size` agent sessions per data row, as `[n_rows][G]` episodes, all at once on the engine's
    loop, and their counters (module doc; arguments as `rollout_episodes`'). Raises the first engine error
    (or recording bug) once every session has ended."""
    if not rows:
        raise MegagrpoError("rollout_sessions() got no data rows; pass at least one")
    if group_size < 1:
        raise MegagrpoError(f"group_size={group_size} must be >= 1")
    check_parser_name(tool_parser)
    ctx = SessionContext(
        engine,
        sampling,
        limits,
        ParserCache(tool_parser),
        ReasoningSplitter(reasoning_parser, template_kwargs) if reasoning_parser else None,
        dict(template_kwargs or {}),
        version,
        options.on_departure,
    )
    model = getattr(engine.tokenizer, "name_or_path", "") or "megagrpo"

    async def main() -> list[tuple[AgentSession, Episode]]:
        server = SessionServer(options.host, model)
        await server.start()
        try:
            sessions = [
                AgentSession(ctx, index=index_offset + i * group_size + g, prompt_index=i, sample_index=g)
                for i in range(len(rows))
                for g in range(group_size)
            ]
            eps = await asyncio.gather(*(
                _run_session(server, s, agent, dict(rows[s.prompt_index]), options) for s in sessions
            ))  # fmt: skip
        finally:
            await server.stop()
        return list(zip(sessions, eps, strict=True))

    done = engine.loop.run_until_complete(main())
    for session, _ in done:
        if session.fatal is not None:
            raise session.fatal
    flat = [e for _, e in done]
    stats = MultiTurnStats()
    for e in flat:
        stats.add(e)
    return [flat[i * group_size : (i + 1) * group_size] for i in range(len(rows))], stats
