"""Prompt rendering through the tiny model's chat template; too-long prompts become malformed rows."""

from __future__ import annotations

import json

import pytest

from megagrpo.config import DataConfig, SyntheticConfig
from megagrpo.data import PromptFormatter, build_prompt_sets
from megagrpo.errors import MegagrpoError
from megagrpo.tiny_model import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(1024)


def test_chat_template_and_prompt_template(tok):
    cfg = DataConfig.model_validate(
        {"train_path": "x.jsonl", "prompt_template": "Q: {prompt} ({task})", "system_prompt": "Be brief."}
    )
    fmt = PromptFormatter(tok, cfg)
    p = fmt({"prompt": "1 + 2?", "task": "add"})
    assert p.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 1 + 2? (add)<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(p.input_ids) == p.text
    msgs = [{"role": "user", "content": "hi"}]
    assert fmt({"prompt": msgs}).text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    raw = PromptFormatter(tok, cfg.model_copy(update={"use_chat_template": False, "system_prompt": None}))
    assert raw({"prompt": "1 + 2?", "task": "t"}).text == "Q: 1 + 2? (t)"


def test_sft_example_ends_with_eos(tok):
    fmt = PromptFormatter(tok, DataConfig(synthetic=SyntheticConfig(task="addition")))
    prompt, completion = fmt.sft_example({"prompt": "What is 1 + 2?", "completion": "<answer>3</answer>"})
    assert completion[-1] == tok.eos_token_id and tok.decode(completion[:-1]) == "<answer>3</answer>"
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")


def test_missing_chat_template_is_a_config_error(tok):
    import copy

    no_template = copy.deepcopy(tok)
    no_template.chat_template = None
    with pytest.raises(MegagrpoError, match="data.use_chat_template"):
        PromptFormatter(no_template, DataConfig(synthetic=SyntheticConfig(task="addition")))


def test_long_prompts_and_unfillable_templates_are_malformed_rows(tok, tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [
        {"prompt": "short", "answer": "1"},
        {"prompt": "word " * 200, "answer": "2"},
        {"q": 1, "prompt": "x {y}", "answer": 3},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig.model_validate(
        {
            "train_path": str(p),
            "max_prompt_tokens": 64,
            "heldout_fraction": 0.0,
            "prompt_template": "{prompt} [{answer}]",
        }
    )
    sets = build_prompt_sets(cfg, PromptFormatter(tok, cfg))
    assert [r["prompt"] for r in sets.train] == ["short", "x {y}"]
    assert sets.malformed == 1 and "above data.max_prompt_tokens=64" in sets.reports[str(p)].examples[0]
    bad = cfg.model_copy(update={"prompt_template": "{prompt} {missing}", "malformed": "fatal"})
    with pytest.raises(
        MegagrpoError, match=r"t.jsonl:1: malformed row: data.prompt_template cannot be filled"
    ):
        build_prompt_sets(bad, PromptFormatter(tok, bad))


def test_synthetic_sets_respect_eval_cap(tok):
    cfg = DataConfig(
        synthetic=SyntheticConfig(task="addition", num_train=30, num_eval=20), max_eval_prompts=5
    )
    sets = build_prompt_sets(cfg, PromptFormatter(tok, cfg))
    assert len(sets.train) == 30 and len(sets.heldout) == 5
