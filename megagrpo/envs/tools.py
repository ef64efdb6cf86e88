"""Tools for multi-turn rollouts: an OpenAI-style function schema plus a Python callable, and the executor
that answers every tool call of an assistant message, whatever goes wrong.

A tool call is the OpenAI dict `{"id", "type": "function", "function": {"name", "arguments"}}`, with
`arguments` a JSON string (a dict is accepted too). `megagrpo.rollout.episodes.tool_calls` builds these from the
generated text and marks a call it could not parse with a `"malformed"` reason.

Failure policy: a malformed call (bad JSON, arguments that do not match the schema), an unknown tool, a tool
that raises, a tool past its deadline and a result over the size limit are each answered to the model with
a `role: tool` message that says what went wrong, and counted in `ToolCounters`; the trajectory goes on.
`ToolExecutor.call` never raises for any of them. A tool that raises `ToolInterrupted` (something outside
the call ended it) is answered "interrupted" and counted: its answer is not the model's doing, and the
environment ends that trajectory, which the trainer drops. `ToolRefused` (a call the tool refused to run,
e.g. a sandbox that could not isolate it) is one such interruption, counted besides as `refused_calls`.

Threads and deadlines. Each call runs on a daemon thread of its own, off the event loop, so that one
trajectory waiting on a tool never stalls the others' decoding, and a hung tool never holds a pool slot
that a later call needs. Python cannot kill a thread. At the deadline the model is answered at once and the
thread is asked to stop by raising `ToolDeadline` inside it (`PyThreadState_SetAsyncExc`): that ends a
pure-Python loop at its next bytecode, but a thread blocked in C (a sleep, a socket, a C extension) runs on
until that call returns, and so leaks a thread meanwhile (`ToolExecutor.abandoned_threads` counts them). A
tool that can hang for good, or that runs untrusted code, belongs in a child process that can be killed:
the sandboxed python tool (`megagrpo.envs.python_tool`) does exactly that.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from megagrpo.rewards.executor import raise_in_thread

Message = dict[str, Any]
Status = Literal["ok", "malformed", "unknown_tool", "error", "timeout", "oversize", "interrupted"]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolDeadline(BaseException):  # noqa: N818 - raised asynchronously; BaseException so a tool's `except Exception` cannot swallow it
    """Raised inside a tool's thread once its call is past the deadline."""


class ToolInterrupted(Exception):  # noqa: N818 - an outcome, like ToolDeadline, not a bug of the caller's
    """Raised by a tool whose run something outside the call ended (a signal to the job, the OOM killer):
    its answer would not be the model's doing, so the call is answered as "interrupted", counted
    (`ToolCounters.interrupted_calls`), and the environment ends its trajectory, which takes no loss
    (`AnswerToolEnv`, `trainer.episodes.episode_completion`)."""


class ToolRefused(ToolInterrupted):
    """Raised by a tool that did not run a call because it could not run it safely (the python tool under
    rollout.multi_turn.sandbox_isolation: require, when the sandbox could not isolate that call): an
    interruption, since the model did nothing wrong, counted besides as `ToolCounters.refused_calls`."""


@dataclass(frozen=True)
class ToolOutput:
    """A tool's answer with what the executor counts beside it: `unisolated`, the call ran without some
    isolation it should have had (a sandbox in best-effort mode, docs/sandbox.md)."""

    content: str
    unisolated: bool = False


class ToolSlots:
    """A bound on the tool calls that run at once, shared by every executor given it.

    One per engine owner (`rollout.multi_turn.max_concurrent_tools`, `trainer.episodes.EpisodeSampler`):
    each trajectory has an executor of its own, and all of them take their slots here, so G x prompts
    trajectories never start more than `limit` tools (sandboxes) at once. A call past the bound waits for
    a slot, and its deadline starts when it gets one. Host cost per owner: at most `limit` tool threads,
    and for the python tool `limit` sandboxes (docs/sandbox.md gives each one's processes, memory, files).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a tool concurrency bound must be >= 1, got {limit}")
        self.limit = limit
        self._sems: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def slot(self) -> asyncio.Semaphore:
        """The running loop's semaphore (an asyncio semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        for old in [lp for lp in self._sems if lp.is_closed()]:
            del self._sems[old]
        if loop not in self._sems:
            self._sems[loop] = asyncio.Semaphore(self.limit)
        return self._sems[loop]


@dataclass(frozen=True)
class Tool:
    """One tool: its OpenAI function schema and the callable that runs it with the call's keyword arguments.

    `parameters` is a JSON-schema object (`{"type": "object", "properties": ..., "required": [...]}`).
    `fn` returns a str (sent as is) or any JSON-serialisable value (sent as JSON); raising is allowed and is
    answered as a tool error. `timeout_s` overrides the executor's deadline for this tool.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    timeout_s: float | None = None

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema, as the chat template's `tools=` and SGLang's parsers take it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolCounters:
    """What happened to the tool calls of one trajectory (or, summed, of a batch)."""

    tool_calls: int = 0  # every call answered, failed ones included
    tool_errors: int = 0  # the tool raised
    tool_timeouts: int = 0
    malformed_calls: int = 0  # unparsable call, bad JSON arguments, or arguments against the schema
    unknown_tools: int = 0
    oversize_results: int = 0  # answered, truncated with a note
    interrupted_calls: int = 0  # ended from outside (`ToolInterrupted`): the trajectory is dropped
    unisolated_calls: int = 0  # ran without isolation the sandbox could not enforce (`ToolOutput`)
    refused_calls: int = (
        0  # never run (`ToolRefused`), among the interrupted calls: the trajectory is dropped
    )

    def add(self, other: ToolCounters) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class ToolResult:
    """One answered call: the `role: tool` message's content and what happened."""

    call_id: str
    name: str
    content: str
    status: Status
    seconds: float = 0.0

    def message(self) -> Message:
        return {"role": "tool", "tool_call_id": self.call_id, "name": self.name, "content": self.content}


@dataclass
class _Parsed:
    call_id: str
    name: str
    args: dict[str, Any] | None = None
    problem: str | None = None  # why the call is malformed


class ToolExecutor:
    """Runs tool calls off the event loop with per-call deadlines, for one trajectory or many.

    `max_result_chars` bounds each answer (a longer result is cut there, with a note saying how long it was);
    `max_concurrent` bounds the tool threads of this executor running at once per event loop (calls past
    it wait their turn, and their deadline starts when they start), unless `slots` is given: then those
    shared slots bound them together with every other executor's that shares them (`ToolSlots`).
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        timeout_s: float = 10.0,
        max_result_chars: int = 16_000,
        max_concurrent: int = 16,
        slots: ToolSlots | None = None,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        if timeout_s <= 0 or max_result_chars < 1 or max_concurrent < 1:
            raise ValueError("timeout_s, max_result_chars and max_concurrent must be positive")
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.max_concurrent = max_concurrent
        self.abandoned_threads = 0  # threads still running a timed-out call when it was answered
        self.slots = slots or ToolSlots(max_concurrent)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def call_all(
        self, calls: list[dict[str, Any]], counters: ToolCounters | None = None
    ) -> list[ToolResult]:
        """Answer every call of one assistant message, concurrently, in the calls' order."""
        return list(await asyncio.gather(*(self.call(c, counters, i) for i, c in enumerate(calls))))

    async def call(
        self, call: dict[str, Any], counters: ToolCounters | None = None, index: int = 0
    ) -> ToolResult:
        """Answer one OpenAI-style tool call; never raises for the call's own faults (see the module doc)."""
        counters = counters if counters is not None else ToolCounters()
        counters.tool_calls += 1
        p = self._parse(call, index)
        if p.problem is not None:
            counters.malformed_calls += 1
            return ToolResult(p.call_id, p.name, f"Error: malformed tool call: {p.problem}", "malformed")
        tool = self.tools.get(p.name)
        if tool is None:
            counters.unknown_tools += 1
            known = ", ".join(self.tools) or "none"
            return ToolResult(
                p.call_id, p.name, f"Error: unknown tool {p.name!r}; available: {known}", "unknown_tool"
            )
        problem = _check_args(p.args or {}, tool.parameters)
        if problem is not None:
            counters.malformed_calls += 1
            return ToolResult(
                p.call_id, p.name, f"Error: malformed call to {p.name!r}: {problem}", "malformed"
            )
        timeout = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        async with self.slots.slot():
            start = time.monotonic()
            outcome, worker = await self._run(tool, p.args or {}, timeout)
            seconds = time.monotonic() - start
        if outcome is None:
            counters.tool_timeouts += 1
            if worker.stop():
                self.abandoned_threads += 1
            return ToolResult(
                p.call_id, p.name, f"Error: tool {p.name!r} timed out after {timeout:g} s", "timeout", seconds
            )
        value, exc = outcome
        if isinstance(exc, ToolInterrupted):
            counters.interrupted_calls += 1
            counters.refused_calls += isinstance(exc, ToolRefused)
            how = "was not run" if isinstance(exc, ToolRefused) else "was interrupted"
            return ToolResult(
                p.call_id, p.name, f"Error: tool {p.name!r} {how}: {exc}", "interrupted", seconds
            )
        if exc is not None:
            counters.tool_errors += 1
            return ToolResult(
                p.call_id,
                p.name,
                f"Error: tool {p.name!r} failed: {type(exc).__name__}: {exc}",
                "error",
                seconds,
            )
        return self._finish(p, value, seconds, counters)

    def _finish(self, p: _Parsed, value: Any, seconds: float, counters: ToolCounters) -> ToolResult:
        if isinstance(value, ToolOutput):
            counters.unisolated_calls += value.unisolated
            value = value.content
        if isinstance(value, str):
            text = value
        else:
            try:
                text = json.dumps(value, ensure_ascii=False, default=str)
            except (TypeError, ValueError) as e:  # e.g. a circular structure
                counters.tool_errors += 1
                return ToolResult(
                    p.call_id, p.name, f"Error: tool {p.name!r} returned no JSON value: {e}", "error", seconds
                )
        if len(text) <= self.max_result_chars:
            return ToolResult(p.call_id, p.name, text, "ok", seconds)
        counters.oversize_results += 1
        note = f"\n[truncated: the result has {len(text)} characters; only the first {self.max_result_chars} are shown]"
        return ToolResult(p.call_id, p.name, text[: self.max_result_chars] + note, "oversize", seconds)

    async def _run(self, tool: Tool, args: dict[str, Any], timeout: float) -> tuple[Any, _ToolThread]:
        """Run `tool.fn(**args)` on a fresh daemon thread; (value, exception), or None past the deadline."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        worker = _ToolThread(tool, args, loop, fut)
        worker.thread.start()
        try:
            return await asyncio.wait_for(fut, timeout), worker
        except TimeoutError:
            return None, worker

    def _parse(self, call: dict[str, Any], index: int) -> _Parsed:
        call_id = str(call.get("id") or f"call_{index}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            return _Parsed(call_id, "", problem="the call has no 'function' object")
        name = fn.get("name")
        name = name if isinstance(name, str) else ""
        if call.get("malformed"):
            return _Parsed(call_id, name, problem=str(call["malformed"]))
        if not name:
            return _Parsed(call_id, name, problem="the call names no function")
        raw = fn.get("arguments", {})
        if isinstance(raw, str):
            try:
                raw = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as e:
                return _Parsed(call_id, name, problem=f"arguments are not valid JSON ({e})")
        if not isinstance(raw, dict):
            return _Parsed(
                call_id, name, problem=f"arguments must be a JSON object, got {type(raw).__name__}"
            )
        return _Parsed(call_id, name, args=raw)


class _ToolThread:
    """One tool call on a daemon thread of its own; its outcome is handed to the event loop's future."""

    def __init__(
        self, tool: Tool, args: dict[str, Any], loop: asyncio.AbstractEventLoop, fut: asyncio.Future
    ):
        self.tool, self.args, self.loop, self.fut = tool, args, loop, fut
        self.lock = threading.Lock()  # orders `finished` against `stop`, so a stop never hits a reused ident
        self.finished = False
        self.thread = threading.Thread(target=self._target, name=f"tool-{tool.name}", daemon=True)

    def _deliver(self, outcome: tuple[Any, BaseException | None]) -> None:
        if not self.fut.done():  # a timed-out call's future is cancelled already
            self.fut.set_result(outcome)

    def _target(self) -> None:
        try:
            try:
                outcome = (self.tool.fn(**self.args), None)
            except Exception as e:  # a raising tool is answered as an error, never propagated
                outcome = (None, e)
            with self.lock:
                self.finished = True
            self.loop.call_soon_threadsafe(self._deliver, outcome)
        except ToolDeadline:
            pass  # answered as a timeout already
        except RuntimeError:
            pass  # the event loop closed while the tool ran: nobody waits for this answer

    def stop(self) -> bool:
        """Ask a timed-out call to stop (see the module doc); True when its thread was still running it."""
        with self.lock:
            if self.finished:
                return False
            raise_in_thread(self.thread, ToolDeadline)
            return True


def _check_args(args: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """What is wrong with `args` against a function's JSON-schema object, or None.

    Checks what models get wrong: missing required arguments, unknown ones (unless the schema sets
    `additionalProperties`), and each argument's top-level `type`/`enum`. Not a full JSON-schema validator.
    """
    props: dict[str, Any] = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}; expected: {', '.join(props) or 'none'}"
    if not schema.get("additionalProperties", False):
        extra = [k for k in args if k not in props]
        if extra:
            return f"unexpected argument(s) {', '.join(extra)}; expected: {', '.join(props) or 'none'}"
    for k, v in args.items():
        spec = props.get(k, {})
        types = spec.get("type")
        if types is not None:
            names = [types] if isinstance(types, str) else list(types)
            ok = any(
                isinstance(v, _JSON_TYPES.get(t, object))
                and not (isinstance(v, bool) and t in ("integer", "number"))
                for t in names
            )
            if not ok:
                return f"argument {k!r} must be of type {'/'.join(names)}, got {type(v).__name__}"
        if "enum" in spec and v not in spec["enum"]:
            return f"argument {k!r} must be one of {spec['enum']!r}, got {v!r}"
    return None
