"""Seeded synthetic verifiable tasks for the demos: multi-digit addition, countdown, and multiplication
with a calculator tool.

The same (config, seed) always yields the same problems on any machine (`random.Random` with integer
seeds), and the held-out problems are never in the training set. Each sample carries the reference
`answer`, the SFT target `completion` in the strict answer format, and the task's own fields; a
tool_arithmetic sample also carries `trace`, the gold multi-turn conversation after its prompt.
"""

from __future__ import annotations

import json
import random

from megagrpo.config.schema import SyntheticConfig
from megagrpo.errors import MegagrpoError

_SALT = {"train": 1, "eval": 2}
_MAX_TRIES_PER_SAMPLE = 1000


def _rng(seed: int, split: str) -> random.Random:
    return random.Random(seed * 1_000_003 + _SALT[split])


def _operand(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1)


def addition_problem(rng: random.Random, min_digits: int, max_digits: int, reverse: bool = False) -> dict:
    a, b = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits)
    answer = str(a + b)[::-1] if reverse else str(a + b)
    return {
        "prompt": f"What is {a} + {b}?"
        + (" Write the digits of the sum in reverse order." if reverse else ""),
        "answer": answer,
        "completion": f"<answer>{answer}</answer>",
        "task": "addition",
        "a": a,
        "b": b,
    }


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as Qwen2.5/Qwen3 write one (SGLang's `qwen25` parser reads it back)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_arithmetic_problem(
    rng: random.Random, min_digits: int, max_digits: int, tool_fraction: float = 1.0
) -> dict:
    """a * b, which a tiny model cannot multiply in its head but can ask the calculator environment for.

    `trace` is the gold episode after the prompt, in the messages of `megagrpo.envs.calculator`. With
    probability `tool_fraction` the model calls the calculator with the expression, the environment answers
    with the product (the tool message the environment writes, down to the call id the multi-turn driver
    gives the first call of the first turn), and the model copies it into the answer; otherwise the model
    answers at once. `completion` is the direct answer, for training without tools."""
    a, b = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits)
    uses_tool = rng.random() < tool_fraction  # drawn always: the problems do not depend on the fraction
    expression, answer = f"{a} * {b}", str(a * b)
    final = {"role": "assistant", "content": f"<answer>{answer}</answer>"}
    call = [
        {"role": "assistant", "content": tool_call_text("calculator", {"expression": expression})},
        {"role": "tool", "tool_call_id": "call_0_0", "name": "calculator", "content": answer},
    ]
    return {
        "prompt": f"What is {expression}?",
        "answer": answer,
        "completion": final["content"],
        "trace": [*call, final] if uses_tool else [final],
        "task": "tool_arithmetic",
        "a": a,
        "b": b,
    }


def countdown_problem(rng: random.Random, num_numbers: int, max_number: int) -> dict:
    """Numbers and a target reachable by construction (all numbers, left to right, random + - *)."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        order = numbers[:]
        rng.shuffle(order)
        expr, value, additive = str(order[0]), order[0], False
        for n in order[1:]:
            op = rng.choice("+-*")
            if op == "*":
                expr, value = (f"({expr})" if additive else expr) + f"*{n}", value * n
                additive = False
            else:
                expr, value = f"{expr}{op}{n}", value + n if op == "+" else value - n
                additive = True
        if value > 0:
            break
    return {
        "prompt": f"Using the numbers {' '.join(map(str, numbers))}, make {value}.",
        "answer": str(value),
        "completion": f"<answer>{expr}</answer>",
        "task": "countdown",
        "numbers": numbers,
        "target": value,
    }


def _key(sample: dict) -> tuple:
    if sample["task"] in ("addition", "tool_arithmetic"):
        return (sample["a"], sample["b"])
    return (tuple(sorted(sample["numbers"])), sample["target"])


def _draw(cfg: SyntheticConfig, rng: random.Random) -> dict:
    if cfg.task == "addition":
        return addition_problem(rng, cfg.min_digits, cfg.max_digits, cfg.reverse_answer)
    if cfg.task == "tool_arithmetic":
        return tool_arithmetic_problem(rng, cfg.min_digits, cfg.max_digits, cfg.tool_fraction)
    return countdown_problem(rng, cfg.num_numbers, cfg.max_number)


def generate(cfg: SyntheticConfig) -> tuple[list[dict], list[dict]]:
    """(train, heldout) samples: `num_eval` distinct held-out problems, `num_train` training problems
    that never coincide with a held-out one (repeats within training are allowed)."""
    heldout, seen = [], set()
    rng = _rng(cfg.seed, "eval")
    tries = 0
    while len(heldout) < cfg.num_eval:
        s = _draw(cfg, rng)
        tries += 1
        if tries > _MAX_TRIES_PER_SAMPLE * max(cfg.num_eval, 1):
            raise MegagrpoError(
                f"data.synthetic: only {len(heldout)} distinct {cfg.task} problems found for num_eval="
                f"{cfg.num_eval}; lower num_eval or widen the problem space (digits / numbers)"
            )
        if _key(s) in seen:
            continue
        seen.add(_key(s))
        s["_source"] = f"synthetic:{cfg.task}:eval:{len(heldout)}"
        heldout.append(s)
    train = []
    rng = _rng(cfg.seed, "train")
    misses = 0
    while len(train) < cfg.num_train:
        s = _draw(cfg, rng)
        if _key(s) in seen:
            misses += 1
            if misses > _MAX_TRIES_PER_SAMPLE * cfg.num_train:
                raise MegagrpoError(
                    f"data.synthetic: the held-out set covers the whole {cfg.task} problem space; lower num_eval"
                )
            continue
        s["_source"] = f"synthetic:{cfg.task}:train:{len(train)}"
        train.append(s)
    return train, heldout
