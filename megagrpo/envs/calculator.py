"""The calculator tool, and the built-in environment "arithmetic with more digits than the model can carry,
solved with the calculator".

`evaluate(expr)` is exact arithmetic over integers and decimals (`fractions.Fraction`) with + - * / // % **,
unary signs and parentheses, parsed with `ast` and never `eval`. It is bounded so that no expression can
hang or fill memory: the expression's length, every literal, and every intermediate value's size
(`max_digits` decimal digits in its numerator or denominator) are checked, and a power is refused *before*
it is computed when its result would pass that size (so `9**9**9` fails at once).
"""

from __future__ import annotations

import ast
import math
import re
import threading
import warnings
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

from megagrpo.envs.answer import AnswerToolEnv
from megagrpo.envs.tools import Tool, ToolExecutor

# `warnings.catch_warnings` swaps the process-wide filter list and restores it on exit; two tool threads
# interleaving their enter/exit would leave SyntaxWarning ignored for the whole process. Parsing takes
# microseconds, so calculator parses take turns.
_PARSE_LOCK = threading.Lock()

_DECIMAL = re.compile(r"(\d[\d_]*)?(\.\d[\d_]*|\.)?([eE][+-]?\d+)?")

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}

CALCULATOR_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "An arithmetic expression, e.g. '123456789 * 987654321 + 2**40'.",
        }
    },
    "required": ["expression"],
}

DEFAULT_SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Use the calculator tool for the arithmetic, then give the final answer "
    "as <answer>NUMBER</answer>."
)


def _digits(x: Fraction) -> float:
    """log10 of the larger of x's numerator and denominator: about its number of decimal digits."""
    return math.log10(max(abs(x.numerator), x.denominator))


def evaluate(expr: str, max_chars: int = 500, max_digits: int = 1000) -> Fraction:
    """The exact value of an arithmetic expression; ValueError (with the reason) for anything else.

    ZeroDivisionError is reported as a ValueError too, so a caller catches one type.
    """
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError("the expression is empty")
    if len(expr) > max_chars:
        raise ValueError(f"the expression has {len(expr)} characters; the limit is {max_chars}")
    try:
        # Model-written text such as `2or 3`, `1if 1 else 2` or `"\d"` makes the tokenizer warn
        # ("invalid decimal literal", "invalid escape sequence") on the run's console; the model gets its
        # answer from the error below or the tree walk, so the warning would only be noise.
        with _PARSE_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression ({type(e).__name__})") from None
    src = expr.strip()

    def checked(x: Fraction) -> Fraction:
        if _digits(x) > max_digits:
            raise ValueError(f"a value has more than {max_digits} digits")
        return x

    def literal(node: ast.Constant) -> Fraction:
        if type(node.value) is int:
            return checked(Fraction(node.value))
        if type(node.value) is float:  # re-read the source text: the float itself is not exact
            text = ast.get_source_segment(src, node) or ""
            m = _DECIMAL.fullmatch(text)
            if m is None or (m.group(3) and abs(int(m.group(3)[1:])) > max_digits):
                raise ValueError(f"unsupported number {text!r}")
            return checked(Fraction(text.replace("_", "")))
        raise ValueError(f"unsupported literal {ast.get_source_segment(src, node)!r}")

    def power(a: Fraction, b: Fraction) -> Fraction:
        if b.denominator != 1:
            raise ValueError("only integer exponents are supported")
        e = b.numerator
        if a in (0, 1, -1):
            if a == 0 and e < 0:
                raise ValueError("division by zero")
            return a**e
        if abs(e) > max_digits / _digits(a):  # compares int to float exactly, even for a huge exponent
            raise ValueError(f"the power would have more than {max_digits} digits")
        return a**e

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return literal(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            v = walk(node.operand)
            return v if isinstance(node.op, ast.UAdd) else -v
        if isinstance(node, ast.BinOp):
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                return checked(power(a, b))
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise ValueError(f"unsupported operator {type(node.op).__name__}")
            if b == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
                raise ValueError("division by zero")
            return checked(op(a, b))
        raise ValueError(f"unsupported syntax {type(node).__name__}; use numbers, + - * / // % ** and ()")

    try:
        return walk(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def format_number(x: Fraction, significant: int = 30) -> str:
    """An integer as is; a decimal exactly when it terminates, else rounded to `significant` digits."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    with localcontext() as ctx:
        if d == 1:  # a terminating decimal: enough precision to print it exactly
            ctx.prec = len(str(abs(x.numerator))) + len(str(x.denominator)) + 2
        else:
            ctx.prec = significant
        return format(Decimal(x.numerator) / Decimal(x.denominator), "f")


def calculator_tool(max_chars: int = 500, max_digits: int = 1000, timeout_s: float | None = None) -> Tool:
    """The `calculator(expression)` tool: the exact value of the expression, or why it has none."""

    def calculator(expression: str) -> str:
        return format_number(evaluate(expression, max_chars, max_digits))

    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** and ().",
        parameters=CALCULATOR_PARAMETERS,
        fn=calculator,
        timeout_s=timeout_s,
    )


class CalculatorEnv(AnswerToolEnv):
    """Arithmetic with the calculator tool (`AnswerToolEnv`'s rules); `timeout_s` bounds each call."""

    def __init__(
        self,
        max_turns: int = 4,
        question_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        timeout_s: float = 5.0,
        max_result_chars: int = 2000,
        executor: ToolExecutor | None = None,
    ) -> None:
        super().__init__(
            executor or ToolExecutor([calculator_tool()], timeout_s, max_result_chars),
            max_turns=max_turns,
            question_key=question_key,
            answer_key=answer_key,
            system_prompt=system_prompt,
        )
