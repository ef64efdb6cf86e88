"""Chat messages -> token deltas, rendered with the model's own chat template, never re-tokenising a turn.

A multi-turn trajectory's ids are built by appending: the prompt's ids, the ids the engine generated, then
for each inserted message (tool result, user turn) only the ids of the text it adds. `ChatDeltas` keeps the
messages so far and the rendered text its ids cover, and for each step renders the conversation again with
the tokenizer's `apply_chat_template` (with `tools=`), checks that the text so far is a prefix of the new
rendering (the template only appends), and tokenises only the new suffix. A template that rewrites earlier
turns for some message (drops earlier reasoning, regroups tool results, moves a system prompt) makes that
check fail, and `MegagrpoError` names the template and the message: the alternative would train on ids the
engine never saw.

The model's own ids are kept as generated. Its text (decoded, never encoded again) becomes the assistant
message the template renders, and only the template's closing glue after it (e.g. `<|im_end|>\\n`) is
tokenised, as a delta too. Render the assistant turn as its raw text: a template that re-renders parsed
tool calls in its own format is not append-only for it; the parsed calls go to the environment instead.

Tokenisation joins the pieces as ids, so the ids may differ from tokenising the whole rendered text at the
boundaries; that is the point: they are what the engine saw and generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from megagrpo.errors import MegagrpoError


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatDeltas:
    """Token deltas of one conversation (module doc). Call `prompt`, then per turn `close_model_turn` and
    `append`; the ids each returns are appended, in that order, to the trajectory's ids.

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
        self.messages: list[dict] = []
        self.text = ""  # the rendering of `messages` that the ids so far cover
        self._awaiting_model = False

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
        self.text = self.render(self.messages, add_generation_prompt=True)
        self._awaiting_model = True
        return self.encode(self.text)

    def close_model_turn(self, generated_ids: Sequence[int]) -> list[int]:
        """Record the model's turn and return the ids of the template's glue after it.

        The assistant message is the generated text, less a final special token (the end-of-turn token the
        engine stopped on). The template renders it after the text so far; what it renders after the
        model's text is the glue, less the stop token's text where the template closes the turn with the
        same token. The generated ids themselves are never encoded again."""
        if not self._awaiting_model:
            raise RuntimeError("close_model_turn() follows prompt() or append()")
        ids = [int(t) for t in generated_ids]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        ends_special = bool(ids) and ids[-1] in set(self.tokenizer.all_special_ids)
        content = self.tokenizer.decode(ids[:-1], skip_special_tokens=False) if ends_special else text
        message = {"role": "assistant", "content": content}
        rendered = self._check_appends([message], add_generation_prompt=False)
        turn = rendered[len(self.text) :]
        if not turn.startswith(content):
            i = len(self.messages)
            raise MegagrpoError(
                f"the chat template of {self.template_name} is not append-only for messages[{i}] (role "
                f"'assistant'): it renders the model's turn as {turn[:80]!r} instead of the generated text "
                f"{content[:80]!r}. Multi-turn rollouts need a template that renders an assistant turn as the "
                "text generated (e.g. one that keeps earlier reasoning and does not re-render tool calls)"
            )
        closing = turn[len(content) :]
        stop = text[len(content) :] if text.startswith(content) else ""
        glue = closing[len(stop) :] if stop and closing.startswith(stop) else closing
        self.messages.append(message)
        self.text = rendered
        self._awaiting_model = False
        return self.encode(glue)

    def append(self, new_messages: Sequence[dict]) -> list[int]:
        """Ids of `new_messages` (one environment step's messages, inserted together) and the generation
        prompt after them."""
        if self._awaiting_model:
            raise RuntimeError("append() follows close_model_turn()")
        if not new_messages:
            raise MegagrpoError("an environment step inserted no message; end the episode instead")
        new = [dict(m) for m in new_messages]
        rendered = self._check_appends(new, add_generation_prompt=True)
        delta = rendered[len(self.text) :]
        self.messages.extend(new)
        self.text = rendered
        self._awaiting_model = True
        return self.encode(delta)

    def _check_appends(self, new: list[dict], *, add_generation_prompt: bool) -> str:
        rendered = self.render([*self.messages, *new], add_generation_prompt=add_generation_prompt)
        if not rendered.startswith(self.text):
            i = len(self.messages)
            at = _first_difference(self.text, rendered)
            span = f"messages[{i}]" if len(new) == 1 else f"messages[{i}:{i + len(new)}]"
            raise MegagrpoError(
                f"the chat template of {self.template_name} is not append-only for {span} (role "
                f"{new[0].get('role')!r}): with it, the earlier conversation renders differently from "
                f"character {at} on ({self.text[at : at + 40]!r} becomes {rendered[at : at + 40]!r}), so the "
                "ids so far would not be the ones the engine saw. Insert an environment step's messages "
                "together, or use a template that renders earlier turns unchanged"
            )
        return rendered
