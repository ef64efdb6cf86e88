"""ChatDeltas: template deltas with the tiny model's own tokenizer; the model's ids are never re-tokenised,
`tools=` reaches the template, and a template that is not append-only is refused with its name."""

from __future__ import annotations

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.chat_delta import ChatDeltas
from megagrpo.rollout.trajectory import Trajectory

# Qwen2.5's tool layout, cut down: tools in the system turn, consecutive tool results grouped in one user turn
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's reasoning rule, cut down: an assistant turn before the last user turn loses its <think> part
QWEN3_THINK_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.last_user %}{% set c = m.content.split('</think>')[-1] %}"
    "{% else %}{% set c = m.content %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ c }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.fixture
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _chars(tok, text: str) -> list[int]:
    """Ids of `text` one byte-level character each: the engine may sample these where the tokenizer merges."""
    ids = tok.convert_tokens_to_ids(list(text.replace(" ", "Ġ")))
    assert tok.unk_token_id not in ids and None not in ids
    return ids


def test_deltas_keep_the_generated_ids_where_re_encoding_would_merge(tok):
    assert tok.chat_template, "the tiny model ships a chat template"
    d = ChatDeltas(tok)
    prompt = d.prompt([{"role": "user", "content": "add 12 and 34"}])
    gen1 = [*_chars(tok, " model"), tok.eos_token_id]  # stopped on <|im_end|>
    text1 = tok.decode(gen1[:-1])
    assert tok(text1, add_special_tokens=False)["input_ids"] != gen1[:-1], "re-encoding gives other ids"
    glue1 = d.close_model_turn(gen1)
    assert (
        glue1 == tok("\n", add_special_tokens=False)["input_ids"]
    )  # <|im_end|> was generated; only "\n" added
    env = d.append([{"role": "user", "content": "again"}])
    gen2 = _chars(tok, "the")  # cut by the token limit: no end-of-turn token
    glue2 = d.close_model_turn(gen2)
    assert glue2 == tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]

    t = Trajectory(prompt)
    t.add_turn([], gen1, [-0.5] * len(gen1), version=0)
    t.add_turn(glue1 + env, gen2, [-0.25] * len(gen2), version=1, finish_reason="length")
    ids = t.ids.tolist()
    assert ids == prompt + gen1 + glue1 + env + gen2
    assert t.ids[t.loss_mask].tolist() == gen1 + gen2  # the loss is on the engine's ids, not re-encoded ones
    assert t.versions[t.loss_mask].tolist() == [0] * len(gen1) + [1] * len(gen2)
    # the ids spell out the template's rendering of the conversation, closing glue included
    msgs = d.messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == " model" and msgs[3]["content"] == "the"
    assert tok.decode(ids + glue2) == d.render(msgs, add_generation_prompt=False) == d.text


def test_tools_reach_the_template_and_one_step_s_tool_results_go_in_together(tok):
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    d = ChatDeltas(tok, tools=TOOLS)
    prompt = d.prompt([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "12 + 34?"}])
    assert '"name": "add"' in tok.decode(prompt)
    call = tok("<tool_call>add</tool_call>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    d.close_model_turn(call)
    env = d.append([{"role": "tool", "content": "46"}, {"role": "tool", "content": "ok"}])
    assert tok.decode(env) == (
        "<|im_start|>user\n<tool_response>\n46\n</tool_response>\n<tool_response>\nok\n</tool_response>\n"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_drops_earlier_reasoning_is_refused_with_its_name(tok, model_dir):
    tok.chat_template = QWEN3_THINK_TEMPLATE
    d = ChatDeltas(tok)
    d.prompt([{"role": "user", "content": "12 + 34?"}])
    d.close_model_turn(
        tok("<think>carry 1</think>46", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    )
    d.append([{"role": "tool", "content": "ok"}])  # no new user turn: the reasoning stays, append-only
    d.close_model_turn([tok.eos_token_id])
    held = (list(d.messages), d.text)
    # a user turn makes the template drop the reasoning of the turns before it: the ids held would be stale
    with pytest.raises(MegagrpoError, match=rf"chat template of {model_dir} .*messages\[4\] \(role 'user'\)"):
        d.append([{"role": "user", "content": "again"}])
    assert (d.messages, d.text) == held  # the failed step appended nothing


def test_a_template_that_rewrites_the_model_s_turn_is_refused(tok, model_dir):
    tok.chat_template = tok.chat_template.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    d = ChatDeltas(tok)
    d.prompt([{"role": "user", "content": "hi"}])
    with pytest.raises(
        MegagrpoError, match=rf"{model_dir} is not append-only for messages\[1\] \(role 'assistant'\)"
    ):
        d.close_model_turn([*_chars(tok, " model"), tok.eos_token_id])


def test_a_template_error_names_the_template(tok):
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(MegagrpoError, match="chat template of .*roles must alternate"):
        ChatDeltas(tok, template_name="my-template").prompt([{"role": "user", "content": "hi"}])
