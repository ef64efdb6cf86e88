"""`AnswerToolEnv`: a question from the data row, tools to work it out with, and a reward for the final
`<answer>...</answer>`: the shape of the built-in environments (calculator, python)."""

from __future__ import annotations

from typing import Any

from megagrpo.envs.base import StepResult, ToolEnvironment
from megagrpo.envs.tools import Message, ToolCounters, ToolExecutor
from megagrpo.errors import MegagrpoError
from megagrpo.rewards.extract import answer_tag
from megagrpo.rewards.verifiers import exact_match


class AnswerToolEnv(ToolEnvironment):
    """The reward is 1 when `<answer>...</answer>` matches the row's answer.

    reset: a system prompt and the row's question (`row[question_key]`). Each step: an assistant message
    with an answer tag ends the episode and is scored (exact match after whitespace normalisation), even if
    it also calls tools; one with tool calls is answered with their results, unless it is the
    `max_turns`-th turn, which ends the episode with reward 0; one with neither ends it with reward 0.
    A tool call interrupted from outside (`ToolInterrupted`) ends it unscored: the trainer drops it.
    """

    def __init__(
        self,
        executor: ToolExecutor,
        *,
        max_turns: int = 4,
        question_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str = "",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        super().__init__(executor)
        self.max_turns = max_turns
        self.question_key, self.answer_key = question_key, answer_key
        self.system_prompt = system_prompt
        self._score = exact_match(extract="answer_tag", answer_key=answer_key)
        self.row: dict[str, Any] = {}
        self.turns = 0

    def check_row(self, row: dict[str, Any]) -> None:
        for key in (self.question_key, self.answer_key):
            if row.get(key) is None:
                raise ValueError(
                    f"{type(self).__name__}: the data row has no {key!r} field (it has {sorted(row)}); "
                    "set question_key/answer_key in rollout.multi_turn.environment_options"
                )

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        try:  # the trainer checked every row at load (`check_row`): only a direct caller gets here
            self.check_row(row)
        except ValueError as e:
            raise MegagrpoError(str(e)) from None
        self.row, self.turns = row, 0
        self.counters = ToolCounters()
        self.results = []
        messages: list[Message] = [{"role": "user", "content": str(row[self.question_key])}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def step(self, assistant_message: Message) -> StepResult:
        self.turns += 1
        content = assistant_message.get("content") or ""
        info: dict[str, Any] = {"turns": self.turns}
        if answer_tag(content) is not None:
            reward = self._score("", content, self.row)
            return StepResult([], True, reward, {**info, "finish": "answer"})
        if not assistant_message.get("tool_calls"):
            return StepResult([], True, 0.0, {**info, "finish": "no_answer"})
        if self.turns >= self.max_turns:
            return StepResult([], True, 0.0, {**info, "finish": "max_turns"})
        messages = await self.run_tools(assistant_message)
        if any(r.status == "interrupted" for r in self.results[-len(messages) :]):
            # an answer the model did not cause must not be trained on: end here, unscored (dropped)
            return StepResult([], True, None, {**info, "finish": "interrupted"})
        return StepResult(messages, False, None, {**info, "finish": None})
