"""Build the training and held-out prompt sets from a `data` config section."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from megagrpo.config.schema import DataConfig
from megagrpo.data.sources import LoadReport, RowError, read_rows
from megagrpo.data.synthetic import generate
from megagrpo.data.template import PromptFormatter
from megagrpo.errors import MegagrpoError

# The held-out split of a single file is seeded by this constant, not schedule.seed, so changing the
# training seed never changes which prompts measure held-out accuracy.
SPLIT_SEED = 0


@dataclass
class PromptSets:
    train: list[dict]
    heldout: list[dict]
    reports: dict[str, LoadReport] = field(default_factory=dict)  # per source file

    @property
    def malformed(self) -> int:
        return sum(r.malformed for r in self.reports.values())


def sft_target(sample: dict, cfg: DataConfig) -> None:
    """Check an SFT row's target and copy its completion (data.completion_key) to `completion`: RowError
    unless it has a string completion or a `trace`.

    A `trace` (the tool-use conversation after the prompt, `PromptFormatter.sft_trace_example`) is the
    target of multi-turn SFT, so such a row needs no completion; one it has anyway is kept for single-turn
    SFT. The trace's messages are checked when the row is tokenised, against the environment's first turn.
    """
    trace = sample.get("trace")
    if trace is not None and (not isinstance(trace, list) or not trace):
        raise RowError(
            "field 'trace' must be a non-empty list of chat messages (the conversation after the prompt)"
        )
    completion = sample.get(cfg.completion_key)
    if completion is None:
        if trace is None:
            raise RowError(
                f"missing field {cfg.completion_key!r} (data.completion_key); an SFT row needs a completion "
                "or a tool-use 'trace'"
            )
        return
    if not isinstance(completion, str):
        raise RowError(f"field {cfg.completion_key!r} must be a string")
    sample["completion"] = completion


def build_prompt_sets(
    cfg: DataConfig,
    formatter: PromptFormatter | None = None,
    purpose: str = "rl",
    section: str = "data",
    row_check: Callable[[dict], None] | None = None,
) -> PromptSets:
    """Load or generate the prompts. `purpose` 'rl' needs answers; 'sft' needs a completion, or a tool-use
    `trace` in its place (`sft_target`).

    With a formatter, prompts longer than data.max_prompt_tokens after templating count as malformed
    rows (reported with file:line), and so do rows the prompt template cannot be filled from. `row_check`
    (a multi-turn environment's, `trainer.episodes.row_check`) raises `RowError` for a row the environment
    would reject: it is malformed too; for 'sft' it checks the rows that carry a `trace` (the ones the
    environment starts).
    """
    if purpose not in ("rl", "sft"):
        raise ValueError(f"purpose must be 'rl' or 'sft', got {purpose!r}")
    # An SFT row's target is checked by sft_target, since a trace stands in for the completion.
    required = ("prompt", "answer") if purpose == "rl" else ("prompt",)

    def check(sample: dict) -> None:
        if purpose == "sft":
            sft_target(sample, cfg)
        if row_check is not None and (purpose == "rl" or sample.get("trace") is not None):
            row_check(sample)
        if formatter is not None:
            formatter.check_length(sample)

    if cfg.synthetic is not None:
        train, heldout = generate(cfg.synthetic)
        if formatter is not None:
            for s in train[:1] + heldout[:1]:
                try:
                    check(s)
                except RowError as e:
                    raise MegagrpoError(f"{section}.synthetic: {s['_source']}: {e}") from None
        return PromptSets(train=train, heldout=heldout[: cfg.max_eval_prompts])

    reports = {}
    train, reports[cfg.train_path] = read_rows(cfg.train_path, cfg, required, check, f"{section}.train_path")
    if cfg.eval_path is not None:
        heldout, reports[cfg.eval_path] = read_rows(
            cfg.eval_path, cfg, required, check, f"{section}.eval_path"
        )
    elif cfg.heldout_fraction > 0 and len(train) >= 2:
        order = list(range(len(train)))
        random.Random(SPLIT_SEED).shuffle(order)
        n_held = min(max(1, round(cfg.heldout_fraction * len(train))), len(train) - 1)
        held_idx = set(order[:n_held])
        heldout = [train[i] for i in sorted(held_idx)]
        train = [s for i, s in enumerate(train) if i not in held_idx]
    else:
        heldout = []
    return PromptSets(train=train, heldout=heldout[: cfg.max_eval_prompts], reports=reports)
