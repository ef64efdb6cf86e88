"""Chat messages -> token deltas, rendered with the model's own chat template; the model's text is never
rendered.

A multi-turn trajectory's ids are built by appending: the prompt's ids, the ids the engine generated, then,
for each environment step, the ids of what the template puts after the model's turn: its closing glue
(e.g. `<|im_end|>\\n`), the step's messages (tool results, a user turn) and the next generation prompt.

The model's turn stands in the ids exactly as generated, and its text never goes through the template: a
template re-renders an assistant message in its own canonical form (Qwen3's moves reasoning to
`reasoning_content` and rewrites the whitespace around `</think>`, renders an earlier turn without its
reasoning, and closes a turn cut inside `<think>` that it never opened), so a re-rendering need not give
the generated text back, and what the model writes must never stop a run. Instead every assistant turn is
rendered as a placeholder (a marker string unique to the turn, content only), and an environment step's
ids are the template's text after the placeholder of the model's last turn in the rendering of
`[conversation so far, placeholder, step's messages]` with the generation prompt: glue, messages and
generation prompt in one piece, less the end-of-turn token's text when the engine generated that token.

Append-only check. The rendering with the step's messages must begin with the rendering of the
conversation before the model's last turn (placeholders for the model's turns, no generation prompt): what
the template wrote for the prompt and for the earlier environment steps stays as the ids hold it. How the
template opens an assistant turn in history (Qwen3 drops the empty `<think>` block the generation prompt
wrote when thinking is off) is not checked: the engine saw the generation prompt, and the ids hold that. A
template that rewrites earlier environment text for a step (regroups tool results, moves a system prompt)
fails the check with `TemplateBreak` naming the template and the message; the multi-turn driver ends that
trajectory there, counted (`rollout/template_breaks`), instead of training on ids no rendering produces.

Tokenisation joins the pieces as ids, so the ids may differ from tokenising the whole rendered text at the
boundaries; that is the point: they are what the engine saw and generated.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import jinja2

from megagrpo.errors import MegagrpoError


class TemplateBreak(MegagrpoError):
    """The chat template is not append-only for an environment step's messages (module doc)."""


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def placeholder(turn: int) -> str:
    """The content that stands for the model's `turn`-th turn in renderings: no whitespace at its ends (a
    template may strip), no markup a template would parse, unlikely in any environment's text."""
    return f"[[megagrpo-model-turn-{turn}]]"


class ChatDeltas:
    """Token deltas of one conversation (module doc). Call `prompt`, then per turn `close_model_turn` and,
    when the environment answers, `append`; the ids `prompt` and `append` return and the generated ids are
    appended, in that order, to the trajectory's ids.

    `template_kwargs` go to the template (e.g. `enable_thinking=False`); `template_name` names the template
    in errors (default: the tokenizer's `name_or_path`, the model directory)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[dict] | None = None,
        template_name: str | None = None,
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.template_name = template_name or getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        self.template_kwargs = template_kwargs
        self.messages: list[dict] = []  # the conversation, each model turn as its text (less the stop token)
        self.generation_prompt = ""  # what the template writes after the prompt's messages, to open a turn
        self._rendered: list[dict] = []  # the same, each model turn as its placeholder
        self._stop = ""  # the text of the end-of-turn token that ended the last model turn, if any
        self._awaiting_model = False

    def snapshot(self) -> ChatDeltas:
        """A copy of this conversation's state that later turns do not change (messages are never
        changed in place, only appended)."""
        c = copy.copy(self)
        c.messages, c._rendered = list(self.messages), list(self._rendered)
        return c

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool) -> str:
        """The template's text for `messages` (with this conversation's tools and template kwargs)."""
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as e:
            raise MegagrpoError(
                f"the chat template of {self.template_name} failed to render {len(messages)} messages "
                f"(last: messages[{len(messages) - 1}], role {messages[-1].get('role')!r}): {e}"
            ) from e

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of rendered text; special tokens in it (`<|im_end|>`) map to their ids."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """Ids of the first request: `messages` rendered with the generation prompt."""
        if self.messages:
            raise RuntimeError("prompt() starts a conversation; this one has started")
        if not messages:
            raise MegagrpoError("a multi-turn prompt needs at least one message")
        self.messages = [dict(m) for m in messages]
        self._rendered = [dict(m) for m in messages]
        text = self.render(self.messages, add_generation_prompt=True)
        bare = self.render(self.messages, add_generation_prompt=False)
        self.generation_prompt = text[len(bare) :] if text.startswith(bare) else ""
        self._awaiting_model = True
        return self.encode(text)

    def close_model_turn(self, generated_ids: Sequence[int]) -> str:
        """Record the model's turn and return its text: the generated text, less a final special token
        (the end-of-turn token the engine stopped on). Nothing is rendered or encoded: the generated ids
        stand in the trajectory as they are."""
        if not self._awaiting_model:
            raise RuntimeError("close_model_turn() follows prompt() or append()")
        ids = [int(t) for t in generated_ids]
        ends_special = bool(ids) and ids[-1] in set(self.tokenizer.all_special_ids)
        content = self.tokenizer.decode(ids[:-1] if ends_special else ids, skip_special_tokens=False)
        self._stop = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ends_special else ""
        turn = sum(m["role"] == "assistant" for m in self.messages)
        self.messages.append({"role": "assistant", "content": content})
        self._rendered.append({"role": "assistant", "content": placeholder(turn)})
        self._awaiting_model = False
        return content

    def append(self, new_messages: Sequence[dict]) -> list[int]:
        """Ids of one environment step after the model's last turn: the template's glue after that turn,
        `new_messages` (inserted together) and the generation prompt. `TemplateBreak` when the template
        is not append-only for them (module doc); the conversation is then left as it was."""
        if self._awaiting_model:
            raise RuntimeError("append() follows close_model_turn()")
        if not new_messages:
            raise MegagrpoError("an environment step inserted no message; end the episode instead")
        new = [dict(m) for m in new_messages]
        before = self.render(self._rendered[:-1], add_generation_prompt=False)
        rendered = self.render([*self._rendered, *new], add_generation_prompt=True)
        mark = self._rendered[-1]["content"]
        at = rendered.find(mark, len(before)) if rendered.startswith(before) else -1
        if at < 0 or rendered.count(mark) != 1:
            raise self._break(new, before, rendered, found=at >= 0)
        delta = rendered[at + len(mark) :]
        if self._stop and delta.startswith(self._stop):  # the engine generated the turn's end
            delta = delta[len(self._stop) :]
        self.messages.extend(new)
        self._rendered.extend(new)
        self._awaiting_model = True
        return self.encode(delta)

    def _break(self, new: list[dict], before: str, rendered: str, *, found: bool) -> TemplateBreak:
        i = len(self.messages)
        span = f"messages[{i}]" if len(new) == 1 else f"messages[{i}:{i + len(new)}]"
        if rendered.startswith(before):
            what = (
                "renders the model's turn (a placeholder content) more than once"
                if found
                else "does not render the model's turn as its content"
            )
        else:
            at = _first_difference(before, rendered)
            what = (
                f"renders the earlier conversation differently from character {at} on "
                f"({before[at : at + 40]!r} becomes {rendered[at : at + 40]!r})"
            )
        return TemplateBreak(
            f"the chat template of {self.template_name} is not append-only for {span} (role "
            f"{new[0].get('role')!r}): with it, the template {what}, so the ids so far would not be the "
            "ones the engine saw. Insert an environment step's messages together, or use a template that "
            "renders earlier turns unchanged"
        )
