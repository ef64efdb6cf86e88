"""One agent session of the OpenAI-compatible endpoint (`rollout.agent_endpoint`): the chat requests an
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

Limits, as the driver's (`rollout.multi_turn` module doc): a branch's tokens after its prompt stay within
`max_tokens` (a turn asks for at most what is left; a request that leaves none ends the session, truncated),
and its model turns within `max_turns` (a request for one more ends the session, truncated). The request's
`max_tokens` / `max_completion_tokens` lower a turn's limit; its `temperature`, `top_p`, `stop` and `seed`
are ignored: the trainer's sampling parameters are the ones the learner's importance weights assume.

Failures. What the agent sends is answered with an HTTP error and counted, never raised (`RequestError`).
An engine error or a bug in the recording is kept (`fatal`) and raised by the rollout once every session
has ended, as the driver raises an engine error after the other trajectories finish.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megagrpo.envs.tools import ToolCounters
from megagrpo.rollout.chat_delta import ChatDeltas, TemplateBreak
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.multi_turn import (
    Episode,
    MultiTurnLimits,
    ParserCache,
    TurnEngine,
    Version,
    new_trajectory,
    turn_seed,
)
from megagrpo.rollout.reasoning import ReasoningSplitter, SplitTurn
from megagrpo.rollout.tool_calls import ParsedTurn
from megagrpo.rollout.trajectory import Trajectory

Departure = Literal["branch", "refuse"]


class RequestError(Exception):
    """What the endpoint answers a request it cannot serve: HTTP `status`, an OpenAI error `code`."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def content_text(content: Any) -> str:
    """A message's content as text: a string as is, a list of parts as their texts joined, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError(400, f"a message's content is a {type(content).__name__}, not text", "invalid_content")


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
        ((c.get("function") or {}).get("name"), _arguments_key((c.get("function") or {}).get("arguments")))
        for c in (m.get("tool_calls") or [])
        if isinstance(c, dict)
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
    def parse(cls, body: Any) -> ChatRequest:
        """The request, or `RequestError` 400 naming the field that is wrong."""
        if not isinstance(body, dict):
            raise RequestError(400, "the request body is not a JSON object", "invalid_request")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of messages", "invalid_messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(400, f"messages[{i}] is not a message with a 'role'", "invalid_messages")
            content_text(m.get("content"))
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError(400, "'tools' must be a list of function schemas", "invalid_tools")
        if body.get("n") not in (None, 1):
            raise RequestError(
                400, f"n={body.get('n')!r}: a session samples one choice per request (n=1)", "n"
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(400, "'stream' must be true or false", "invalid_stream")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RequestError(400, f"max_tokens={limit!r} must be a positive integer", "invalid_max_tokens")
        return cls(messages, tools, stream, limit)


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
        self.final_text = ""
        self.fatal: BaseException | None = None

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why

    def _truncate(self, why: str, message: str) -> RequestError:
        self.truncation = why
        self.end(f"truncated: {why}")
        return RequestError(400, message, "context_length_exceeded" if why == "max_tokens" else why)

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

    async def complete(self, req: ChatRequest) -> Reply:
        """Serve one request (module doc); `RequestError` for what the endpoint refuses."""
        async with self.lock:
            if self.ended is not None:
                raise RequestError(410, f"this session has ended ({self.ended})", "session_ended")
            self.requests += 1
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
            if found is None:
                branch, env_ids = self._open_branch(req), []
            else:
                branch, new = found
                if branch.traj.turns >= self.ctx.limits.max_turns:
                    raise self._truncate(
                        "max_turns", f"this trajectory has had its {self.ctx.limits.max_turns} model turns"
                    )
                try:
                    env_ids = branch.chat.append([render_message(m) for m in new])
                except TemplateBreak as e:
                    raise self._truncate("template", str(e)) from None
                branch.held.extend(message_key(m) for m in new)
            return await self._generate(branch, env_ids, req)

    async def _generate(self, branch: Branch, env_ids: list[int], req: ChatRequest) -> Reply:
        ctx, engine, traj = self.ctx, self.ctx.engine, branch.traj
        P = traj.prompt_ids.numel()
        held = traj.num_tokens + len(env_ids)
        room = min(ctx.limits.max_tokens - (held - P), engine.context_len - held)
        budget = min(ctx.sampling.max_new_tokens, room, req.max_tokens or room)
        if budget < 1:
            raise self._truncate(
                "max_tokens",
                f"the trajectory has no token left for a reply ({held - P} tokens after its prompt, "
                f"max_tokens {ctx.limits.max_tokens}, engine context {engine.context_len})",
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
        parser = ctx.parsers.get(req.tools)
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
        return ep
