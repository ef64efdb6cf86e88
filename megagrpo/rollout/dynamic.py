"""Dynamic sampling (DAPO 2503.14476 Sec. 3.2): over-sample prompts, drop zero-variance groups, refill.

Each round draws `ceil(missing * oversample)` prompts from the prompt source, generates G completions per
prompt, scores them with `reward_fn`, and keeps the groups that `keep_fn` accepts (default: the algo filter
`megagrpo.algo.filters.keep_groups`, rewards not all equal). Rounds continue until `batch_prompts` groups
are kept or `max_rounds` is reached; the result then holds fewer groups, and says so (`full`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from megagrpo.config.schema import Config
from megagrpo.config.schema import RolloutConfig as RolloutSection
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.completion import Completion
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.groups import EngineGroups

# reward_fn(prompts [n], completion groups [n][G]) -> float [n, G] (or [n * G], prompt-major)
RewardFn = Callable[[list, list[list[Completion]]], torch.Tensor]
KeepFn = Callable[[torch.Tensor], torch.Tensor]  # rewards [n, G] -> bool [n]


def _default_keep(rewards: torch.Tensor) -> torch.Tensor:
    from megagrpo.algo.filters import keep_groups

    return keep_groups(rewards)


_SCHEMA = RolloutSection.model_fields


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """The loop's knobs. Defaults are the schema's (`rollout.oversample`, `rollout.max_rounds`), so the two
    cannot disagree; `from_config` is the one translation from a validated `Config`."""

    batch_prompts: int  # groups wanted in the batch
    group_size: int  # G, completions per prompt (>= 2 for GRPO)
    oversample: float = _SCHEMA["oversample"].default  # prompts drawn per missing group in each round
    max_rounds: int = _SCHEMA["max_rounds"].default  # cap on generation rounds per batch

    def draw_size(self, missing: int) -> int:
        """Prompts a round draws when `missing` groups are still wanted."""
        return math.ceil(missing * self.oversample)

    @classmethod
    def from_config(cls, cfg: Config) -> DynamicSamplingConfig:
        """`algo.dynamic_sampling: false` is one round of exactly `prompts_per_step` prompts."""
        r, on = cfg.rollout, cfg.algo.dynamic_sampling
        return cls(
            batch_prompts=r.prompts_per_step,
            group_size=r.group_size,
            oversample=r.oversample if on else 1.0,
            max_rounds=r.max_rounds if on else 1,
        )


@dataclass
class DynamicBatch:
    """The kept groups. With engine groups, `groups`/`prompts`/`positions` are this rank's own kept groups
    (those its engine sampled) and `rewards` is the whole batch's, on every rank."""

    groups: list[list[Completion]]  # [n_mine][G], in batch order
    rewards: torch.Tensor  # float32 [n_kept, G], every kept group of the batch, in batch order
    prompts: list = field(default_factory=list)  # the prompt of each of `groups`
    positions: list[int] = field(default_factory=list)  # batch position of each of `groups`
    versions: list[int] = field(default_factory=list)  # policy version of every kept group, batch order
    rounds: int = 0
    generated_groups: int = 0  # groups generated over all rounds, by every engine
    dropped_groups: int = 0  # zero-variance groups dropped
    full: bool = False  # True when batch_prompts groups were kept

    @property
    def kept(self) -> int:
        return int(self.rewards.shape[0])

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/dynamic_rounds": float(self.rounds),
            "rollout/dynamic_dropped_frac": self.dropped_groups / max(self.generated_groups, 1),
            "rollout/dynamic_batch_full": float(self.full),
        }


def check_group_size(group_size: int) -> None:
    if group_size < 2:
        raise MegagrpoError(
            f"group_size={group_size}: GRPO needs at least 2 completions per prompt to compute group advantages"
        )


def _scored(reward_fn: RewardFn, mine: list, groups: list, G: int) -> torch.Tensor:
    """float32 `[len(mine), G]` rewards of this engine's groups (`[0, G]` for an empty share)."""
    if not mine:
        return torch.empty(0, G)
    rewards = torch.as_tensor(reward_fn(mine, groups), dtype=torch.float32)
    if rewards.numel() != len(mine) * G:
        raise MegagrpoError(
            f"reward_fn returned shape {tuple(rewards.shape)}, expected ({len(mine) * G},): one "
            "reward per completion"
        )
    return rewards.reshape(len(mine), G)


def dynamic_sample(
    generate: Callable[..., list[list[Completion]]],
    prompts: Iterator,
    sampling: SamplingConfig,
    cfg: DynamicSamplingConfig,
    reward_fn: RewardFn,
    keep_fn: KeepFn | None = None,
    *,
    engines: EngineGroups | None = None,
    first_round=None,
    version: int = 0,
) -> DynamicBatch:
    """Fill a batch of non-degenerate groups. `generate(prompts, sampling, G, index_offset=k)` is
    `RolloutEngine.generate` (k: global index of the first request); `prompts` an iterator.

    Kept groups are returned in generation order, at most `batch_prompts`; extra kept groups of the last
    round are discarded (they would bias the batch toward no prompt in particular, so the first ones win).

    engines: data-parallel sampling. Every rank calls this with the same prompt iterator; each round's
    prompts are split by `engines.share`, each owner samples and scores its share, and the keep decision
    is taken on every rank from the gathered rewards ([n, G] floats per round). A rank without an engine
    takes part in the gathers with an empty share; `generate` is called on every rank (with an empty list
    on those), so a caller counting engine calls counts the same on all of them.

    first_round: a `rollout.prefetch.QueuedRound` generated ahead of the step (async rollout); it is the
    first round (its draw, this engine's groups and rewards, its version) and later rounds, if any, are
    sampled now with the weights of policy `version`. Every kept group records its round's version.
    """
    check_group_size(cfg.group_size)
    if cfg.batch_prompts < 1:
        raise MegagrpoError(f"batch_prompts={cfg.batch_prompts} must be >= 1")
    if cfg.oversample < 1.0:
        raise MegagrpoError(f"oversample={cfg.oversample} must be >= 1")
    if cfg.max_rounds < 1:
        raise MegagrpoError(f"max_rounds={cfg.max_rounds} must be >= 1")
    keep_fn = keep_fn or _default_keep
    G = cfg.group_size
    out = DynamicBatch(groups=[], rewards=torch.empty(0, G))
    kept_rewards: list[torch.Tensor] = []
    while out.rounds < cfg.max_rounds and len(kept_rewards) < cfg.batch_prompts:
        missing = cfg.batch_prompts - len(kept_rewards)
        queued = first_round if out.rounds == 0 else None
        if queued is not None:
            draw, share, round_version = queued.draw, queued.share, queued.version
        else:
            draw = [p for _, p in zip(range(cfg.draw_size(missing)), prompts)]
            share = engines.share(len(draw)) if engines is not None else range(len(draw))
            round_version = version
        if not draw:
            break  # prompt source exhausted (the same on every rank: they draw the same prompts)
        out.rounds += 1
        mine = draw[share.start : share.stop]
        if queued is not None:  # generated and scored ahead of the step (rollout.prefetch)
            groups, rewards = queued.groups, queued.rewards if mine else torch.empty(0, G)
        else:
            groups = generate(mine, sampling, G, index_offset=share.start * G)
            rewards = _scored(reward_fn, mine, groups, G)
        if engines is not None:
            rewards = engines.join_shares(rewards, len(draw))
        keep = keep_fn(rewards)
        out.generated_groups += len(draw)
        out.dropped_groups += int((~keep).sum())
        for i in torch.nonzero(keep).flatten().tolist():
            if len(kept_rewards) >= cfg.batch_prompts:
                break
            if i in share:
                out.groups.append(groups[i - share.start])
                out.prompts.append(draw[i])
                out.positions.append(len(kept_rewards))
            kept_rewards.append(rewards[i])
            out.versions.append(round_version)
    if kept_rewards:
        out.rewards = torch.stack(kept_rewards)
    out.full = len(kept_rewards) == cfg.batch_prompts
    return out
