"""A user's environment for the multi-turn trainer tests, imported by path ('tests.integration.agentic_env:
ThreeToolTurns') as `rollout.multi_turn.environment` names one.

Every model turn but the last is answered with a tool message, so each trajectory has exactly 3 model turns
and 2 environment insertions whatever an untrained model writes; the reward is the parity of the model's
text over all turns (it varies across a random model's samples, so groups are kept). Each finished
trajectory is appended to `$MEGAGRPO_TEST_RECORD_DIR/<pid>.jsonl` so runs can be compared."""

from __future__ import annotations

import json
import os
import threading

from megagrpo.envs.base import StepResult

TURNS = 3
_LOCK = threading.Lock()


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
        out = os.environ.get("MEGAGRPO_TEST_RECORD_DIR")
        if out:
            with _LOCK, open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps([self.row["prompt"], self.texts]) + "\n")
        return StepResult([], True, float(sum(map(len, self.texts)) % 2 == 0))

    def tool_schemas(self):
        return [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Look a number up.",
                    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
                },
            }
        ]
