"""Parse a model turn's text into tool calls with SGLang's function-call parsers, flagging malformed calls.

`ToolCallParser(parser, tools).parse(text)` returns a `ParsedTurn`: the normal text and the calls in order,
each with its name and raw argument JSON, or, for a call that could not be parsed, the reason and the raw
text. It never raises for what the model wrote: a malformed call becomes a call with `error` set, which
`ParsedTurn.assistant_message()` passes on as `"malformed"` so that the environment's `ToolExecutor`
answers and counts it (`megagrpo.envs.tools`).

`parser` is SGLang's `--tool-call-parser` name for the model family: `qwen25` (alias `qwen`) for Qwen2.5
and Qwen3's `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, `qwen3_coder`, `hermes`,
`llama3`, `deepseekv3`, `mistral`, ... (`sglang.srt.function_call.parser_names`).

What SGLang's parsers do on their own, and what is added here:
- SGLang drops a call to a tool the request did not declare; here it is kept (SGLang's own
  `SGLANG_FORWARD_UNKNOWN_TOOLS` switch), so the model is told the tool is unknown. SGLang reads the switch
  from the process environment at each parse and has no per-parser setting, so it is set once, when the
  first parser is built, and never written again: rewriting it per parse raced `getenv` in other threads
  (native code among them). It changes nothing else here, since the engines of this process are sent ids
  and parse no tool calls. SGLang's per-call warnings are muted once, the same way (the caller counts).
- SGLang logs and drops a call whose JSON is invalid, and raises on JSON that is not an object. When the
  parser found fewer calls than the text has call markers (the detector's `bot_token`), or raised, the
  text is re-parsed one marker-delimited segment at a time, and each segment that yields no call becomes
  a malformed call (invalid JSON, no closing tag, ...). Formats with one marker per call (Qwen, Hermes,
  GLM) so flag each bad call; formats with one marker around all calls (DeepSeek) flag a bad block.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagrpo.errors import MegagrpoError

_FORWARD_UNKNOWN = "SGLANG_FORWARD_UNKNOWN_TOOLS"
_SETUP_LOCK = threading.Lock()
_RAW_SHOWN = 200  # characters of a malformed call's text quoted back to the model


@dataclass
class ParsedToolCall:
    """One call: `name` and `arguments` (the raw JSON of its arguments), or `error` when it is malformed
    (then `arguments` holds the call's raw text, cut to a few hundred characters)."""

    name: str | None
    arguments: str
    error: str | None = None

    def openai(self, call_id: str) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name or "", "arguments": self.arguments},
        }
        if self.error is not None:
            call["malformed"] = self.error
        return call


@dataclass
class ParsedTurn:
    """A model turn split into its normal text and its tool calls (well-formed and malformed, in order)."""

    text: str
    calls: list[ParsedToolCall] = field(default_factory=list)

    @property
    def malformed(self) -> list[ParsedToolCall]:
        return [c for c in self.calls if c.error is not None]

    def assistant_message(self, id_prefix: str = "call") -> dict[str, Any]:
        """The OpenAI-style assistant message; call ids are `{id_prefix}_{i}` (make the prefix unique per turn)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            msg["tool_calls"] = [c.openai(f"{id_prefix}_{i}") for i, c in enumerate(self.calls)]
        return msg


def sglang_names(module: str, attr: str) -> tuple[str, ...]:
    """A list of names from one of SGLang's dependency-free modules (`module` relative to `sglang/srt`),
    read by path: importing it as `sglang.srt...` would first run the `sglang` package's `__init__`
    (seconds: transformers, torch distributed), which the CLI's checks before any process starts should
    not pay."""
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    path = Path(spec.submodule_search_locations[0], "srt", *module.split("/"))
    module_spec = importlib.util.spec_from_file_location(f"_megagrpo_sglang_{path.stem}", path)
    loaded = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(loaded)
    return tuple(getattr(loaded, attr))


@functools.cache
def parser_names() -> tuple[str, ...]:
    """SGLang's tool-call parser names (`sglang_names`)."""
    return sglang_names("function_call/parser_names.py", "TOOL_CALL_PARSER_NAMES")


def _keep_unknown_tools() -> None:
    """Set SGLang's process-wide switches (module doc), writing the environment only while it lacks the
    switch, so in practice once: unknown tools kept, per-call warnings muted."""
    with _SETUP_LOCK:
        if os.environ.get(_FORWARD_UNKNOWN) != "1":
            os.environ[_FORWARD_UNKNOWN] = "1"
        logging.getLogger("sglang.srt.function_call").setLevel(logging.ERROR)


def check_parser_name(parser: str, where: str = "rollout.multi_turn.tool_parser") -> None:
    """Raise a `MegagrpoError` naming `where` and the choices when SGLang has no parser of that name."""
    TOOL_CALL_PARSER_NAMES = parser_names()
    if parser not in TOOL_CALL_PARSER_NAMES:
        raise MegagrpoError(
            f"{where}: {parser!r} is not an SGLang tool-call parser; choose one of "
            f"{', '.join(TOOL_CALL_PARSER_NAMES)} (qwen25 for Qwen2.5/Qwen3's <tool_call> format)"
        )


class ToolCallParser:
    """SGLang's function-call parser for one model family and one set of tools (OpenAI function schemas)."""

    def __init__(
        self, parser: str, tools: list[dict[str, Any]], where: str = "rollout.multi_turn.tool_parser"
    ) -> None:
        check_parser_name(parser, where)
        from sglang.srt.entrypoints.openai.protocol import Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        _keep_unknown_tools()
        self.name = parser
        self._sgl = FunctionCallParser([Tool.model_validate(t) for t in tools], parser)
        bot = getattr(self._sgl.detector, "bot_token", "")
        self._marker = bot.strip() if isinstance(bot, str) else ""

    def parse(self, text: str) -> ParsedTurn:
        """Split one generated turn into normal text and tool calls; never raises for the text's content."""
        markers = text.count(self._marker) if self._marker else 0
        try:
            normal, items = self._sgl_parse(text)
        except (AttributeError, TypeError, ValueError, KeyError):  # e.g. a call whose JSON is a list of str
            normal, items = None, None
        if items is not None and len(items) >= markers:
            return ParsedTurn(normal, [_from_item(it) for it in items])
        if not self._marker:  # no marker to split on: the whole text is one bad call
            return ParsedTurn(
                text, [ParsedToolCall(None, text[:_RAW_SHOWN], "the tool calls could not be parsed")]
            )
        return self._parse_segments(text)

    def _parse_segments(self, text: str) -> ParsedTurn:
        """Parse each marker-delimited segment alone, so one bad call does not hide or sink the others."""
        starts = [m.start() for m in re.finditer(re.escape(self._marker), text)]
        calls: list[ParsedToolCall] = []
        for a, b in zip(starts, [*starts[1:], len(text)]):
            segment = text[a:b]
            try:
                _, items = self._sgl_parse(segment)
                problem = None
            except (AttributeError, TypeError, ValueError, KeyError) as e:
                items, problem = [], f"{type(e).__name__}: {e}"
            if items:
                calls.extend(_from_item(it) for it in items)
            else:
                calls.append(ParsedToolCall(None, segment[:_RAW_SHOWN], problem or self._why(segment)))
        return ParsedTurn(text[: starts[0]].strip(), calls)

    def _why(self, segment: str) -> str:
        """The likely reason a segment gave no call, in words the model can act on."""
        eot = getattr(self._sgl.detector, "eot_token", "")
        if isinstance(eot, str) and eot.strip() and eot.strip() not in segment:
            return f"the tool call has no closing {eot.strip()}"
        bot = getattr(self._sgl.detector, "bot_token", self._marker)
        form = f'{bot}{{"name": ..., "arguments": {{...}}}}{eot if isinstance(eot, str) else ""}'
        return f"the tool call could not be parsed; write it as {form} with valid JSON"

    def _sgl_parse(self, text: str) -> tuple[str, list[Any]]:
        """SGLang's parse, unknown tools kept (`_keep_unknown_tools`, set when this parser was built)."""
        return self._sgl.parse_non_stream(text)


def _from_item(item: Any) -> ParsedToolCall:
    """An SGLang `ToolCallItem` as a call; one without a name is malformed."""
    if not item.name:
        return ParsedToolCall(None, item.parameters, 'the tool call names no function (a "name" field)')
    return ParsedToolCall(item.name, item.parameters)
