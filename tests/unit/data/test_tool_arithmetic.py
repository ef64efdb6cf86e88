"""The synthetic tool_arithmetic task (products for the calculator environment, with gold tool-use traces)
and the checks of a trace's shape when it is rendered for SFT."""

from __future__ import annotations

import json

import pytest

from megagrpo.config import DataConfig, SyntheticConfig
from megagrpo.data.sources import RowError
from megagrpo.data.synthetic import generate
from megagrpo.data.template import PromptFormatter
from megagrpo.envs.calculator import evaluate
from megagrpo.rollout.episodes.chat_delta import ChatDeltas
from megagrpo.tiny_model import train_tokenizer


def test_products_with_a_trace_that_calls_the_calculator():
    cfg = SyntheticConfig(
        task="tool_arithmetic", min_digits=2, max_digits=4, num_train=200, num_eval=50, seed=3
    )
    train, heldout = generate(cfg)
    assert (train, heldout) == generate(cfg), "seeded"
    assert {(s["a"], s["b"]) for s in train}.isdisjoint({(s["a"], s["b"]) for s in heldout})
    for s in train + heldout:
        assert 10 <= s["a"] < 10_000 and 10 <= s["b"] < 10_000 and s["answer"] == str(s["a"] * s["b"])
        call, result, final = s["trace"]
        assert (call["role"], result["role"], final["role"]) == ("assistant", "tool", "assistant")
        assert call["content"].startswith("<tool_call>\n") and call["content"].endswith("\n</tool_call>")
        parsed = json.loads(call["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert parsed["name"] == "calculator" == result["name"]
        assert str(evaluate(parsed["arguments"]["expression"])) == result["content"] == s["answer"]
        assert final["content"] == s["completion"] == f"<answer>{s['answer']}</answer>"
        assert s["prompt"] == f"What is {s['a']} * {s['b']}?"


def test_tool_fraction_mixes_in_direct_answers_to_the_same_problems():
    base = dict(task="tool_arithmetic", min_digits=3, max_digits=4, num_train=400, num_eval=20, seed=3)
    always, mixed = (generate(SyntheticConfig(**base, tool_fraction=f))[0] for f in (1.0, 0.5))
    assert [(s["a"], s["b"]) for s in always] == [(s["a"], s["b"]) for s in mixed]
    direct = [s for s in mixed if len(s["trace"]) == 1]
    assert 150 < len(direct) < 250
    for s in direct:
        assert s["trace"] == [{"role": "assistant", "content": s["completion"]}]
    for s in mixed:
        if len(s["trace"]) != 1:
            assert s["trace"] == next(t for t in always if t["_source"] == s["_source"])["trace"]


@pytest.fixture(scope="module")
def fmt():
    tok = train_tokenizer(1024)
    return PromptFormatter(tok, DataConfig(synthetic=SyntheticConfig(task="tool_arithmetic")))


ASSISTANT = {"role": "assistant", "content": "<answer>1</answer>"}
TOOL = {"role": "tool", "name": "calculator", "content": "1"}


@pytest.mark.parametrize(
    "trace, problem",
    [
        ([], "non-empty list"),
        ([TOOL, ASSISTANT], "start and end with an assistant turn"),
        ([ASSISTANT, TOOL], "start and end with an assistant turn"),
        ([ASSISTANT, ASSISTANT], r"trace\[1\] follows an assistant turn directly"),
        ([ASSISTANT, {"role": "tool", "content": None}, ASSISTANT], r"trace\[1\] has no string content"),
    ],
)
def test_a_malformed_trace_is_a_row_error(fmt, trace, problem):
    chat = ChatDeltas(fmt.tok)
    with pytest.raises(RowError, match=problem):
        fmt.sft_trace_example(chat, [{"role": "user", "content": "What is 1 * 1?"}], trace)


def test_a_one_turn_trace_is_the_single_turn_example(fmt):
    sample = {"prompt": "What is 1 * 1?", "completion": "<answer>1</answer>"}
    prompt, response, mask = fmt.sft_trace_example(ChatDeltas(fmt.tok), fmt.messages(sample), [ASSISTANT])
    assert (prompt, response) == fmt.sft_example(sample) and all(mask)
