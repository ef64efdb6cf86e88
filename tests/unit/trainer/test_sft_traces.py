"""SFT on multi-turn traces (issue 26): a gold tool-use trace tokenises into exactly the ids that a rollout
of the same conversation builds (the environment's prompt, the model's turns as generated, the template's
glue and tool results between them), with the loss on the model's turns only, each with its EOS."""

from __future__ import annotations

import random

import pytest
import torch

from megagrpo.config import DataConfig, SyntheticConfig, config_from_dict
from megagrpo.data.synthetic import tool_arithmetic_problem
from megagrpo.data.template import PromptFormatter
from megagrpo.envs.calculator import DEFAULT_SYSTEM_PROMPT, CalculatorEnv
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits, rollout_episodes
from megagrpo.trainer.batch import sft_batch
from megagrpo.trainer.sft import TraceExamples
from tests.fixtures.qwen3 import qwen3_tokenizer
from tests.unit.rollout.test_multi_turn import SAMPLING, ScriptedEngine, tok  # noqa: F401

MAX_TURNS, MAX_TOKENS, MAX_NEW = 2, 160, 96


def _cfg(max_new_tokens=MAX_NEW, max_turns=MAX_TURNS, max_tokens=MAX_TOKENS, template_kwargs=None):
    mt = {"enabled": True, "environment": "calculator", "max_turns": max_turns, "max_tokens": max_tokens}
    model = {"hf_path": "m", "chat_template_kwargs": template_kwargs or {}}
    return config_from_dict({"model": model, "rollout": {"max_new_tokens": max_new_tokens, "multi_turn": mt}})


def _traces(tok, cfg):  # noqa: F811
    data = DataConfig(synthetic=SyntheticConfig(task="tool_arithmetic"))
    return TraceExamples(cfg, PromptFormatter(tok, data, cfg.model.chat_template_kwargs), "sft.data")


def _rows(n=3, tool_fraction=1.0):
    rng = random.Random(0)
    return [tool_arithmetic_problem(rng, 2, 4, tool_fraction) for _ in range(n)]


def test_trace_tokenises_as_the_rollout_of_its_turns(tok):  # noqa: F811
    rows = _rows() + _rows(4, tool_fraction=0.0)[3:]  # three tool-use traces, then a direct answer
    examples, masks = _traces(tok, _cfg())(rows)
    # the rollout: an engine that generates the trace's assistant turns, the real calculator environment
    scripts = {r["prompt"]: [m["content"] for m in r["trace"] if m["role"] == "assistant"] for r in rows}
    eng = ScriptedEngine(tok, scripts)
    try:
        groups, _ = rollout_episodes(
            eng, rows, CalculatorEnv, SAMPLING, MultiTurnLimits(MAX_TURNS, MAX_TOKENS)
        )
    finally:
        eng.close()
    eos = tok.eos_token_id
    for row, (prompt, response), mask, [ep] in zip(rows, examples, masks, groups, strict=True):
        t = ep.trajectory
        turns = scripts[row["prompt"]]
        assert (ep.done, ep.reward, t.turns) == (True, 1.0, len(turns)), "the gold trace solves the problem"
        assert t.ids.tolist() == prompt + response
        assert t.loss_mask.tolist() == [False] * len(prompt) + mask
        # and against the template itself: the loss covers the model's turns with their EOS, nothing else
        ids, on = torch.tensor(response), torch.tensor(mask)
        assert ids[on].tolist() == [
            x for turn in turns for x in [*tok(turn, add_special_tokens=False)["input_ids"], eos]
        ]
        assert tok.decode(prompt) == (
            f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{row['prompt']}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        between = f"\n<|im_start|>tool\n{row['answer']}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(ids[~on].tolist()) == (between if len(turns) == 2 else "")
        assert response[-1] == eos and tok.decode(response).endswith(f"{turns[-1]}<|im_end|>")


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
def test_traces_render_with_the_model_s_template_options_as_rollouts_do(thinking):
    """model.chat_template_kwargs reach SFT traces and rollouts alike: with Qwen3's template and thinking
    off, both open each model turn with the empty <think> block the generation prompt writes."""
    from megagrpo.tiny_model import train_tokenizer

    qtok = qwen3_tokenizer(train_tokenizer(1024))
    cfg = _cfg(template_kwargs={"enable_thinking": thinking})
    rows = _rows(2)
    examples, _ = _traces(qtok, cfg)(rows)
    scripts = {r["prompt"]: [m["content"] for m in r["trace"] if m["role"] == "assistant"] for r in rows}
    eng = ScriptedEngine(qtok, scripts)
    try:
        groups, _ = rollout_episodes(
            eng, rows, CalculatorEnv, SAMPLING, MultiTurnLimits(MAX_TURNS, MAX_TOKENS),
            template_kwargs=cfg.model.chat_template_kwargs,
        )  # fmt: skip
    finally:
        eng.close()
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for (prompt, response), [ep] in zip(examples, groups, strict=True):
        assert ep.trajectory.ids.tolist() == prompt + response and ep.reward == 1.0
        text = qtok.decode(prompt + response)
        assert text.count(empty_think) == (0 if thinking else 2), text
    fmt = PromptFormatter(
        qtok, DataConfig(synthetic=SyntheticConfig(task="addition")), {"enable_thinking": thinking}
    )
    assert fmt.text({"prompt": "1 + 1"}).endswith(empty_think) != thinking  # single-turn prompts too


def test_sft_batch_takes_the_loss_where_the_masks_say():
    examples = [([1, 2], [3, 4, 5]), ([6], [7])]
    batch = sft_batch(examples, pad_id=0, completion_masks=[[True, False, True], [True]])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [
        [False, False, True, False, True],
        [False, True, False, False, False],
    ]
    single = sft_batch(examples, pad_id=0)
    assert single["loss_mask"].tolist() == [
        [False, False, True, True, True],
        [False, True, False, False, False],
    ]
    assert torch.equal(single["seq_lens"], batch["seq_lens"])
    with pytest.raises(ValueError, match="mask of 2 for 3"):
        sft_batch(examples, pad_id=0, completion_masks=[[True, True], [True]])


@pytest.mark.parametrize(
    "limits, field",
    [
        ({"max_new_tokens": 40}, "rollout.max_new_tokens=40"),
        ({"max_turns": 1}, "rollout.multi_turn.max_turns=1"),
        ({"max_tokens": 100}, "rollout.multi_turn.max_tokens=100"),
    ],
)
def test_a_trace_the_rollout_limits_would_cut_is_refused(tok, limits, field):  # noqa: F811
    with pytest.raises(MegagrpoError, match=rf"synthetic:tool_arithmetic:train:7: its trace has .*{field}"):
        _traces(tok, _cfg(**limits))([{**_rows(1)[0], "_source": "synthetic:tool_arithmetic:train:7"}])


def test_a_row_without_a_trace_is_refused(tok):  # noqa: F811
    row = {k: v for k, v in _rows(1)[0].items() if k != "trace"}
    with pytest.raises(MegagrpoError, match="sft.data: a row has no 'trace'"):
        _traces(tok, _cfg())([row])
