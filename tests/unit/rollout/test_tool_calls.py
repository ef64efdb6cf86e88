"""Tool-call parsing with SGLang's parsers on real Qwen-format turns: none, one, two, malformed, unknown."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from megagrpo.envs.calculator import calculator_tool
from megagrpo.envs.tools import ToolCounters, ToolExecutor
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.episodes.tool_calls import ToolCallParser

TOOLS = [calculator_tool().schema()]


def _qwen(name: str, arguments: dict) -> str:
    """A call exactly as Qwen2.5/Qwen3's chat template writes it (and the models generate it)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def qwen():
    return ToolCallParser("qwen25", TOOLS)


def test_no_call_is_all_text(qwen):
    turn = qwen.parse("The sum is <answer>579</answer>")
    assert turn.text == "The sum is <answer>579</answer>" and turn.calls == []
    assert turn.assistant_message() == {"role": "assistant", "content": turn.text}


def test_one_call(qwen):
    turn = qwen.parse("I will use the calculator.\n" + _qwen("calculator", {"expression": "123 * 456"}))
    assert turn.text == "I will use the calculator."
    [call] = turn.calls
    assert (call.name, json.loads(call.arguments), call.error) == (
        "calculator",
        {"expression": "123 * 456"},
        None,
    )


def test_two_calls_in_order(qwen):
    text = _qwen("calculator", {"expression": "1+1"}) + "\n" + _qwen("calculator", {"expression": "2*3"})
    turn = qwen.parse(text)
    assert turn.text == ""
    assert [json.loads(c.arguments)["expression"] for c in turn.calls] == ["1+1", "2*3"]
    msg = turn.assistant_message("call_t1")
    assert [c["id"] for c in msg["tool_calls"]] == ["call_t1_0", "call_t1_1"]
    assert msg["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "1+1"}'}


def test_malformed_json_is_flagged_and_the_good_call_kept(qwen, caplog):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}\n</tool_call>'  # one brace short
    with caplog.at_level(logging.WARNING):
        turn = qwen.parse(bad + "\n" + _qwen("calculator", {"expression": "2*3"}))
    assert [c.name for c in turn.calls] == [None, "calculator"]
    assert "could not be parsed" in turn.calls[0].error and turn.calls[0].arguments.startswith("<tool_call>")
    assert turn.calls[1].error is None and turn.malformed == [turn.calls[0]]
    assert not [r for r in caplog.records if r.name.startswith("sglang")]  # counted, not logged per call


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+', "no closing </tool_call>"),
        ('<tool_call>\n"calculator(1+1)"\n</tool_call>', "AttributeError"),  # SGLang raises on a non-object
        ('<tool_call>\n{"arguments": {"expression": "1"}}\n</tool_call>', "names no function"),
        (
            '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
            "could not be parsed",
        ),  # no newlines
    ],
)
def test_each_malformed_shape_is_flagged_never_raised(qwen, text, reason):
    turn = qwen.parse("Let me compute. " + text)
    [call] = turn.calls
    assert call.error is not None and reason in call.error


def test_unknown_tool_is_kept_for_the_executor(qwen):
    [call] = qwen.parse(_qwen("web_search", {"query": "x"})).calls
    assert (call.name, call.error) == ("web_search", None)


def test_parsed_turn_feeds_the_executor_which_answers_and_counts_each_call(qwen):
    text = "\n".join(
        [
            _qwen("calculator", {"expression": "99999999999 * 99999999999"}),
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',
            _qwen("web_search", {"query": "x"}),
            _qwen("calculator", {"expr": "1"}),
        ]
    )
    msg = qwen.parse(text).assistant_message()
    counters = ToolCounters()
    results = asyncio.run(ToolExecutor([calculator_tool()]).call_all(msg["tool_calls"], counters))
    assert [r.status for r in results] == ["ok", "malformed", "unknown_tool", "malformed"]
    assert results[0].content == str(99999999999**2)
    assert counters.as_dict() == {
        "tool_calls": 4,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "malformed_calls": 2,
        "unknown_tools": 1,
        "oversize_results": 0,
        "interrupted_calls": 0,
        "unisolated_calls": 0,
        "refused_calls": 0,
    }


def test_parser_is_chosen_by_name():
    hermes = ToolCallParser("hermes", TOOLS)  # Hermes: the same tags, newlines optional
    [call] = hermes.parse(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "7"}}</tool_call>'
    ).calls
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "7"})
    assert (
        ToolCallParser("qwen", TOOLS).parse(_qwen("calculator", {"expression": "1"})).calls[0].name
        == "calculator"
    )


def test_unknown_parser_names_the_field_and_the_choices():
    with pytest.raises(MegagrpoError, match=r"rollout\.multi_turn\.tool_parser: 'qwen2\.5' is not .*qwen25"):
        ToolCallParser("qwen2.5", TOOLS)


class _WatchedEnviron(dict):
    """`os.environ` stand-in that records every write (SGLang reads the switch through `os.getenv`)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.writes: list[str] = []

    def __setitem__(self, key, value) -> None:
        self.writes.append(key)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.writes.append(key)
        super().__delitem__(key)

    def pop(self, key, *default):
        self.writes.append(key)
        return super().pop(key, *default)


def test_the_unknown_tools_switch_is_set_once_and_never_written_during_parses(qwen, monkeypatch):
    """SGLang reads SGLANG_FORWARD_UNKNOWN_TOOLS from the process environment; rewriting it per parse
    raced other threads' getenv. Built parsers leave it set; parses read it and write nothing."""
    import os

    watched = _WatchedEnviron(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    for _ in range(3):
        [call] = qwen.parse(_qwen("web_search", {"query": "x"})).calls
        assert call.name == "web_search"  # kept: the switch is on while parsing
        assert watched.get("SGLANG_FORWARD_UNKNOWN_TOOLS") == "1"  # and stays on between parses
    assert watched.writes == [], f"parses wrote the process environment: {watched.writes}"
    ToolCallParser("qwen25", TOOLS)  # a second parser finds it set
    assert watched.writes == []
