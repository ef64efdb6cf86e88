"""`PromptGroup`: one prompt of a step and everything the step learns about it, in one object.

A group is made when its prompt is drawn, gets its G completions on the engine that samples it, its scores
where the completions are, and its position in the learner batch when dynamic sampling keeps it.

Sessions and rows. The G completions are the group's G samples (sessions): rewards, advantages, filters and
dynamic sampling see those. An agent session that branched (`rollout.agents.session`) also trains its other
branches, each a learner row of its own (`branches`); `rows()` lists every learner row with its session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megagrpo.rollout.completion import Completion

if TYPE_CHECKING:
    from megagrpo.rollout.episodes.multi_turn import MultiTurnStats


@dataclass
class PromptGroup:
    input_ids: list[int]  # the formatted prompt's tokens, as the engine samples from them
    text: str = ""  # the formatted prompt, as reward functions read it
    sample: dict = field(default_factory=dict)  # the data row (its answer, task fields)
    completions: list[Completion] = field(default_factory=list)  # [G], set by the sampler
    rewards: torch.Tensor | None = None  # float32 [G], combined over reward functions
    per_reward: torch.Tensor | None = None  # float32 [G, R], one column per reward function
    position: int = -1  # the group's sessions in the step's batch: position*G .. position*G + G - 1
    # multi-turn (`trainer.episodes`): each trajectory's environment reward (None: unscored), and counters
    env_rewards: list[float | None] | None = None
    turn_stats: MultiTurnStats | None = None
    # [G] per session, its other branches' rows (agent sessions that branched); None: one row per session
    branches: list[list[Completion]] | None = None

    def rows(self) -> list[tuple[int, Completion]]:
        """Every learner row of the group as (session g, row), session after session, each session's
        other branches before its own row (`completions[g]`)."""
        extra = self.branches or [[] for _ in self.completions]
        return [(g, r) for g, c in enumerate(self.completions) for r in (*extra[g], c)]

    @property
    def lengths(self) -> torch.Tensor:
        """int64 [G]: output tokens of each completion."""
        return torch.tensor([c.output_ids.numel() for c in self.completions], dtype=torch.int64)
