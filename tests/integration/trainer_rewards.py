"""Reward functions for the trainer tests (referenced by dotted path from the test configs)."""


def output_parity(prompt: str, completion: str, sample: dict) -> float:
    """1 for an even-length completion: varies across a random model's samples, so groups are kept."""
    return float(len(completion) % 2 == 0)


def always_raises(prompt: str, completion: str, sample: dict) -> float:
    raise RuntimeError("this reward is broken on purpose")
