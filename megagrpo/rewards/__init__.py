"""Verifiable rewards: built-in verifiers, user functions by import path, a deadline-guarded runner.

`RewardFn(prompt: str, completion: str, sample: dict) -> float`. `RewardRunner(cfg).score(...)` returns a
`RewardBatch` with [n, G] combined rewards, the [n, G, K] per-reward scores (GDPO) and `reward/` metrics.
"""

from megagrpo.rewards.executor import DeadlinePool, Outcome, RewardDeadline
from megagrpo.rewards.extract import answer_tag, boxed, extract, last_number, strict_answer
from megagrpo.rewards.registry import build_reward, import_object
from megagrpo.rewards.verifiers import (
    BUILTIN_REWARDS,
    RewardFn,
    arithmetic,
    countdown,
    evaluate_expression,
    exact_match,
    format_reward,
    math_answer,
)


def __getattr__(name: str):
    # The runner is the only torch user here: imported on first use, so that what imports only the
    # verifiers or the executor (an agent command through megagrpo.envs, a sandbox tool) does not pay
    # torch's import (about 7 s of CPU per process on the CI machine).
    if name in ("RewardBatch", "RewardRunner"):
        from megagrpo.rewards import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_REWARDS",
    "DeadlinePool",
    "Outcome",
    "RewardBatch",
    "RewardDeadline",
    "RewardFn",
    "RewardRunner",
    "answer_tag",
    "arithmetic",
    "boxed",
    "build_reward",
    "countdown",
    "evaluate_expression",
    "exact_match",
    "extract",
    "format_reward",
    "import_object",
    "last_number",
    "math_answer",
    "strict_answer",
]
