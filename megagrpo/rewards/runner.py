"""Score a batch of completions with every configured reward; failures score 0 and are counted."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from megagrpo.config.schema import Config, RewardsConfig
from megagrpo.errors import MegagrpoError
from megagrpo.rewards.executor import DeadlinePool
from megagrpo.rewards.registry import build_reward

log = logging.getLogger("megagrpo.rewards")

_MAX_LOGGED_FAILURES = 3  # per reward function per run, so a broken verifier cannot flood the log


@dataclass
class RewardBatch:
    """Rewards for n prompts x G completions (group-major: completion i belongs to prompt i // G).

    per_reward: [n, G, K] float32, each reward function's score (0 where it raised or timed out);
                the GDPO input (`algo.advantages.gdpo(per_reward, weights)`).
    rewards:    [n, G] float32, sum_k weights[k] * per_reward[..., k]; the scalar reward for
                combine=weighted, and the logged reward for both modes.
    weights:    [K] float32.
    names:      K labels, in config order.
    failed:     [n, G, K] bool, True where the score is a 0 caused by an error or a timeout.
    metrics:    reward/ metrics for this batch.
    """

    per_reward: torch.Tensor
    rewards: torch.Tensor
    weights: torch.Tensor
    names: list[str]
    failed: torch.Tensor
    metrics: dict[str, float]


class RewardRunner:
    """Builds the configured reward functions once; `score` runs them with per-call deadlines."""

    def __init__(self, cfg: RewardsConfig | Config) -> None:
        self.cfg = cfg.rewards if isinstance(cfg, Config) else cfg
        built = [build_reward(f, f"rewards.functions[{i}]") for i, f in enumerate(self.cfg.functions)]
        self.names = [label for label, _ in built]
        self.fns = [fn for _, fn in built]
        self.timeouts = [f.timeout_s for f in self.cfg.functions]
        self.weights = torch.tensor([f.weight for f in self.cfg.functions], dtype=torch.float32)
        self.pool = DeadlinePool(self.cfg.num_workers)
        self.total_errors = 0
        self.total_timeouts = 0
        self._logged: dict[str, int] = {}

    def score(
        self, prompts: list[str], completions: list[str], samples: list[dict], group_size: int
    ) -> RewardBatch:
        """Score len(completions) == n * G completions; prompts and samples are aligned with them."""
        n_total = len(completions)
        if len(prompts) != n_total or len(samples) != n_total:
            raise MegagrpoError(
                f"reward batch: {len(prompts)} prompts, {len(completions)} completions and {len(samples)} samples "
                "must have the same length (one prompt and sample per completion)"
            )
        if group_size < 1 or n_total % group_size:
            raise MegagrpoError(
                f"reward batch: {n_total} completions do not split into groups of {group_size}"
            )
        k = len(self.fns)
        calls = []
        for i in range(n_total):
            for j in range(k):
                calls.append((_bind(self.fns[j], prompts[i], completions[i], samples[i]), self.timeouts[j]))
        outcomes = self.pool.map(calls)

        scores = torch.zeros(n_total, k, dtype=torch.float32)
        failed = torch.zeros(n_total, k, dtype=torch.bool)
        errors, timeouts = [0] * k, [0] * k
        for c, out in enumerate(outcomes):
            i, j = divmod(c, k)
            if out.timed_out:
                timeouts[j] += 1
                failed[i, j] = True
                self._log_failure(j, i, f"exceeded its {self.timeouts[j]:g} s limit")
                continue
            value, error = out.value, out.error
            if error is None:
                value, error = _as_score(value)
            if error is not None:
                errors[j] += 1
                failed[i, j] = True
                self._log_failure(j, i, error)
                continue
            scores[i, j] = value
        self.total_errors += sum(errors)
        self.total_timeouts += sum(timeouts)

        n = n_total // group_size
        per_reward = scores.view(n, group_size, k)
        combined = (per_reward * self.weights).sum(-1)
        metrics = {
            "reward/mean": combined.mean().item(),
            "reward/std": combined.std().item() if n_total > 1 else 0.0,
            "reward/errors": float(sum(errors)),
            "reward/timeouts": float(sum(timeouts)),
            "reward/errors_total": float(self.total_errors),
            "reward/timeouts_total": float(self.total_timeouts),
        }
        for j, name in enumerate(self.names):
            metrics[f"reward/{name}/mean"] = scores[:, j].mean().item()
            metrics[f"reward/{name}/errors"] = float(errors[j])
            metrics[f"reward/{name}/timeouts"] = float(timeouts[j])
        return RewardBatch(
            per_reward=per_reward,
            rewards=combined,
            weights=self.weights.clone(),
            names=list(self.names),
            failed=failed.view(n, group_size, k),
            metrics=metrics,
        )

    def _log_failure(self, j: int, i: int, what: str) -> None:
        name = self.names[j]
        seen = self._logged.get(name, 0)
        self._logged[name] = seen + 1
        if seen < _MAX_LOGGED_FAILURES:
            tail = (
                " (further failures of this reward are only counted)"
                if seen + 1 == _MAX_LOGGED_FAILURES
                else ""
            )
            log.warning("reward %r on completion %d scored 0: %s%s", name, i, what, tail)

    def state_dict(self) -> dict:
        """The run-long counters (`reward/errors_total`, `reward/timeouts_total`), for checkpoints."""
        return {"total_errors": self.total_errors, "total_timeouts": self.total_timeouts}

    def load_state_dict(self, st: dict) -> None:
        self.total_errors = int(st["total_errors"])
        self.total_timeouts = int(st["total_timeouts"])

    def close(self) -> None:
        self.pool.close()


def _bind(fn, prompt: str, completion: str, sample: dict):
    return lambda: fn(prompt, completion, sample)


def _as_score(value: object) -> tuple[float, str | None]:
    """A reward must return a finite real number (bools count as 0/1)."""
    if isinstance(value, bool | int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        v = float(value)
        if math.isfinite(v):
            return v, None
        return 0.0, f"returned a non-finite value {v}"
    return 0.0, f"returned {type(value).__name__} {value!r:.60}, not a number"
