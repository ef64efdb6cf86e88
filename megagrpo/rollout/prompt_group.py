"""`PromptGroup`: one prompt of a step and everything the step learns about it, in one object.

A group is made when its prompt is drawn, gets its G completions on the engine that samples it, its scores
where the completions are, and its position in the learner batch when dynamic sampling keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megagrpo.rollout.completion import Completion

if TYPE_CHECKING:
    from megagrpo.rollout.multi_turn import MultiTurnStats


@dataclass
class PromptGroup:
    input_ids: list[int]  # the formatted prompt's tokens, as the engine samples from them
    text: str = ""  # the formatted prompt, as reward functions read it
    sample: dict = field(default_factory=dict)  # the data row (its answer, task fields)
    completions: list[Completion] = field(default_factory=list)  # [G], set by the sampler
    rewards: torch.Tensor | None = None  # float32 [G], combined over reward functions
    per_reward: torch.Tensor | None = None  # float32 [G, R], one column per reward function
    position: int = -1  # row group in the step's batch (rows position*G .. position*G + G - 1)
    # multi-turn (`trainer.episodes`): each trajectory's environment reward (None: unscored), and counters
    env_rewards: list[float | None] | None = None
    turn_stats: MultiTurnStats | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """int64 [G]: output tokens of each completion."""
        return torch.tensor([c.output_ids.numel() for c in self.completions], dtype=torch.int64)
