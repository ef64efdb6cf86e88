"""Reward functions for the trainer tests (referenced by dotted path from the test configs)."""

import json
import os
import threading


def output_parity(prompt: str, completion: str, sample: dict) -> float:
    """1 for an even-length completion: varies across a random model's samples, so groups are kept."""
    return float(len(completion) % 2 == 0)


def always_raises(prompt: str, completion: str, sample: dict) -> float:
    raise RuntimeError("this reward is broken on purpose")


def recorded_parity(prompt: str, completion: str, sample: dict) -> float:
    """`output_parity`, and every (prompt, completion) it scores appended to
    `$MEGAGRPO_TEST_RECORD_DIR/<pid>.jsonl` (the engine-count test compares what each run sampled)."""
    out = os.environ.get("MEGAGRPO_TEST_RECORD_DIR")
    if out:
        line = json.dumps([prompt, completion]) + "\n"
        with _RECORD_LOCK, open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(line)
    return output_parity(prompt, completion, sample)


_RECORD_LOCK = threading.Lock()
