"""Split a model turn's reasoning off its answer with SGLang's reasoning parsers, before tool calls and
answers are read (`rollout.multi_turn.reasoning_parser`).

`ReasoningSplitter(name, template_kwargs).split(text, cut=...)` returns a `SplitTurn`: the reasoning, the
content (what the environment reads: tool calls, `<answer>`) and whether the turn ended inside its
reasoning. `name` is SGLang's `--reasoning-parser` name for the model family (`qwen3` for Qwen3's
`<think>...</think>`, `deepseek-r1`, `glm45`, ...: `sglang.srt.parser.reasoning_parser_names`).

Whether a turn starts inside its reasoning is decided as SGLang's OpenAI server decides it for a request
without a chat template of its own (`serving_chat._get_reasoning_from_request`): from the parser's
`reasoning_default` and the chat-template kwargs, so Qwen3 with `enable_thinking` not false reads every
turn as reasoning until `</think>` (the `<think>` the model writes is dropped), and with it false reads the
turn as content; and also when the generation prompt itself leaves a reasoning block open (a template that
writes `<think>` for the model, as Qwen3's thinking-only releases do).

A cut turn (stopped by a token limit) that never closed its reasoning is all reasoning: no tool call, no
answer. SGLang's Qwen3 parser otherwise ends reasoning at a `<tool_call>` (a Qwen3.5 habit), which for a
cut turn would run a call the model wrote while still thinking.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.episodes.tool_calls import sglang_names


@dataclass(frozen=True)
class SplitTurn:
    """A model turn's text as `reasoning` and `content`; `unclosed`: it ended inside its reasoning."""

    reasoning: str
    content: str
    unclosed: bool = False


@functools.cache
def reasoning_parser_names() -> tuple[str, ...]:
    """SGLang's reasoning parser names (read without importing SGLang: `tool_calls.sglang_names`)."""
    return sglang_names("parser/reasoning_parser_names.py", "REASONING_PARSER_NAMES")


def check_reasoning_parser(name: str | None, where: str = "rollout.multi_turn.reasoning_parser") -> None:
    """Raise a `MegagrpoError` naming `where` and the choices when SGLang has no reasoning parser `name`."""
    if name is None:
        return
    names = reasoning_parser_names()
    if name not in names:
        raise MegagrpoError(
            f"{where}: {name!r} is not an SGLang reasoning parser; choose one of {', '.join(names)} "
            "(qwen3 for Qwen3's <think>...</think>), or null for a model that does not reason"
        )


def starts_in_reasoning(default: str | None, template_kwargs: dict[str, Any]) -> bool:
    """SGLang's read-side rule for a parser's `reasoning_default` (module doc): whether a turn starts inside
    the reasoning block without writing its opening tag."""
    if default == "always":
        return True
    if default in ("thinking", "enable_thinking"):
        return template_kwargs.get(default) is not False
    if default in ("explicit_thinking", "explicit_enable_thinking"):
        return template_kwargs.get(default.removeprefix("explicit_")) is True
    return False


class ReasoningSplitter:
    """SGLang's reasoning parser `name` for one conversation's chat-template kwargs (module doc)."""

    def __init__(self, name: str, template_kwargs: dict[str, Any] | None = None) -> None:
        check_reasoning_parser(name)
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        self.name, self._cls = name, ReasoningParser
        probe = ReasoningParser(model_type=name, stream_reasoning=False).detector
        self.start = getattr(probe, "think_start_token", "") or ""
        self.end = getattr(probe, "think_end_token", "") or ""
        self.forced = starts_in_reasoning(getattr(probe, "reasoning_default", None), template_kwargs or {})

    def opens(self, generation_prompt: str) -> bool:
        """Whether a generation prompt leaves a reasoning block open (the template wrote `<think>`)."""
        if not self.start or self.start not in generation_prompt:
            return False
        return not self.end or generation_prompt.rfind(self.start) > generation_prompt.rfind(self.end)

    def _parse(self, text: str, forced: bool) -> tuple[str, str]:
        # A fresh parser per turn: some detectors keep a buffer across calls.
        parser = self._cls(model_type=self.name, stream_reasoning=False, force_reasoning=forced or None)
        reasoning, content = parser.parse_non_stream(text)
        return reasoning or "", content or ""

    def split(self, text: str, *, cut: bool = False, opened: bool = False) -> SplitTurn:
        """Reasoning and content of one turn's text; `cut`: it stopped at a token limit; `opened`: its
        generation prompt left a reasoning block open (`opens`)."""
        forced = self.forced or opened
        if cut and self.end and self.end not in text:
            # Close the block where the turn stopped: inside reasoning, everything is reasoning; outside,
            # the parser gives the text back with the added tag, which comes off again.
            reasoning, content = self._parse(text + self.end, forced)
            if not content:
                return SplitTurn(reasoning, "", unclosed=True)
        return SplitTurn(*self._parse(text, forced))
