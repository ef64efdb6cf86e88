"""ChatDeltas: template deltas with the tiny model's own tokenizer and with Qwen3's chat template (thinking on
and off); the model's ids are never re-tokenised and its text never re-rendered, `tools=` reaches the
template, and a template that is not append-only for an environment step is a `TemplateBreak` naming it."""

from __future__ import annotations

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.episodes.chat_delta import ChatDeltas, TemplateBreak
from megagrpo.rollout.episodes.trajectory import Trajectory
from tests.fixtures.qwen3 import qwen3_tokenizer

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
    assert d.close_model_turn(gen1) == " model"
    env = d.append([{"role": "user", "content": "again"}])
    # <|im_end|> was generated: the glue adds only "\n", then the user turn and the generation prompt
    assert tok.decode(env) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    gen2 = _chars(tok, "the")  # cut by the token limit: no end-of-turn token
    assert d.close_model_turn(gen2) == "the"
    env2 = d.append([{"role": "user", "content": "more"}])
    assert tok.decode(env2).startswith("<|im_end|>\n<|im_start|>user\nmore")  # the cut turn is closed

    t = Trajectory(prompt)
    t.add_turn([], gen1, [-0.5] * len(gen1), version=0)
    t.add_turn(env, gen2, [-0.25] * len(gen2), version=1, finish_reason="length")
    ids = t.ids.tolist()
    assert ids == prompt + gen1 + env + gen2
    assert t.ids[t.loss_mask].tolist() == gen1 + gen2  # the loss is on the engine's ids, not re-encoded ones
    assert t.versions[t.loss_mask].tolist() == [0] * len(gen1) + [1] * len(gen2)
    # the ids spell out the template's rendering of the conversation, closing glue included
    msgs = d.messages
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == " model" and msgs[3]["content"] == "the"
    assert tok.decode(ids + env2) == d.render(msgs, add_generation_prompt=True)


def test_tools_reach_the_template_and_one_step_s_tool_results_go_in_together(tok):
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    d = ChatDeltas(tok, tools=TOOLS)
    prompt = d.prompt([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "12 + 34?"}])
    assert '"name": "add"' in tok.decode(prompt)
    call = tok("<tool_call>add</tool_call>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert d.close_model_turn(call) == "<tool_call>add</tool_call>"
    env = d.append([{"role": "tool", "content": "46"}, {"role": "tool", "content": "ok"}])
    assert tok.decode(env) == (
        "\n<|im_start|>user\n<tool_response>\n46\n</tool_response>\n<tool_response>\nok\n</tool_response>\n"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_earlier_environment_text_is_a_template_break_naming_it(tok, model_dir):
    # the system turn counts the messages: every environment step rewrites the start of the conversation
    tok.chat_template = "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + tok.chat_template
    d = ChatDeltas(tok)
    d.prompt([{"role": "user", "content": "12 + 34?"}])
    d.close_model_turn([*_chars(tok, "46"), tok.eos_token_id])
    held = (list(d.messages), d._rendered)
    with pytest.raises(
        TemplateBreak,
        match=rf"chat template of {model_dir} is not append-only for messages\[2\] \(role 'tool'\)",
    ):
        d.append([{"role": "tool", "content": "ok"}])
    assert (d.messages, d._rendered) == held  # the failed step appended nothing
    assert issubclass(TemplateBreak, MegagrpoError)


def test_a_template_that_would_rewrite_the_model_s_turn_leaves_its_ids_as_generated(tok):
    # a template that trims assistant content cannot give back " model " byte for byte; it is never asked to
    tok.chat_template = tok.chat_template.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    d = ChatDeltas(tok)
    prompt = d.prompt([{"role": "user", "content": "hi"}])
    gen = [*_chars(tok, " model "), tok.eos_token_id]
    assert d.close_model_turn(gen) == " model "
    env = d.append([{"role": "user", "content": "again"}])
    assert tok.decode(env) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(prompt + gen + env).count(" model ") == 1


def test_a_template_error_names_the_template(tok):
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(MegagrpoError, match="chat template of .*roles must alternate"):
        ChatDeltas(tok, template_name="my-template").prompt([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------------ Qwen3's own chat template

PYTHON = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture
def qwen3(model_dir):
    from transformers import AutoTokenizer

    return qwen3_tokenizer(AutoTokenizer.from_pretrained(model_dir))


def _ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


TOOL_RESULT = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "turn",
    [
        "<think>\nI should run 6 * 7 in Python, so I will write <tool_call>",  # cut inside <think>
        "<think>Run it.</think>  \n<tool_call>\n{}\n</tool_call>",  # no newlines in, odd ones after
        "<think>\n\nRun it.\n\n\n</think>\n<tool_call>\n{}\n</tool_call>",  # more newlines than Qwen3's form
    ],
    ids=["cut_inside_think", "spaces_after_think", "newlines_around_think"],
)
def test_qwen3_thinking_turns_the_template_would_rewrite_stand_as_generated(qwen3, turn):
    d = ChatDeltas(qwen3, tools=PYTHON, enable_thinking=True)
    prompt = d.prompt(QUESTION)
    assert qwen3.decode(prompt).endswith(
        "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    cut = turn.endswith("<tool_call>")
    gen = _ids(qwen3, turn, eos=not cut)
    assert d.close_model_turn(gen) == turn
    env = d.append([{"role": "tool", "content": "42"}])
    assert qwen3.decode(env) == ("<|im_end|>\n" if cut else "\n") + TOOL_RESULT
    gen2 = _ids(qwen3, "<think>\nIt is 42.\n</think>\n\n<answer>42</answer>")
    d.close_model_turn(gen2)
    t = Trajectory(prompt)
    t.add_turn([], gen, [-0.5] * len(gen), version=0, finish_reason="length" if cut else "stop")
    t.add_turn(env, gen2, [-0.5] * len(gen2), version=0)
    assert t.ids.tolist() == prompt + gen + env + gen2  # what the engine saw, in order
    assert t.ids[t.loss_mask].tolist() == gen + gen2


def test_qwen3_canonical_thinking_turns_spell_the_template_s_own_rendering(qwen3):
    """When the model writes Qwen3's canonical form, the ids are exactly the template's rendering of the
    whole conversation: the deltas are the template's, and nothing of the model's turns was lost."""
    d = ChatDeltas(qwen3, tools=PYTHON, enable_thinking=True)
    ids = d.prompt(QUESTION)
    turns = [
        '<think>\nUse Python.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "6*7"}}\n</tool_call>',
        "<think>\nIt printed 42.\n</think>\n\n<answer>42</answer>",
    ]
    for k, text in enumerate(turns):
        gen = _ids(qwen3, text)
        d.close_model_turn(gen)
        ids += gen
        if k == 0:
            ids += d.append([{"role": "tool", "content": "42"}])
    want = qwen3.apply_chat_template(d.messages, tools=PYTHON, tokenize=False, enable_thinking=True)
    assert qwen3.decode(ids) + "\n" == want


def test_qwen3_thinking_off_keeps_the_generation_prompt_s_empty_think_block(qwen3):
    """With enable_thinking=False the generation prompt writes `<think>\\n\\n</think>\\n\\n`, and Qwen3
    renders an earlier turn without it: the ids keep what the engine saw, the template drops nothing."""
    d = ChatDeltas(qwen3, tools=PYTHON, enable_thinking=False)
    prompt = d.prompt(QUESTION)
    assert qwen3.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    gen = _ids(qwen3, '<tool_call>\n{"name": "python", "arguments": {"code": "6*7"}}\n</tool_call>')
    d.close_model_turn(gen)
    env = d.append([{"role": "tool", "content": "42"}])
    assert qwen3.decode(env) == "\n" + TOOL_RESULT + "<think>\n\n</think>\n\n"
    gen2 = _ids(qwen3, "<answer>42</answer>", eos=False)  # cut
    d.close_model_turn(gen2)
    env2 = d.append([{"role": "user", "content": "Sure?"}])  # a new query: Qwen3's last_query_index moves
    assert (
        qwen3.decode(env2)
        == "<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert d.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
