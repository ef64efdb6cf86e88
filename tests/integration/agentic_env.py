"""A user's environment for the multi-turn trainer tests, imported by path ('tests.integration.agentic_env:
ThreeToolTurns') as `rollout.multi_turn.environment` names one.

Every model turn but the last is answered with a tool message, so each trajectory has exactly 3 model turns
and 2 environment insertions whatever an untrained model writes; the reward is the parity of the model's
text over all turns (it varies across a random model's samples, so groups are kept). Each finished
trajectory is appended to `$MEGAGRPO_TEST_RECORD_DIR/<pid>.jsonl` so runs can be compared.

`openai_agent` is the same conversation written as an external agent against the OpenAI client
(`rollout.multi_turn.agent.function`): the same messages and tools, so the endpoint records the driver's
trajectories; each of its sessions also leaves a line in `<pid>.agent`, which says the endpoint ran."""

from __future__ import annotations

import json
import os
import threading

from megagrpo.envs.base import StepResult

TURNS = 3
_LOCK = threading.Lock()


def _record(row, texts, suffix="jsonl") -> None:
    out = os.environ.get("MEGAGRPO_TEST_RECORD_DIR")
    if out:
        with _LOCK, open(os.path.join(out, f"{os.getpid()}.{suffix}"), "a") as f:
            f.write(json.dumps([row["prompt"], texts]) + "\n")


class ThreeToolTurns:
    def __init__(self, tool_text: str = "46") -> None:
        self.tool_text = tool_text
        self.texts: list[str] = []

    async def reset(self, row):
        self.row, self.texts = row, []
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, assistant_message):
        self.texts.append(assistant_message.get("content") or "")
        if len(self.texts) < TURNS:
            return StepResult([{"role": "tool", "name": "lookup", "content": self.tool_text}], False)
        _record(self.row, self.texts)
        return StepResult([], True, float(sum(map(len, self.texts)) % 2 == 0))

    def tool_schemas(self):
        return TOOLS


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a number up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]


def openai_agent(base_url: str, row: dict, tool_text: str = "46") -> float:
    """ThreeToolTurns' conversation from the agent's side: ask, answer every turn but the last with the
    lookup tool's message, and return the same reward."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="megagrpo", max_retries=0)
    model = client.models.list().data[0].id
    messages, texts = [{"role": "user", "content": row["prompt"]}], []
    for turn in range(TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        texts.append(reply.content or "")
        messages.append(reply.model_dump(exclude_none=True))
        if turn + 1 < TURNS:
            messages.append({"role": "tool", "name": "lookup", "content": tool_text})
    _record(row, texts)
    _record(row, texts, suffix="agent")
    return float(sum(map(len, texts)) % 2 == 0)
