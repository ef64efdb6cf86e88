"""Environments and tools: every bad tool call is answered and counted, deadlines, size limits, concurrency,
the calculator's arithmetic and bounds, the calculator environment, and the environment registry."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
import types
import warnings
from fractions import Fraction

import pytest

from megagrpo.envs.base import Environment, StepResult
from megagrpo.envs.calculator import CalculatorEnv, calculator_tool, evaluate, format_number
from megagrpo.envs.registry import BUILTIN_ENVIRONMENTS, build_environment, resolve_environment
from megagrpo.envs.tools import Tool, ToolCounters, ToolExecutor
from megagrpo.errors import MegagrpoError

ADD = Tool(
    name="add",
    description="a + b",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
    fn=lambda a, b: a + b,
)


def _call(name: str, arguments, call_id: str = "c0", **extra) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}, **extra}


def _tool(name: str, fn, **kw) -> Tool:
    return Tool(name, name, {"type": "object", "properties": {}}, fn, **kw)


@pytest.fixture
def release():
    """An event that hanging tools wait on; set at teardown so their threads end with the test."""
    ev = threading.Event()
    yield ev
    ev.set()


def test_each_bad_call_is_answered_counted_and_never_raises(release):
    def boom():
        raise RuntimeError("tool crashed")

    tools = [
        ADD,
        _tool("boom", boom),
        _tool("hang", lambda: release.wait(60)),
        _tool("huge", lambda: "x" * 5000),
        _tool("circular", lambda: (d := {}, d.setdefault("self", d))[0]),
    ]
    ex = ToolExecutor(tools, timeout_s=0.2, max_result_chars=100)
    calls = [
        _call("add", {"a": 2, "b": 3}, "ok"),
        _call("add", '{"a": 2, "b": ', "bad_json"),
        _call("add", {"a": 2}, "missing"),
        _call("add", {"a": 2, "b": 3, "c": 4}, "extra"),
        _call("add", {"a": "2", "b": 3}, "wrong_type"),
        _call("add", "[1, 2]", "not_object"),
        _call("", "", "unparsed", malformed="the tool call is not valid JSON"),
        {"id": "no_function", "type": "function"},
        _call("nope", {}, "unknown"),
        _call("boom", {}, "raises"),
        _call("hang", {}, "timeout"),
        _call("huge", {}, "oversize"),
        _call("circular", {}, "unserialisable"),
    ]
    counters = ToolCounters()
    results = asyncio.run(ex.call_all(calls, counters))
    by_id = {r.call_id: r for r in results}
    assert [r.call_id for r in results] == [c["id"] for c in calls]
    assert (by_id["ok"].status, by_id["ok"].content) == ("ok", "5")
    for cid in ("bad_json", "missing", "extra", "wrong_type", "not_object", "unparsed", "no_function"):
        assert by_id[cid].status == "malformed", cid
        assert by_id[cid].content.startswith("Error: malformed"), cid
    assert "not valid JSON" in by_id["bad_json"].content
    assert "missing required argument(s) b" in by_id["missing"].content
    assert "unexpected argument(s) c" in by_id["extra"].content
    assert by_id["unknown"].status == "unknown_tool" and "available: add, boom" in by_id["unknown"].content
    assert by_id["raises"].status == "error" and "RuntimeError: tool crashed" in by_id["raises"].content
    assert by_id["timeout"].status == "timeout" and "timed out after 0.2 s" in by_id["timeout"].content
    assert by_id["oversize"].status == "oversize" and "5000 characters" in by_id["oversize"].content
    assert by_id["unserialisable"].status == "error"
    assert counters.as_dict() == {
        "tool_calls": 13,
        "tool_errors": 2,
        "tool_timeouts": 1,
        "malformed_calls": 7,
        "unknown_tools": 1,
        "oversize_results": 1,
        "interrupted_calls": 0,
        "unisolated_calls": 0,
        "refused_calls": 0,
    }
    msg = by_id["raises"].message()
    assert msg == {
        "role": "tool",
        "tool_call_id": "raises",
        "name": "boom",
        "content": by_id["raises"].content,
    }


def test_hanging_tool_times_out_at_its_deadline_and_blocks_no_later_call(release):
    ex = ToolExecutor([_tool("hang", lambda: release.wait(60)), ADD], timeout_s=0.2, max_concurrent=1)

    async def run():
        t0 = time.monotonic()
        hung = await ex.call(_call("hang", {}))
        t1 = time.monotonic()
        after = await ex.call(_call("add", {"a": 1, "b": 1}))
        return hung, t1 - t0, after, time.monotonic() - t1

    hung, hung_s, after, after_s = asyncio.run(run())
    assert hung.status == "timeout"
    assert 0.19 <= hung_s < 0.6
    assert after.status == "ok" and after.content == "2" and after_s < 0.5  # the one slot was freed
    assert ex.abandoned_threads == 1  # the waiting thread cannot be killed; it ends at teardown


def test_pure_python_loop_is_stopped_after_its_deadline():
    spun = threading.Event()

    def spin():
        spun.set()
        while True:
            pass

    def spinning() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "tool-spin"]

    ex = ToolExecutor([_tool("spin", spin)], timeout_s=0.2)
    result = asyncio.run(ex.call(_call("spin", {})))
    assert spun.is_set() and result.status == "timeout" and ex.abandoned_threads == 1
    deadline = time.monotonic() + 5
    while spinning() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not spinning()  # ToolDeadline ended the spinning thread


def test_tool_timeout_overrides_executor_deadline(release):
    ex = ToolExecutor([_tool("hang", lambda: release.wait(60), timeout_s=0.1)], timeout_s=30)
    t0 = time.monotonic()
    result = asyncio.run(ex.call(_call("hang", {})))
    assert result.status == "timeout" and time.monotonic() - t0 < 0.5


def test_100mb_result_is_truncated_with_a_note():
    ex = ToolExecutor([_tool("flood", lambda: "y" * 100_000_000)], max_result_chars=1000)
    counters = ToolCounters()
    result = asyncio.run(ex.call(_call("flood", {}), counters))
    assert result.status == "oversize" and counters.oversize_results == 1
    assert result.content.startswith("y" * 1000)
    assert result.content[1000:].startswith("\n[truncated: the result has 100000000 characters")
    assert len(result.content) < 1200


def test_sleeping_tool_calls_run_concurrently():
    ex = ToolExecutor([_tool("nap", lambda: time.sleep(0.2) or "done")], max_concurrent=8)

    async def trajectories():  # 8 trajectories, each its own coroutine, each making one call
        return await asyncio.gather(*(ex.call(_call("nap", {}, f"t{i}")) for i in range(8)))

    t0 = time.monotonic()
    results = asyncio.run(trajectories())
    elapsed = time.monotonic() - t0
    assert [r.content for r in results] == ["done"] * 8
    assert elapsed < 0.8, f"8 x 0.2 s calls took {elapsed:.2f} s: they did not overlap"


def test_max_concurrent_bounds_running_tools():
    ex = ToolExecutor([_tool("nap", lambda: time.sleep(0.1) or "done")], max_concurrent=2, timeout_s=0.25)
    t0 = time.monotonic()

    async def run():
        return await asyncio.gather(*(ex.call(_call("nap", {})) for _ in range(6)))

    results = asyncio.run(run())
    assert time.monotonic() - t0 >= 0.29  # three waves of two
    assert all(
        r.status == "ok" for r in results
    )  # a deadline starts when the call starts, not while it waits


def test_counters_add():
    a, b = ToolCounters(tool_calls=2, tool_errors=1), ToolCounters(tool_calls=3, unknown_tools=2)
    a.add(b)
    assert a.as_dict()["tool_calls"] == 5 and a.tool_errors == 1 and a.unknown_tools == 2


# ---------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("10 / 4", "2.5"),
        ("1 / 3", "0.333333333333333333333333333333"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("2 ** -3", "0.125"),
        ("0.1 + 0.2", "0.3"),
        ("1.5 * 2", "3"),
        ("-(3 - 5)", "2"),
        ("2 ** 100", str(2**100)),
        ("1e3 + 1", "1001"),
    ],
)
def test_calculator_values(expr, want):
    assert format_number(evaluate(expr)) == want


def test_calculator_matches_python_ints_on_many_digit_operands():
    rng = random.Random(0)
    for _ in range(50):
        a, b = rng.randrange(10**30), rng.randrange(1, 10**25)
        assert evaluate(f"{a} * {b} + {a} - {b}") == a * b + a - b
        assert evaluate(f"{a} // {b}") == a // b and evaluate(f"{a} % {b}") == a % b
        assert evaluate(f"{a} / {b}") == Fraction(a, b)


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("9**9**9", "more than 1000 digits"),
        ("10**(10**900)", "more than 1000 digits"),
        ("2**0.5", "integer exponents"),
        ("1e99999999", "unsupported number"),
        ("(10**600) * (10**600)", "more than 1000 digits"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("__import__('os').system('true')", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("1j", "unsupported literal"),
        ("'a' * 10", "unsupported literal"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "characters"),
        ("", "empty"),
    ],
)
def test_calculator_refuses_fast(expr, reason):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=reason):
        evaluate(expr)
    assert time.monotonic() - t0 < 0.5


def test_calculator_refuses_deep_nesting():
    with pytest.raises(ValueError, match="nested too deeply|not an arithmetic expression"):
        evaluate("-" * 5000 + "1", max_chars=10_000)
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        evaluate("(" * 400 + "1" + ")" * 400, max_chars=1000)


def test_calculator_tool_answers_errors_to_the_model():
    ex = ToolExecutor([calculator_tool()])
    ok, bad = asyncio.run(
        ex.call_all(
            [
                _call("calculator", {"expression": "12345678901 * 98765432109"}),
                _call("calculator", {"expression": "9**9**9"}),
            ]
        )
    )
    assert ok.content == str(12345678901 * 98765432109)
    assert bad.status == "error" and "more than 1000 digits" in bad.content


@pytest.mark.parametrize("expr", ["12a", "2or 3", "1if 1 else 2", "5in 3", '"\\d"', "0x1for 2"])
def test_calculator_parse_warns_nothing_and_answers_an_error(expr):
    """Model-written text that makes Python's tokenizer warn (a SyntaxWarning on the run's console) is
    answered with an error and warns nothing, even with every warning shown."""
    ex = ToolExecutor([calculator_tool()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (res,) = asyncio.run(ex.call_all([_call("calculator", {"expression": expr})]))
    assert [str(w.message) for w in caught] == []
    assert res.status == "error" and res.content
    assert not any(f[2] is SyntaxWarning for f in warnings.filters)  # the suppression did not leak out


# ------------------------------------------------------------------------------- calculator environment

ROW = {"prompt": "What is 123456789 * 987654321?", "answer": str(123456789 * 987654321)}


def _assistant(content: str = "", calls: list | None = None) -> dict:
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return msg


def test_calculator_env_episode_with_tool_call_then_correct_answer():
    env = CalculatorEnv(max_turns=3)
    assert isinstance(env, Environment)
    assert [t["function"]["name"] for t in env.tool_schemas()] == ["calculator"]

    async def episode():
        start = await env.reset(ROW)
        s1 = await env.step(_assistant("", [_call("calculator", {"expression": "123456789 * 987654321"})]))
        s2 = await env.step(_assistant(f"<answer>{s1.messages[0]['content']}</answer>"))
        return start, s1, s2

    start, s1, s2 = asyncio.run(episode())
    assert [m["role"] for m in start] == ["system", "user"] and start[1]["content"] == ROW["prompt"]
    assert not s1.done and s1.reward is None
    assert s1.messages == [
        {"role": "tool", "tool_call_id": "c0", "name": "calculator", "content": ROW["answer"]}
    ]
    assert s2 == StepResult([], True, 1.0, {"turns": 2, "finish": "answer"})
    assert env.counters.tool_calls == 1


@pytest.mark.parametrize(
    ("messages", "reward", "finish"),
    [
        ([_assistant("<answer>42</answer>")], 0.0, "answer"),
        ([_assistant("I do not know.")], 0.0, "no_answer"),
        ([_assistant("", [_call("calculator", {"expression": "1+1"})])] * 2, 0.0, "max_turns"),
        (
            [
                _assistant("", [_call("calculator", "{bad")]),
                _assistant(f"<answer> {ROW['answer']} </answer>"),
            ],
            1.0,
            "answer",
        ),
    ],
)
def test_calculator_env_endings(messages, reward, finish):
    env = CalculatorEnv(max_turns=2)

    async def episode():
        await env.reset(ROW)
        return [await env.step(m) for m in messages]

    steps = asyncio.run(episode())
    assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
    assert (steps[-1].reward, steps[-1].info["finish"]) == (reward, finish)


def test_calculator_env_missing_field_names_it():
    with pytest.raises(MegagrpoError, match="no 'prompt' field"):
        asyncio.run(CalculatorEnv().reset({"question": "1+1?", "answer": "2"}))
    env = asyncio.run(CalculatorEnv(question_key="question").reset({"question": "1+1?", "answer": "2"}))
    assert env[-1]["content"] == "1+1?"


# ------------------------------------------------------------------------------------------- registry


@pytest.fixture
def user_envs():
    mod = types.ModuleType("megagrpo_test_user_envs")

    class EchoEnv:
        def __init__(self, word: str = "hi"):
            self.word = word

        async def reset(self, row):
            return [{"role": "user", "content": self.word}]

        async def step(self, assistant_message):
            return StepResult([], True, 1.0)

        def tool_schemas(self):
            return []

    mod.EchoEnv = EchoEnv
    mod.not_env = 3
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_registry_resolves_builtin_and_import_path(user_envs):
    assert resolve_environment("calculator") is CalculatorEnv
    assert resolve_environment("megagrpo.envs.calculator:CalculatorEnv") is CalculatorEnv
    env = build_environment("megagrpo_test_user_envs:EchoEnv", {"word": "yo"})
    assert isinstance(env, user_envs.EchoEnv) and env.word == "yo"
    assert isinstance(build_environment("calculator", {"max_turns": 2}), CalculatorEnv)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        (
            "calculater",
            None,
            r"rollout\.multi_turn\.environment: 'calculater' is not a built-in environment \(choose one of calculator",
        ),
        ("no_such_pkg.envs:Env", None, "cannot import 'no_such_pkg.envs:Env'"),
        ("megagrpo_test_user_envs:Missing", None, "cannot import"),
        ("megagrpo_test_user_envs:not_env", None, "not an environment class"),
        ("calculator", {"max_turn": 2}, "do not fit 'calculator'.*max_turns"),
        ("calculator", {"max_turns": 0}, "not valid for 'calculator': max_turns must be >= 1"),
    ],
)
def test_registry_errors_name_the_field(user_envs, name, kwargs, match):
    with pytest.raises(MegagrpoError, match=match) as e:
        build_environment(name, kwargs)
    assert str(e.value).startswith("rollout.multi_turn.environment")


def test_builtin_environments_all_resolve():
    for name in BUILTIN_ENVIRONMENTS:
        assert callable(resolve_environment(name))
