"""Build the training and held-out prompt sets from a `data` config section."""

from __future__ import annotations

import random
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


def build_prompt_sets(
    cfg: DataConfig,
    formatter: PromptFormatter | None = None,
    purpose: str = "rl",
    section: str = "data",
) -> PromptSets:
    """Load or generate the prompts. `purpose` 'rl' needs answers, 'sft' needs completions.

    With a formatter, prompts longer than data.max_prompt_tokens after templating count as malformed
    rows (reported with file:line), and so do rows the prompt template cannot be filled from.
    """
    if purpose not in ("rl", "sft"):
        raise ValueError(f"purpose must be 'rl' or 'sft', got {purpose!r}")
    required = ("prompt", "answer") if purpose == "rl" else ("prompt", "completion")

    def check(sample: dict) -> None:
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
