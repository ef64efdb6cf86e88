"""Built-in verifiable rewards. Each factory takes its options and returns a `RewardFn`.

`RewardFn(prompt: str, completion: str, sample: dict) -> float`: `sample` is the data row (with the
reference answer under `answer`, and task fields such as `numbers`/`target` for countdown).
"""

from __future__ import annotations

import ast
import logging
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from megagrpo.rewards.extract import EXTRACTORS, answer_tag, strict_answer
from megagrpo.rewards.extract import extract as extract_answer

RewardFn = Callable[[str, str, dict], float]

_INT = re.compile(r"[-+]?\d+")


def exact_match(
    extract: str = "answer_tag", answer_key: str = "answer", case_sensitive: bool = True
) -> RewardFn:
    """1.0 when the extracted answer (extract: none, answer_tag, strict, boxed, last_number) equals the
    reference after whitespace normalisation."""
    if extract != "none" and extract not in EXTRACTORS:
        raise ValueError(
            f"extract: unknown extractor {extract!r}; choose one of none, {', '.join(EXTRACTORS)}"
        )

    def norm(s: str) -> str:
        s = " ".join(s.split())
        return s if case_sensitive else s.lower()

    def reward(prompt: str, completion: str, sample: dict) -> float:
        got = extract_answer(completion, extract)
        return float(got is not None and norm(got) == norm(str(sample[answer_key])))

    return reward


def format_reward(tag: str = "answer", pattern: str | None = None, allow_unclosed: bool = False) -> RewardFn:
    """1.0 when the whole completion has the strict answer format (`<tag>...</tag>` or a custom regex)."""
    rx = re.compile(pattern, re.S) if pattern is not None else None

    def reward(prompt: str, completion: str, sample: dict) -> float:
        if rx is not None:
            return float(rx.fullmatch(completion) is not None)
        return float(strict_answer(completion, tag, allow_unclosed) is not None)

    return reward


def arithmetic(
    tag: str = "answer", strict: bool = True, answer_key: str = "answer", allow_unclosed: bool = False
) -> RewardFn:
    """1.0 when the tagged answer is the integer sample[answer_key]; `strict` also demands the exact format."""

    def reward(prompt: str, completion: str, sample: dict) -> float:
        got = strict_answer(completion, tag, allow_unclosed) if strict else answer_tag(completion, tag)
        if got is None or not _INT.fullmatch(got):
            return 0.0
        return float(int(got) == int(sample[answer_key]))

    return reward


def countdown(
    tag: str = "answer",
    numbers_key: str = "numbers",
    target_key: str = "target",
    use_all: bool = False,
    strict: bool = True,
    allow_unclosed: bool = False,
) -> RewardFn:
    """1.0 when the tagged expression uses only the given numbers (each at most once, or exactly once with
    `use_all`) with + - * / and parentheses, and evaluates exactly to the target."""

    def reward(prompt: str, completion: str, sample: dict) -> float:
        expr = strict_answer(completion, tag, allow_unclosed) if strict else answer_tag(completion, tag)
        if expr is None:
            return 0.0
        result = evaluate_expression(expr)
        if result is None:
            return 0.0
        value, used = result
        have = Counter(int(n) for n in sample[numbers_key])
        if use_all and used != have:
            return 0.0
        if any(used[n] > have[n] for n in used):
            return 0.0
        return float(value == int(sample[target_key]))

    return reward


def evaluate_expression(expr: str, max_len: int = 200) -> tuple[Fraction, Counter] | None:
    """Exact value and the multiset of integer literals of an arithmetic expression; None if not one.

    Parsed with `ast` (never `eval`): only integer literals, + - * / and parentheses are allowed, so a
    completion cannot run code or build huge numbers (no powers).
    """
    if len(expr) > max_len:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        return None
    used: Counter = Counter()
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def walk(node: ast.AST) -> Fraction | None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used[node.value] += 1
            return Fraction(node.value)
        if isinstance(node, ast.BinOp):
            a, b = walk(node.left), walk(node.right)
            if a is None or b is None:
                return None
            if isinstance(node.op, ast.Div):
                return None if b == 0 else a / b
            op = ops.get(type(node.op))
            return op(a, b) if op else None
        return None

    value = walk(tree.body)
    return None if value is None else (value, used)


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns that its signal-based timeout is off; megagrpo's DeadlinePool enforces one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def math_answer(answer_key: str = "answer", tag: str = "answer") -> RewardFn:
    """1.0 when math-verify finds the completion's answer equivalent to the reference.

    The answer is taken from a <tag>...</tag> when present, else math-verify extracts it itself (\\boxed{}
    first, then a final-answer expression). math-verify's own timeout uses SIGALRM, which only works on the
    main thread, so it is disabled here and the reward runner's deadline applies instead.
    """
    import math_verify  # sympy + latex parsing: seconds to import, so only when this reward is used

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutWarning())

    def parse(text: str) -> list[Any]:
        return math_verify.parse(text, parsing_timeout=None)

    def reward(prompt: str, completion: str, sample: dict) -> float:
        gold_text = str(sample[answer_key])
        gold = parse(gold_text) or parse(f"${gold_text}$")
        tagged = answer_tag(completion, tag)
        pred = (parse(tagged) or parse(f"${tagged}$")) if tagged is not None else parse(completion)
        if not gold or not pred:
            return 0.0
        return float(math_verify.verify(gold, pred, timeout_seconds=None))

    return reward


BUILTIN_REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": math_answer,
    "exact_match": exact_match,
    "format": format_reward,
    "arithmetic": arithmetic,
    "countdown": countdown,
}
