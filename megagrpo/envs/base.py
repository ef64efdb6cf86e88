"""The environment protocol of multi-turn rollouts, and a base class for environments that offer tools.

Messages are OpenAI-style dicts: `role` (system, user, assistant, tool), `content`, and, on an assistant
message, `tool_calls` (`[{"id", "type": "function", "function": {"name", "arguments"}}]`) and, with
`rollout.multi_turn.reasoning_parser`, `reasoning_content` (the turn's reasoning, split off: `content` and
the calls are what the model wrote after it); a tool message carries `tool_call_id` and `name`. The driver (`megagrpo.rollout`) renders them with the model's chat
template, passing `env.tool_schemas()` as `tools=`, and parses the model's text back into an assistant
message; an environment never sees token ids.

One environment instance serves one trajectory: `reset(row)` once, then `step(...)` once per model turn
until it returns `done`. Both are coroutines, since each trajectory is its own coroutine and a step may
wait on tools.

An environment may also define `check_row(row)` (plain, cheap: no tools, no I/O) that raises `ValueError`
saying what a data row lacks for it. The trainer calls it on every row when the data is loaded, so that a row
the environment would reject follows `data.malformed` (reported as file:line, then skipped and counted, or
an error) like any other malformed row, instead of stopping the run when a step draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from megagrpo.envs.tools import Message, ToolCounters, ToolExecutor, ToolResult


@dataclass
class StepResult:
    """What one environment step gives back.

    `messages`: appended to the conversation after the assistant's message (tool results, a user turn);
    `done`: the episode is over; `reward`: the trajectory's reward when the environment scores it (None
    leaves scoring to `rewards.functions`); `info`: free-form facts for logs and metrics.
    """

    messages: list[Message]
    done: bool
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task: start from a data row, then answer each assistant message."""

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        """The messages that start the conversation (system and user turns) for this data row."""
        ...

    async def step(self, assistant_message: Message) -> StepResult:
        """React to the model's latest message: the messages to append, whether the episode is done, a reward."""
        ...

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools offered, as OpenAI function schemas (the chat template's `tools=`); [] for none."""
        ...


class ToolEnvironment:
    """Base for environments that offer tools: answers each tool call with a `role: tool` message.

    Subclasses implement `reset` and `step`, and call `run_tools(assistant_message)` inside `step`.
    `counters` sums this trajectory's tool outcomes (see `ToolCounters`); the executor may be shared by many
    environments (one per trajectory), and is never the place where a trajectory's failure surfaces.
    """

    def __init__(self, executor: ToolExecutor) -> None:
        self.executor = executor
        self.counters = ToolCounters()
        self.results: list[ToolResult] = []  # every answered call of this trajectory, in order

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.executor.schemas()

    def check_row(self, row: dict[str, Any]) -> None:
        """ValueError naming what `row` lacks for this environment (module doc); every row fits by default."""

    async def run_tools(self, assistant_message: Message) -> list[Message]:
        """One `role: tool` message per tool call of the assistant message, in the calls' order."""
        calls = assistant_message.get("tool_calls") or []
        results = await self.executor.call_all(list(calls), self.counters)
        self.results.extend(results)
        return [r.message() for r in results]

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        raise NotImplementedError

    async def step(self, assistant_message: Message) -> StepResult:
        raise NotImplementedError
