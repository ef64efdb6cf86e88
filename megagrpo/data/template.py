"""Render a sample into the model's prompt: `data.prompt_template`, then the tokenizer's chat template; and
an SFT row into ids and loss mask, single-turn or a multi-turn trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megagrpo.config.schema import DataConfig
from megagrpo.data.sources import RowError
from megagrpo.errors import MegagrpoError


@dataclass
class Prompt:
    """A rendered prompt: text as the model sees it and its token ids ([prompt_len] ints)."""

    text: str
    input_ids: list[int]


class PromptFormatter:
    """Uses any Hugging Face tokenizer (`apply_chat_template`, `__call__`, `eos_token_id`).

    `template_kwargs` are the chat template's options (`model.chat_template_kwargs`), passed to every
    rendering: prompts here, and the multi-turn traces' `ChatDeltas` (`trainer/sft.py`)."""

    def __init__(
        self, tokenizer: Any, cfg: DataConfig, template_kwargs: dict[str, Any] | None = None
    ) -> None:
        self.tok, self.cfg = tokenizer, cfg
        self.template_kwargs = dict(template_kwargs or {})
        if cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise MegagrpoError(
                "data.use_chat_template: true, but the model's tokenizer has no chat template; set "
                "data.use_chat_template=false or use a tokenizer with one (tokenizer_config.json chat_template)"
            )

    def messages(self, sample: dict) -> list[dict]:
        prompt = sample["prompt"]
        if isinstance(prompt, list):
            msgs = [dict(m) for m in prompt]
        else:
            try:
                text = self.cfg.prompt_template.format(**sample)
            except (KeyError, IndexError, ValueError) as e:
                raise RowError(
                    f"data.prompt_template cannot be filled from this row ({type(e).__name__}: {e})"
                ) from None
            msgs = [{"role": "user", "content": text}]
        if self.cfg.system_prompt is not None and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return msgs

    def text(self, sample: dict) -> str:
        msgs = self.messages(sample)
        if self.cfg.use_chat_template:
            return self.tok.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
        if isinstance(sample["prompt"], list):
            raise RowError("a chat-message prompt needs data.use_chat_template=true")
        return "\n\n".join(m["content"] for m in msgs)

    def __call__(self, sample: dict) -> Prompt:
        text = self.text(sample)
        return Prompt(text=text, input_ids=list(self.tok(text, add_special_tokens=False)["input_ids"]))

    def check_length(self, sample: dict) -> None:
        """RowError when the rendered prompt exceeds data.max_prompt_tokens (used while loading)."""
        n = len(self(sample).input_ids)
        if n > self.cfg.max_prompt_tokens:
            raise RowError(
                f"prompt is {n} tokens after templating, above data.max_prompt_tokens={self.cfg.max_prompt_tokens}"
            )

    def sft_example(self, sample: dict) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids + EOS) for SFT; the loss covers the completion ids only."""
        prompt = self(sample).input_ids
        completion = list(self.tok(sample["completion"], add_special_tokens=False)["input_ids"])
        return prompt, completion + [self.eos_id()]

    def eos_id(self) -> int:
        eos = self.tok.eos_token_id
        if eos is None:
            raise MegagrpoError("model tokenizer has no eos_token; SFT needs one to teach the model to stop")
        return eos

    def sft_trace_example(
        self, chat: Any, prompt: Sequence[dict], trace: Sequence[dict]
    ) -> tuple[list[int], list[int], list[bool]]:
        """(prompt ids, response ids, response loss mask) of a multi-turn SFT row, built as the multi-turn
        driver builds a trajectory (`megagrpo.rollout.episodes.multi_turn`), so that SFT trains on the ids the engine
        will later generate and read.

        `chat` is a fresh `ChatDeltas` (`megagrpo.rollout.episodes.chat_delta`) holding the environment's tools and
        this formatter's template options, and
        `prompt` the environment's first messages (`env.reset(row)`). `trace` is the conversation after
        them: assistant turns and, between two of them, the environment's messages (tool results, user
        turns). Each assistant turn enters as the ids the model would generate, its text's ids then EOS, and
        only those take the loss; the template's glue after a turn and the environment's messages enter as
        the template's delta (`ChatDeltas.append`). Nothing follows the last assistant turn, as in a rollout.
        """
        if not trace or any(not isinstance(m, dict) for m in trace):
            raise RowError("trace must be a non-empty list of chat messages")
        if trace[0].get("role") != "assistant" or trace[-1].get("role") != "assistant":
            raise RowError(
                "trace must start and end with an assistant turn (the model's first and last turns)"
            )
        prompt_ids = chat.prompt(prompt)
        ids: list[int] = []
        mask: list[bool] = []
        env: list[dict] = []  # the environment's messages since the last assistant turn
        for i, m in enumerate(trace):
            if not isinstance(m.get("content"), str):
                raise RowError(f"trace[{i}] has no string content")
            if m["role"] != "assistant":
                env.append(m)
                continue
            if i > 0:
                if not env:
                    raise RowError(
                        f"trace[{i}] follows an assistant turn directly; an environment step between two "
                        "model turns inserts at least one message"
                    )
                inserted = chat.append(env)
                ids += inserted
                mask += [False] * len(inserted)
                env = []
            generated = chat.encode(m["content"]) + [self.eos_id()]
            ids += generated
            mask += [True] * len(generated)
            chat.close_model_turn(generated)
        return prompt_ids, ids, mask
