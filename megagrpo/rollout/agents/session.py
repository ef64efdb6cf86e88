"""One agent session of the OpenAI-compatible endpoint (`rollout.agents.endpoint`): the chat requests an
external agent sends for one trajectory, recorded as the built-in driver records its turns, token for token.

Per request (`AgentSession.complete`), under the session's lock (requests of one session take turns):

  match the request's messages against each branch's held history (`Branch.held`: the messages of its
  earlier requests, and each reply as the client got it, compared by `message_key`):
    the held history is a prefix of the request and the rest holds no assistant message, with the same
    `tools` -> that branch; its held prefix is taken as the ids recorded, never rendered again, and only
    the rest goes through the chat template as one delta (`ChatDeltas.append`: glue, the new messages, the
    generation prompt), with the driver's append-only check (`TemplateBreak` ends the session, counted)
  -> engine.generate_turn(ids so far + the delta, routed_experts_start_len = the rows held): new route rows
     only, the turn's seed `turn_seed(sampling.seed, index, k)` for the session's k-th request, as the
     driver seeds its k-th turn, so a conversation gives the driver's trajectory exactly
  -> Trajectory.add_engine_output; the reply is the engine's ids as text (`ChatDeltas.close_model_turn`),
     reasoning split off (`ReasoningSplitter`), tool calls parsed by SGLang's parser for the family with the
     request's tools (`ToolCallParser`); a malformed call is not a `tool_calls` entry: the reply's content is
     then the turn's text as written, so the agent sees it, and the call is counted.

Departure. A request that extends no branch (the agent dropped, edited or summarised earlier messages,
changed its tools, or asks again after an assistant message) departs from the recording. With
`on_departure="branch"` it opens a new branch: a trajectory of its own whose prompt is the request's whole
history rendered by the template (no loss: the earlier model turns in it are the agent's account of them,
not ids the engine generated in that context), whose turns are then recorded as above; counted in
`branches`. With "refuse" the request is answered 409 naming the first message that differs, counted in
`branch_refusals`. Every branch that holds a model turn becomes a learner row: the branch of the last
answered request is the session's row (`Episode.trajectory`: the one that holds the final answer the reward
is about), the others are `Episode.earlier`, in the order opened. The session has one reward; the trainer
gives each of its rows the session's advantage (`trainer.episodes.episode_rows`, docs/agentic.md). Every
row trains only on ids the engine generated, in the context the engine saw.

Limits, as the driver's (`rollout.multi_turn` module doc), counted over the session, all its branches
together, so that branching never buys an agent more: the session's tokens after its branches' prompts stay
within `max_tokens` (a turn asks for at most what is left; a request that leaves none ends the session,
truncated), its model turns within `max_turns` (a request for one more ends the session, truncated), and
its branches within `max_branches` (a departure that would open one more ends the session, truncated
"max_branches"). So a session trains at most min(max_branches, max_turns) rows, and at most `max_tokens`
tokens after prompts over them; `megagrpo plan` counts that many rows per session. The request's
`max_tokens` / `max_completion_tokens` lower a turn's limit; its `temperature`, `top_p`, `stop` and `seed`
are ignored: the trainer's sampling parameters are the ones the learner's importance weights assume.

Failures. What the agent sends is answered with an HTTP error and counted, never raised (`RequestError`).
An engine error or a bug in the recording is kept (`fatal`) and raised by the rollout once every session
has ended, as the driver raises an engine error after the other trajectories finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megagrpo.envs.tools import ToolCounters
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.episodes.chat_delta import ChatDeltas, TemplateBreak
from megagrpo.rollout.episodes.multi_turn import (
    Episode,
    MultiTurnLimits,
    ParserCache,
    TurnEngine,
    Version,
    new_trajectory,
    turn_seed,
)
from megagrpo.rollout.episodes.reasoning import ReasoningSplitter, SplitTurn
from megagrpo.rollout.episodes.tool_calls import ParsedTurn, ToolCallParser
from megagrpo.rollout.episodes.trajectory import Trajectory

Departure = Literal["branch", "refuse"]
Deliver = Callable[["Reply"], Awaitable[None]]


class RequestError(Exception):
    """What the endpoint answers a request it cannot serve: HTTP `status`, an OpenAI error `code`."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class BadRequest(RequestError):
    """A request the endpoint cannot read (400, counted in `rollout/agent_bad_requests`): found before
    anything is generated or recorded, so the session is as it was."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(400, message, code)


def content_text(content: Any) -> str:
    """A message's content as text: a string as is, a list of text parts as their texts joined, None as ""
    (`ChatRequest.parse` has checked it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content is a {type(content).__name__}, not text", "invalid_content")
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type", "text") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise BadRequest(
                f"{where}.content[{j}] is not a text part ({{'type': 'text', 'text': '...'}}): {part!r:.80}; "
                "this endpoint serves text",
                "invalid_content",
            )


def _check_message(m: Any, where: str) -> None:
    """A chat message as the template and the recording read it, or `BadRequest` naming the field."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"{where} is not a message with a 'role'", "invalid_messages")
    _check_content(m.get("content"), where)
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise BadRequest(f"{where}.{key} is a {type(m[key]).__name__}, not a string", "invalid_messages")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls is not a list", "invalid_messages")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise BadRequest(
                f"{where}.tool_calls[{j}] has no 'function' object with a 'name' string", "invalid_messages"
            )
        if not isinstance(f.get("arguments", ""), str | dict):
            raise BadRequest(
                f"{where}.tool_calls[{j}].function.arguments is not a JSON string", "invalid_messages"
            )


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list of function schemas", "invalid_tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(
                f"tools[{i}] is not {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                "invalid_tools",
            )
        if t.get("type", "function") != "function" or not isinstance(f.get("parameters", {}), dict):
            raise BadRequest(
                f"tools[{i}]: only function tools with object parameters are served", "invalid_tools"
            )
    return tools


def _arguments_key(arguments: Any) -> str:
    """A tool call's arguments compared as JSON values, so the client's re-serialisation does not count."""
    try:
        return json.dumps(json.loads(arguments) if isinstance(arguments, str) else arguments, sort_keys=True)
    except (TypeError, ValueError):  # not JSON: compare the text
        return str(arguments)


def message_key(m: dict[str, Any]) -> tuple:
    """What identifies a message in a history: role, text, and a tool call's names and arguments or a tool
    message's name and call id. Call ids on assistant messages, `reasoning_content` and fields a client adds
    (`refusal`, `annotations`) do not count: clients drop or rewrite them, and the held ids are the record."""
    role = m.get("role")
    calls = tuple(
        (c["function"]["name"], _arguments_key(c["function"].get("arguments")))
        for c in (m.get("tool_calls") or [])
    )
    extra = (m.get("name"), m.get("tool_call_id")) if role != "assistant" else ()
    return (role, content_text(m.get("content")), calls, extra)


def render_message(m: dict[str, Any]) -> dict[str, Any]:
    """A client's message as the chat template gets it: None fields dropped, content as text."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = content_text(m.get("content"))
    return out


@dataclass(frozen=True)
class ChatRequest:
    """The fields of a `/v1/chat/completions` body the endpoint reads (`parse` checks them)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    stream: bool = False
    max_tokens: int | None = None

    @classmethod
    def parse(cls, body: Any, max_messages: int | None = None) -> ChatRequest:
        """The request, or `BadRequest` naming the field that is wrong: the whole request is checked before
        anything is generated. `max_messages`: the most messages a history may hold (the engine's context:
        every message takes at least one token)."""
        if not isinstance(body, dict):
            raise BadRequest("the request body is not a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of messages", "invalid_messages")
        if max_messages is not None and len(messages) > max_messages:
            raise BadRequest(
                f"'messages' holds {len(messages)} messages, more than the engine's context of {max_messages} "
                "tokens can hold (each message takes at least one token); shorten the history",
                "context_length_exceeded",
            )
        for i, m in enumerate(messages):
            _check_message(m, f"messages[{i}]")
        tools = _check_tools(body.get("tools"))
        if body.get("n") not in (None, 1):
            raise BadRequest(f"n={body.get('n')!r}: a session samples one choice per request (n=1)", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", "invalid_stream")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise BadRequest(f"max_tokens={limit!r} must be a positive integer", "invalid_max_tokens")
        return cls(messages, tools, stream, limit)

    @classmethod
    def from_json(cls, raw: bytes, max_messages: int | None = None) -> ChatRequest:
        """`parse` of a request body's bytes (run off the event loop: a long history takes a while)."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not JSON: {e}", "invalid_json") from None
        return cls.parse(body, max_messages)


@dataclass
class Reply:
    """One answered request: the assistant message as sent, its finish reason and token counts."""

    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class SessionContext:
    """What every session of one rollout call shares: the engine, the sampling and limits, the parsers."""

    engine: TurnEngine
    sampling: SamplingConfig
    limits: MultiTurnLimits
    parsers: ParserCache
    reasoning: ReasoningSplitter | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    version: Version = 0
    on_departure: Departure = "branch"
    max_branches: int = 4


@dataclass
class Branch:
    """One recorded line of a session: its trajectory, its template state and its held history."""

    chat: ChatDeltas
    traj: Trajectory
    tools_key: str
    opened: bool  # the generation prompt leaves a reasoning block open (ReasoningSplitter.opens)
    held: list[tuple] = field(default_factory=list)  # message_key of every message, replies included


def _tools_key(tools: Sequence[dict]) -> str:
    return json.dumps(list(tools), sort_keys=True, default=str)


class AgentSession:
    """The recording of one session (module doc); `complete` serves one request."""

    def __init__(
        self, ctx: SessionContext, *, index: int, prompt_index: int = 0, sample_index: int = 0
    ) -> None:
        self.ctx = ctx
        self.index, self.prompt_index, self.sample_index = index, prompt_index, sample_index
        self.lock = asyncio.Lock()
        self.branches: list[Branch] = []
        self.last: Branch | None = None  # the branch of the last answered request
        self.turns = 0  # answered requests over all branches (the seeds' turn index)
        self.requests = 0  # requests that reached the session, answered or not
        self.ended: str | None = None  # why no further request is served
        self.truncation: str | None = None  # as Episode.truncation
        self.tools = ToolCounters()
        self.cut_turns = self.cut_in_reasoning = 0
        self.bad_requests = self.branch_refusals = 0
        self.undelivered = 0  # turns taken back: their reply never reached the client
        self.final_text = ""
        self.fatal: BaseException | None = None

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why

    def _truncate(self, why: str, message: str) -> RequestError:
        self.truncation = why
        self.end(f"truncated: {why}")
        return RequestError(400, message, "context_length_exceeded" if why == "max_tokens" else why)

    def tokens_after_prompts(self) -> int:
        """The session's tokens after its branches' prompts, model and environment tokens: what
        `limits.max_tokens` bounds (module doc)."""
        return sum(b.traj.num_tokens - b.traj.prompt_ids.numel() for b in self.branches)

    def _match(self, req: ChatRequest) -> tuple[Branch, list[dict]] | None:
        """The latest branch whose held history the request extends, and the new messages."""
        keys = [message_key(m) for m in req.messages]
        for b in reversed(self.branches):
            n = len(b.held)
            rest = req.messages[n:]
            if (
                len(keys) > n
                and keys[:n] == b.held
                and b.tools_key == _tools_key(req.tools)
                and all(m.get("role") != "assistant" for m in rest)
            ):
                return b, rest
        return None

    def _departure(self, req: ChatRequest) -> str:
        """Where the request departs from the session's last branch, in words for the refusal."""
        b = self.last or self.branches[-1]
        if b.tools_key != _tools_key(req.tools):
            return "its tools differ from the session's"
        keys = [message_key(m) for m in req.messages]
        i = next((i for i, (a, h) in enumerate(zip(keys, b.held)) if a != h), min(len(keys), len(b.held)))
        if i < len(b.held):
            return f"messages[{i}] (role {req.messages[i].get('role') if i < len(keys) else None!r}) differs"
        return "it adds an assistant message or no new message after the last reply"

    def _open_branch(self, req: ChatRequest) -> Branch:
        ctx, engine = self.ctx, self.ctx.engine
        chat = ChatDeltas(engine.tokenizer, tools=req.tools or None, **ctx.template_kwargs)
        prompt = chat.prompt([render_message(m) for m in req.messages])
        traj = new_trajectory(engine, prompt, self.prompt_index, self.sample_index)
        opened = ctx.reasoning is not None and ctx.reasoning.opens(chat.generation_prompt)
        b = Branch(chat, traj, _tools_key(req.tools), opened, [message_key(m) for m in req.messages])
        self.branches.append(b)
        return b

    async def complete(self, req: ChatRequest, deliver: Deliver | None = None) -> Reply:
        """Serve one request (module doc); `RequestError` for what the endpoint refuses. `deliver` sends the
        reply to the client under the session's lock; when it raises (the client has gone), the turn is
        taken back, as if the request had never come, and the error is raised."""
        async with self.lock:
            if self.ended is not None:
                raise RequestError(410, f"this session has ended ({self.ended})", "session_ended")
            self.requests += 1
            undo = self._undo()
            # matching and rendering a long history takes a while: off the loop that serves every session
            branch, env_ids, parser = await asyncio.to_thread(self._prepare, req)
            reply = await self._generate(branch, env_ids, req, parser)
            if deliver is not None:
                try:
                    await deliver(reply)
                except BaseException:
                    undo()
                    raise
            return reply

    def _prepare(self, req: ChatRequest) -> tuple[Branch, list[int], ToolCallParser | None]:
        """The request's branch and the ids it appends, recorded; or `RequestError`, with the session as it
        was unless the error ends it (a limit, a template break)."""
        limits = self.ctx.limits
        if self.turns >= limits.max_turns:
            raise self._truncate(
                "max_turns",
                f"this session has had its {limits.max_turns} model turns (rollout.multi_turn.max_turns, "
                "counted over all its branches)",
            )
        try:  # before anything is generated: a tool schema the parser cannot read is the request's fault
            parser = self.ctx.parsers.get(req.tools)
        except (ValueError, TypeError, KeyError) as e:
            raise BadRequest(f"'tools' could not be read as function schemas: {e}", "invalid_tools") from None
        found = self._match(req) if self.branches else None
        if found is None and self.branches and self.ctx.on_departure == "refuse":
            self.branch_refusals += 1
            raise RequestError(
                409,
                f"the history departs from this session's recording ({self._departure(req)}); this run "
                "refuses departures (rollout.multi_turn.agent.on_departure=refuse): send the history back "
                "as the endpoint returned it, with new messages after it",
                "history_departs",
            )
        if found is None and len(self.branches) >= self.ctx.max_branches:
            raise self._truncate(
                "max_branches",
                f"the history departs from this session's recording ({self._departure(req)}) and the "
                f"session has opened its {self.ctx.max_branches} branches "
                "(rollout.multi_turn.agent.max_branches)",
            )
        try:
            if found is None:
                return self._open_branch(req), [], parser
            branch, new = found
            env_ids = branch.chat.append([render_message(m) for m in new])
        except TemplateBreak as e:
            raise self._truncate("template", str(e)) from None
        except MegagrpoError as e:  # the template refuses these messages (its raise_exception)
            raise BadRequest(
                f"the chat template cannot render this request: {e}", "invalid_messages"
            ) from None
        branch.held.extend(message_key(m) for m in new)
        return branch, env_ids, parser

    def _undo(self) -> Callable[[], None]:
        """A function that puts the session back as it is now: its branches, their recordings and template
        state, and its counters (a turn the client never received is not recorded)."""
        n = len(self.branches)
        kept = [(b, b.chat.snapshot(), b.traj.snapshot(), len(b.held)) for b in self.branches]
        fields = ("last", "turns", "ended", "truncation", "cut_turns", "cut_in_reasoning", "final_text")
        state = {k: getattr(self, k) for k in fields}
        tools = dataclasses.replace(self.tools)

        def undo() -> None:
            del self.branches[n:]
            for b, chat, traj, held in kept:
                b.chat, b.traj = chat, traj
                del b.held[held:]
            for k, v in state.items():
                setattr(self, k, v)
            self.tools = tools
            self.undelivered += 1

        return undo

    async def _generate(
        self, branch: Branch, env_ids: list[int], req: ChatRequest, parser: ToolCallParser | None
    ) -> Reply:
        ctx, engine, traj = self.ctx, self.ctx.engine, branch.traj
        held = traj.num_tokens + len(env_ids)
        used = self.tokens_after_prompts() + len(env_ids)
        room = min(ctx.limits.max_tokens - used, engine.context_len - held)
        budget = min(ctx.sampling.max_new_tokens, room, req.max_tokens or room)
        if budget < 1:
            raise self._truncate(
                "max_tokens",
                f"the session has no token left for a reply ({used} tokens after its prompts over "
                f"{len(self.branches)} branch(es), max_tokens {ctx.limits.max_tokens}; this branch holds "
                f"{held} of the engine's context of {engine.context_len})",
            )
        try:
            out = await engine.generate_turn(
                traj.next_input_ids(env_ids),
                ctx.sampling,
                seed=turn_seed(ctx.sampling.seed, self.index, self.turns),
                routed_experts_start_len=traj.routed_experts_start_len,
                max_new_tokens=budget,
            )
            version = ctx.version() if callable(ctx.version) else ctx.version
            traj.add_engine_output(out, env_ids, version=version)
        except Exception as e:  # the engine's failure or our own: kept, raised once every session has ended
            self.fatal = e
            self.end("the rollout failed")
            raise RequestError(500, f"the rollout failed: {type(e).__name__}: {e}", "server_error") from e
        self.turns += 1
        self.last = branch
        gen = out["output_ids"]
        cut = traj.finish_reason == "length"
        if cut and budget == room and room < ctx.sampling.max_new_tokens:  # the trajectory's budget ended it
            text = engine.tokenizer.decode(gen)
            split = self._read(branch, text, cut)
            self.final_text = split.content
            self.truncation = "max_tokens"
            self.end("truncated: max_tokens")
            message = {"role": "assistant", "content": split.content}
            return Reply(message, "length", held, len(gen))
        split = self._read(branch, branch.chat.close_model_turn(gen), cut)
        self.final_text = split.content
        parsed = parser.parse(split.content) if parser is not None else ParsedTurn(split.content)
        self.tools.tool_calls += len(parsed.calls)
        self.tools.malformed_calls += len(parsed.malformed)
        good = [c for c in parsed.calls if c.error is None]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": split.content if parsed.malformed else parsed.text,
        }
        if good:
            message["tool_calls"] = [c.openai(f"call_{self.turns - 1}_{i}") for i, c in enumerate(good)]
        if split.reasoning:
            message["reasoning_content"] = split.reasoning
        branch.held.append(message_key(message))
        finish = "length" if cut else "tool_calls" if good else "stop"
        return Reply(message, finish, held, len(gen))

    def _read(self, branch: Branch, text: str, cut: bool) -> SplitTurn:
        r = self.ctx.reasoning
        split = r.split(text, cut=cut, opened=branch.opened) if r is not None else SplitTurn("", text)
        self.cut_turns += cut
        self.cut_in_reasoning += cut and split.unclosed
        return split

    def episode(self) -> Episode | None:
        """The session as an `Episode`: its row the last answered request's branch, `earlier` its other
        branches with a model turn; None when no request was answered; `reward` and `done` are the caller's
        (the agent's outcome)."""
        if self.last is None:
            return None
        ep = Episode(
            self.last.traj,
            truncation=self.truncation,
            tools=self.tools,
            final_text=self.final_text,
            cut_turns=self.cut_turns,
            cut_in_reasoning=self.cut_in_reasoning,
        )
        ep.branches = len(self.branches) - 1
        ep.earlier = [b.traj for b in self.branches if b is not self.last and b.traj.turns > 0]
        ep.branch_refusals = self.branch_refusals
        ep.bad_requests = self.bad_requests
        ep.undelivered = self.undelivered
        return ep
