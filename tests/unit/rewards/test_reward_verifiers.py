"""Built-in verifiers on hand-made completions (correct, wrong, malformed)."""

from __future__ import annotations

import pytest

from megagrpo.rewards import (
    answer_tag,
    arithmetic,
    boxed,
    countdown,
    evaluate_expression,
    exact_match,
    format_reward,
    last_number,
    math_answer,
    strict_answer,
)


def test_extractors():
    assert answer_tag("draft <answer>1</answer> final <answer> 2 </answer>") == "2"
    assert answer_tag("no tag") is None
    assert strict_answer("  <answer>42</answer>\n") == "42"
    assert strict_answer("so <answer>42</answer>") is None
    assert strict_answer("<answer>42") is None and strict_answer("<answer>42", allow_unclosed=True) == "42"
    assert boxed(r"x \boxed{\frac{1}{2}} and \boxed{3^{2}}") == "3^{2}"
    assert boxed(r"\boxed{unbalanced") is None
    assert last_number("total 1,234 then -5.5 end") == "-5.5"
    assert last_number("it is 1,234") == "1234"


def test_arithmetic_is_strict_about_format_and_value():
    r = arithmetic()
    s = {"answer": "579"}
    assert r("", "<answer>579</answer>", s) == 1.0
    assert r("", "<answer>578</answer>", s) == 0.0
    assert r("", "The answer is <answer>579</answer>", s) == 0.0  # strict: nothing else allowed
    assert r("", "<answer>five</answer>", s) == 0.0
    assert arithmetic(strict=False)("", "The answer is <answer>579</answer>", s) == 1.0


def test_format_and_exact_match():
    f = format_reward()
    assert f("", "<answer>x y</answer>", {}) == 1.0 and f("", "x <answer>1</answer>", {}) == 0.0
    custom = format_reward(pattern=r"(?s).*<answer>[^<>]*</answer>\s*")
    assert custom("", "reasoning...\n<answer>7</answer>", {}) == 1.0
    em = exact_match()
    assert em("", "<answer>Paris  France</answer>", {"answer": "Paris France"}) == 1.0
    assert em("", "<answer>paris</answer>", {"answer": "Paris"}) == 0.0
    assert exact_match(case_sensitive=False)("", "<answer>paris</answer>", {"answer": "Paris"}) == 1.0
    assert exact_match(extract="last_number")("", "so it is 12.", {"answer": 12}) == 1.0
    with pytest.raises(ValueError, match="extract"):
        exact_match(extract="first_word")


def test_countdown_verifier():
    s = {"numbers": [3, 4, 6], "target": 24}
    r = countdown()
    assert r("", "<answer>(3+4)*6-18</answer>", s) == 0.0  # 18 is not a given number
    assert r("", "<answer>4*6</answer>", s) == 1.0  # subset allowed by default
    assert countdown(use_all=True)("", "<answer>4*6</answer>", s) == 0.0
    assert (
        countdown(use_all=True)("", "<answer>6*(3+4)-18</answer>", {"numbers": [3, 4, 6, 18], "target": 24})
        == 1.0
    )
    assert r("", "<answer>6*4*4</answer>", {"numbers": [4, 6, 4], "target": 96}) == 1.0
    assert r("", "<answer>6*4*4</answer>", s) == 0.0  # 4 used twice, given once
    assert r("", "<answer>__import__('os')</answer>", s) == 0.0
    assert r("", "<answer>3**6</answer>", s) == 0.0  # no powers
    assert r("", "<answer>6/(4-4)</answer>", {"numbers": [6, 4, 4], "target": 1}) == 0.0  # div by zero
    assert r("", "<answer>6/3*4*3</answer>", {"numbers": [6, 3, 4, 3], "target": 24}) == 1.0
    value, used = evaluate_expression("(3+4)*6")
    assert value == 42 and dict(used) == {3: 1, 4: 1, 6: 1}
    assert evaluate_expression("1 +") is None and evaluate_expression("1.5*2") is None


def test_math_verify_reward():
    r = math_answer()
    assert r("", r"The sum is \boxed{46}.", {"answer": "46"}) == 1.0
    assert r("", r"so $\boxed{0.5}$", {"answer": r"\frac{1}{2}"}) == 1.0
    assert r("", "<answer>1/2</answer>", {"answer": "0.5"}) == 1.0
    assert r("", r"\boxed{45}", {"answer": "46"}) == 0.0
    assert r("", "no answer at all", {"answer": "46"}) == 0.0
