"""Reasoning split with SGLang's parsers: SGLang's rule for a turn that starts inside its reasoning, a
generation prompt that opens `<think>` itself, and a cut turn that never closed its reasoning."""

from __future__ import annotations

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.episodes.reasoning import (
    ReasoningSplitter,
    SplitTurn,
    check_reasoning_parser,
    starts_in_reasoning,
)


@pytest.mark.parametrize(
    ("default", "kwargs", "forced"),
    [
        ("always", {}, True),
        ("enable_thinking", {}, True),  # Qwen3 thinks unless told not to
        ("enable_thinking", {"enable_thinking": False}, False),
        ("explicit_thinking", {}, False),
        ("explicit_thinking", {"thinking": True}, True),
        (None, {"enable_thinking": True}, False),
    ],
)
def test_starts_in_reasoning_follows_sglang_s_defaults(default, kwargs, forced):
    assert starts_in_reasoning(default, kwargs) is forced


def test_a_generation_prompt_that_opens_think_puts_the_turn_inside_its_reasoning():
    s = ReasoningSplitter("qwen3", {"enable_thinking": False})  # not forced by the template options
    assert s.split("done</think>\n\n<answer>4</answer>") == SplitTurn(
        "", "done</think>\n\n<answer>4</answer>"
    )
    assert s.opens("<|im_start|>assistant\n<think>\n") and not s.opens(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert s.split("done</think>\n\n<answer>4</answer>", opened=True) == SplitTurn(
        "done", "\n\n<answer>4</answer>"
    )
    cut = s.split("still <answer>4</answer> thinking", cut=True, opened=True)
    assert cut == SplitTurn("still <answer>4</answer> thinking", "", unclosed=True)
    assert s.split("no reasoning here", cut=True) == SplitTurn(
        "", "no reasoning here"
    )  # cut, not in reasoning


def test_an_unknown_reasoning_parser_names_the_field_and_the_choices():
    check_reasoning_parser(None)
    with pytest.raises(
        MegagrpoError, match=r"rollout\.multi_turn\.reasoning_parser: 'qwen-3' is not .*qwen3"
    ):
        ReasoningSplitter("qwen-3")
