"""Bring your own agent: an OpenAI-compatible endpoint on the rollout's engine, one session per trajectory,
whose requests are recorded token for token (`rollout.agents.session`).

`rollout_sessions(engine, rows, agent, sampling, limits, ...)` is the endpoint's `rollout_episodes`: the same
`[n_rows][G]` episodes and counters, the same global indices and seeds, but each trajectory is driven by an
agent (`AgentRunner`) instead of an environment. On the engine's own loop it

  starts an HTTP server (aiohttp) on `options.host` (default 127.0.0.1: the rollout host only) at a free
  port, serving per session `http://<host>:<port>/s/<token>/v1`: `POST .../chat/completions` (tools,
  tool_choice, stream false or true as server-sent events, n=1) and `GET .../models`; the token
  (`secrets.token_urlsafe`, 192 bits) is the session's only credential, and a path without a live token
  is answered 404;
  runs the sessions' agents, at most `options.max_concurrent` at once (the others wait to start; a session's
  budget `options.timeout_s` starts with its agent): a Python callable on a daemon thread, or a command
  under `rollout.agents.launcher` (a subreaper that ends the agent's whole process tree with it), with its
  data row in a private file that is also its standard input, its output in files, and as its whole
  environment the trainer's variables named in `AgentRunner.env` plus the session's URL and its own key
  (the session's token), never the trainer's credentials;
  ends each session when its agent returns, fails or runs out of time: a later request of that session is
  answered 410 (ended) until the server stops at the end of the call; requests in flight finish on the
  engine first, so no request is left running when the call returns.

Requests. A body is decoded and checked whole (`ChatRequest.parse`: messages, content parts, tool calls,
tools, at most the engine's context length in messages) off the event loop, and the history is matched
and rendered off it too (`AgentSession.complete`); what cannot be read is answered 400 with OpenAI's
error JSON before anything is generated, and counted (`rollout/agent_bad_requests`). A reply that cannot
be sent (the client went away while the engine generated) is taken back: the turn is not recorded, so it
trains no row, and the client's retry is served as the same turn with the same seed
(`rollout/agent_undelivered`).

Faults (`options.on_failure`). An agent that raises or exits non-zero ("error"), runs past its budget
("timeout": a command's tree is ended by its launcher; a callable's thread cannot be, so it is left behind
as a daemon whose requests are refused), returns without one answered request ("no_request"), or cannot
be started at all ("start": no process, thread or file descriptor left, its program gone) ends its
session, counted (`rollout/agent_errors`, `agent_timeouts`, `agent_no_request`, `agent_start_failures`);
its row is then dropped (takes no loss; reward 0 in its group's baseline, as `trainer.episodes` drops an
interrupted row) or scored 0 and trained ("zero"). A session with no answered request is a one-token
placeholder row that always takes no loss. The other sessions and the step go on. A command's exit status
is read from its launcher's exit, never from the end of its output, so a child that kept its output open
neither delays the session nor turns it into a timeout.

Rewards. The agent's return: a number (or bool), a dict with "reward" (its other keys go to the episode's
info), or None to leave scoring to `rewards.functions` (`rollout.multi_turn.reward`) on the last reply's
content. A command's return is the last line of its standard output, parsed as JSON.

Cost. Host: per running session (at most `max_concurrent`), one thread (callable) or two processes (the
launcher, a few MB, and the command) with one pidfd and its HTTP connection in this process, and three small
files; the recorder holds each session's ids and routes as the driver does. Between this process and its
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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from aiohttp import web

from megagrpo.config.schema import AGENT_ENV_DEFAULT as DEFAULT_ENV
from megagrpo.errors import MegagrpoError
from megagrpo.rewards.registry import import_object
from megagrpo.rollout.agents import launcher as agent_launcher
from megagrpo.rollout.agents.session import (
    AgentSession,
    BadRequest,
    ChatRequest,
    Departure,
    Reply,
    RequestError,
    SessionContext,
)
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.episodes.multi_turn import (
    Episode,
    MultiTurnLimits,
    MultiTurnStats,
    ParserCache,
    TurnEngine,
    Version,
    new_trajectory,
)
from megagrpo.rollout.episodes.reasoning import ReasoningSplitter
from megagrpo.rollout.episodes.tool_calls import check_parser_name
from megagrpo.rollout.episodes.trajectory import Trajectory

log = logging.getLogger(__name__)
FIELD = "rollout.multi_turn.agent"
BASE_URL_ENV = "MEGAGRPO_BASE_URL"  # a command agent's environment: its session's base URL
ROW_FILE_ENV = "MEGAGRPO_ROW_FILE"  # and a file holding its data row as JSON (also its standard input)
_FAILURE_METRIC = {"error": "rollout/agent_errors", "timeout": "rollout/agent_timeouts",
                   "no_request": "rollout/agent_no_request",
                   "start": "rollout/agent_start_failures"}  # fmt: skip
_WARNED: set[str] = set()  # failure kinds already logged at warning level in this process
_MAX_BODY = 64 << 20  # bytes of one request body: long agent histories pass aiohttp's 1 MiB default
_OUTPUT_TAIL = (
    64 << 10
)  # bytes of a command's standard output and error read back (its return is the last line)
_LAUNCHER = Path(agent_launcher.__file__)
_LAUNCHER_GRACE_S = 15.0  # for the launcher to end the agent's tree after SIGTERM (it gives up after 10 s)


@dataclass(frozen=True)
class EndpointOptions:
    """The endpoint's settings (`rollout.multi_turn.agent`, config/schema.py documents each)."""

    timeout_s: float = 600.0
    on_failure: Literal["drop", "zero"] = "drop"
    on_departure: Departure = "branch"
    host: str = "127.0.0.1"
    max_branches: int = 4
    max_concurrent: int = 64


class AgentFailed(Exception):
    """An agent's session ended without its result: `kind` is "timeout", "error" or "start"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass(frozen=True)
class AgentCall:
    """What one session's agent is given: its base URL, its own key (the session's token), its data row,
    and, for a command, a private folder of the rollout's for its row and output files."""

    base_url: str
    key: str
    row: dict
    folder: Path | None = None


class AgentRunner:
    """The configured agent: `function` ('pkg.module:run', called as run(base_url, row, **options)) or `command` (run
    per session through `rollout.agents.launcher`, with `MEGAGRPO_BASE_URL`, `OPENAI_BASE_URL`, `OPENAI_API_KEY`
    (the session's own key), `MEGAGRPO_ROW_FILE` and the trainer's variables named in `env` as its whole
    environment). Resolved, and checked, when built: `MegagrpoError` naming the field."""

    def __init__(
        self,
        function: str | Callable[..., Any] | None = None,
        command: str | None = None,
        options: dict[str, Any] | None = None,
        env: Sequence[str] = DEFAULT_ENV,
    ) -> None:
        if (function is None) == (command is None):
            raise MegagrpoError(f"{FIELD}: set exactly one of function ('my_pkg.agent:run') and command")
        self.function: Callable[..., Any] | None = None
        self.options = dict(options or {})
        self.env = tuple(env)
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

    async def run(self, call: AgentCall, timeout_s: float) -> Any:
        """The agent's result for one session; `AgentFailed` when it fails, cannot start, or runs past
        `timeout_s`."""
        if self.function is not None:
            return await self._call(call, timeout_s)
        return await self._exec(call, timeout_s)

    async def _call(self, call: AgentCall, timeout_s: float) -> Any:
        # A daemon thread, not an executor's: a hung agent must not hold the process at its exit.
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def target() -> None:
            try:
                result, ok = self.function(call.base_url, call.row, **self.options), True
            except BaseException as e:  # the user's agent: whatever it raises ends its session, counted
                result, ok = AgentFailed("error", f"{type(e).__name__}: {e}"), False
            with contextlib.suppress(RuntimeError):  # the loop closed while a timed-out agent ran on
                loop.call_soon_threadsafe(settle, ok, result)

        try:
            threading.Thread(target=target, name="megagrpo-agent", daemon=True).start()
        except RuntimeError as e:  # "can't start new thread": the process's threads are exhausted
            raise AgentFailed("start", f"its thread could not start: {e}") from None
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            raise AgentFailed("timeout", f"the agent ran past its {timeout_s:g} s budget") from None

    def environment(self, call: AgentCall, row_file: Path) -> dict[str, str]:
        """A command agent's whole environment: the trainer's variables named in `env`, then the session's."""
        env = {k: os.environ[k] for k in self.env if k in os.environ}
        env.update({
            BASE_URL_ENV: call.base_url,
            "OPENAI_BASE_URL": call.base_url,
            "OPENAI_API_KEY": call.key,
            ROW_FILE_ENV: str(row_file),
        })  # fmt: skip
        return env

    async def _exec(self, call: AgentCall, timeout_s: float) -> Any:
        """The command under the launcher (`rollout.agents.launcher`): its row a file (also its stdin), its
        output files, and its exit status read by waiting on the launcher, never on a pipe's end, so a child
        that kept the agent's output open neither delays its return nor outlives it."""
        assert call.folder is not None
        row_file, out_file, err_file = (call.folder / n for n in ("row.json", "stdout", "stderr"))
        row_file.write_text(json.dumps(call.row, default=str))
        argv = [sys.executable, "-I", "-S", str(_LAUNCHER), str(os.getpid()), "--", *self.argv]
        try:
            # Popen, not asyncio's subprocess: it returns once the launcher runs, so the files close at once
            # (a burst of starts holds no descriptors but one pidfd each), and asyncio's watcher would
            # only wait, as `_exited` does
            with row_file.open("rb") as i, out_file.open("wb") as o, err_file.open("wb") as e:
                proc = subprocess.Popen(
                    argv, env=self.environment(call, row_file), stdin=i, stdout=o, stderr=e,
                    start_new_session=True,  # a deadline's SIGKILL of the launcher's group spares the trainer
                )  # fmt: skip
        except OSError as e:  # no file descriptor, process or memory left: this session's failure
            raise AgentFailed("start", f"{self.argv[0]} could not start: {e}") from None
        try:
            code = await asyncio.wait_for(_exited(proc), timeout_s)
        except TimeoutError:
            await _end_launcher(proc)
            raise AgentFailed("timeout", f"the agent ran past its {timeout_s:g} s budget") from None
        finally:
            if proc.returncode is None:  # cancelled: the rollout is unwinding; end the tree all the same
                await _end_launcher(proc)
        err = _tail(err_file).strip().splitlines()[-1:] or ["no stderr"]
        if code == agent_launcher.START_FAILED and err[0].startswith(agent_launcher.START_FAILED_MARK):
            raise AgentFailed("start", err[0])
        if code != 0:
            raise AgentFailed("error", f"{self.argv[0]} exited with {code}: {err[0]}")
        lines = [ln for ln in _tail(out_file).splitlines() if ln.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except ValueError:
            raise AgentFailed(
                "error", f"its last output line {lines[-1][:80]!r} is not JSON (a reward or an object)"
            ) from None


def _tail(path: Path) -> str:
    """The last `_OUTPUT_TAIL` bytes of a file, as text."""
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - _OUTPUT_TAIL))
        return f.read().decode(errors="replace")


async def _exited(proc: subprocess.Popen) -> int:
    """`proc`'s exit status, awaited on its pidfd (Linux 5.3; else polled), never on its output."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel, or no descriptor left): poll
        while proc.poll() is None:
            await asyncio.sleep(0.05)
        return proc.returncode
    try:
        ready = loop.create_future()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
    return proc.wait()  # it has exited: reaps it at once


async def _end_launcher(proc: subprocess.Popen) -> None:
    """Have the launcher end the agent's tree (SIGTERM), and kill it when it does not within its grace."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(_exited(proc), _LAUNCHER_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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

    def __init__(self, host: str, model: str, max_messages: int | None = None) -> None:
        self.host, self.model, self.max_messages = host, model, max_messages
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
            # a long history takes a while to decode and check: off the loop that serves every session
            req = await asyncio.to_thread(ChatRequest.from_json, await request.read(), self.max_messages)
            rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
            sent: list[web.StreamResponse] = []

            async def deliver(reply: Reply) -> None:
                if req.stream:
                    sent.append(await self._stream(request, rid, created, reply))
                else:
                    body = json.dumps(self._completion(rid, created, reply)).encode()
                    sent.append(
                        await _send(request, web.Response(body=body, content_type="application/json"))
                    )

            await session.complete(req, deliver)
            return sent[0]
        except BadRequest as e:
            if session.ended is None:
                session.bad_requests += 1
            return _error(e.status, e.message, e.code)
        except RequestError as e:
            return _error(e.status, e.message, e.code)
        except ConnectionError:  # the client went away before its reply was sent: the turn was taken back
            return web.Response(status=499)  # nobody reads it
        except Exception as e:  # a bug of ours: kept, and raised by the rollout once every session has ended
            if session.fatal is None:
                session.fatal = e
            session.end("the rollout failed")
            log.exception("agent session %d: the endpoint failed", session.index)
            return _error(500, f"the rollout failed: {type(e).__name__}: {e}", "server_error")

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
        await _send(request, resp)
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


async def _send(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Start (and for a whole response, finish) `resp`; `ConnectionError` when the client has gone, so that
    a reply it never got is not recorded (`AgentSession.complete`)."""
    if request.transport is None or request.transport.is_closing():
        raise ConnectionResetError("the client closed its connection before the reply")
    await resp.prepare(request)
    if isinstance(resp, web.Response):
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
    server: SessionServer,
    session: AgentSession,
    agent: AgentRunner,
    row: dict,
    opts: EndpointOptions,
    slots: asyncio.Semaphore,
    folder: Path,
) -> Episode:
    """One session from its agent's start to its row (module doc); the agent starts once one of the
    owner's `max_concurrent` slots is free, and its budget starts with it."""
    token = server.add(session)
    failure, detail, reward, info = None, "", None, {}
    async with slots:
        call = AgentCall(server.url(token), token, row, folder / str(session.index))
        try:
            if agent.function is None:
                call.folder.mkdir()
            reward, info = agent_reward(await agent.run(call, opts.timeout_s))
        except AgentFailed as e:
            failure, detail = e.kind, str(e)
        except OSError as e:  # its files could not be made: no disk or inode left, this session's failure
            failure, detail = "start", f"its files in {call.folder} could not be written: {e}"
        finally:
            if agent.function is None:
                shutil.rmtree(call.folder, ignore_errors=True)
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
        ep.undelivered = session.undelivered
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
        options.max_branches,
    )
    model = getattr(engine.tokenizer, "name_or_path", "") or "megagrpo"

    async def main() -> list[tuple[AgentSession, Episode]]:
        server = SessionServer(options.host, model, engine.context_len)
        slots = asyncio.Semaphore(options.max_concurrent)
        await server.start()
        try:
            with tempfile.TemporaryDirectory(prefix="megagrpo-agents-") as folder:  # 0700: rows stay private
                sessions = [
                    AgentSession(ctx, index=index_offset + i * group_size + g, prompt_index=i, sample_index=g)
                    for i in range(len(rows))
                    for g in range(group_size)
                ]
                eps = await asyncio.gather(*(
                    _run_session(server, s, agent, dict(rows[s.prompt_index]), options, slots, Path(folder))
                    for s in sessions
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
