#!/usr/bin/env python
"""Multi-turn rollouts with a slow tool: is the tool's latency hidden behind the other trajectories' decoding?

Runs --trajectories trajectories of --turns model turns each (rows x --group-size samples) through
`megagrpo.rollout.episodes.multi_turn.rollout_episodes` on ONE real CPU SGLang engine (the tiny Qwen3-MoE of the
integration tests: hidden 64, 2 layers, 8 experts, top-2), twice with the same seeds: once with a tool that
sleeps --tool-ms, once with a 0 ms tool. Each trajectory is its own coroutine on the engine's loop and each
tool call runs on a thread of `envs.tools.ToolExecutor`, so while one trajectory waits on its tool the others
keep the engine busy; the figure of merit is wall(tool) / wall(0 ms), goal <= 1.3.

Turns are forced, not parsed. The model is random and untrained: its text never holds a valid tool call. The
environment (`SleepToolEnv`) therefore calls the sleeping tool itself, through the executor, at each of the
first turns - 1 steps (whatever the model wrote), answers with the tool's message, and ends the episode at
step --turns. Every turn decodes exactly --max-new-tokens tokens (`ignore_eos`), and the tool's answer does
not depend on its latency, so both runs see the same tokens: the bench asserts that every trajectory's ids
are identical across the runs (SGLang's seeded sampling, one seed per trajectory and turn) and flushes the
engine's prefix cache before each timed run, so neither run reuses the other's KV.

Reported: wall time of each run, the ratio, and three references: the tool calls alone one after another
(calls x latency; 2 calls per 3-turn trajectory: the last turn calls none); a design that adds them to the
0 ms run (no overlap at all); and the critical path, the 0 ms run plus ONE trajectory's own tool calls
((turns - 1) x latency), which no overlap hides: a trajectory cannot decode its next turn before its tool
answers, so when every trajectory decodes as many tokens as the others, they reach their tools together and
the engine idles while they wait (only trajectories out of step fill that time, and only an engine whose
step time grows with its batch turns the freed batch slots into speed). Also: the share of the tool time
that overlap can hide (the serial calls less one trajectory's own) that the run hid; turns, tokens, and the
mean latency of one turn's request (queueing included) beside the tool latency. Several --max-new-tokens
values run on one engine start: the critical path's share falls as decoding grows.

Tokens per turn: 64 by default, a turn that writes a tool call and a little text. With the tiny tokenizer,
the shipped calculator example (configs/agentic_calculator.yaml) writes 74 to 76 tokens in its call turn
and about 13 in its answer turn; a model that reasons before it calls writes tens to hundreds a turn. The
earlier default, 24, is shorter than that example's call, and at 24 the critical path alone is above the
1.3x goal on the CPU engine (docs/scaling.md), so the ratio there says more about the engine's speed
than about overlap. The ratio depends on a turn's decoding time against the tool's latency, not on the
tokens as such: pass `--max-new-tokens 24 64` to see both.

Endpoint (`--endpoint`): the same trajectories driven by an external agent through the OpenAI-compatible
session endpoint (`rollout.agents.endpoint.rollout_sessions`, the real `openai` client on a thread per
trajectory) against the built-in driver: the agent and the driver's environment (`FixedToolEnv`) hold the
same conversation (the prompt, then a fixed tool message after each turn but the last, after --tool-ms), so
both record the same ids, which the bench asserts; the figure of merit is wall(endpoint) / wall(driver),
goal <= 1.2.

Routes: the rows each trajectory received (`Trajectory.route_rows_received` = T - 1, each turn asking only
for its new rows) against a design that resends the whole prefix's routes every turn
(`route_rows_if_resent`), both as int32 on the wire (x layers x topk x 4 bytes), and the driver's own
`route_bytes_received` (stored dtype, int8 for 8 experts).

    python tools/bench_agentic.py [--trajectories 32] [--turns 3] [--tool-ms 200] [--max-new-tokens 64 ...]
                                  [--group-size 4] [--reps 3] [--threads 1] [--endpoint] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megagrpo.envs.base import StepResult, ToolEnvironment
from megagrpo.envs.tools import Message, Tool, ToolExecutor
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits, rollout_episodes

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline

GOAL_RATIO = 1.3
GOAL_ENDPOINT_RATIO = 1.2
TOOL_NAME = "lookup"
TOOL_ANSWER = "found: 42"  # the same whatever the latency, so both runs insert the same tokens
WIRE_ITEMSIZE = 4  # SGLang returns routes as int32


def sleep_tool(ms: float) -> Tool:
    """A tool that blocks its thread for `ms` milliseconds (a stand-in for a search or a sandbox call)."""

    def lookup() -> str:
        time.sleep(ms / 1000.0)
        return TOOL_ANSWER

    return Tool(TOOL_NAME, "Look something up (slowly).", {"type": "object", "properties": {}}, lookup)


class SleepToolEnv(ToolEnvironment):
    """Exactly `turns` model turns: steps 1 .. turns-1 call the tool through the executor (on its thread, off
    the loop) and answer with its message, whatever the model wrote; step `turns` ends the episode. It
    offers no tool schema, so the driver parses no calls from the model's text (it would find none)."""

    def __init__(self, executor: ToolExecutor, turns: int) -> None:
        super().__init__(executor)
        self.turns, self.step_count = turns, 0

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []  # the model's text is not parsed for calls: an untrained model writes none

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, assistant_message: Message) -> StepResult:
        self.step_count += 1
        if self.step_count >= self.turns:
            return StepResult([], True, 0.0)
        call = {
            "id": f"call_{self.step_count}",
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": "{}"},
        }
        return StepResult(await self.run_tools({**assistant_message, "tool_calls": [call]}), False)


class TimedEngine:
    """The engine, with the seconds of each turn's request (queueing in the scheduler included) kept."""

    def __init__(self, engine: Any) -> None:
        self.inner, self.turn_seconds = engine, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate_turn(self, input_ids, sampling, **kw):
        t0 = time.perf_counter()
        try:
            return await self.inner.generate_turn(input_ids, sampling, **kw)
        finally:
            self.turn_seconds.append(time.perf_counter() - t0)


def bench_rows(trajectories: int, group_size: int) -> list[dict[str, Any]]:
    if trajectories < 1 or group_size < 1 or trajectories % group_size:
        raise ValueError(
            f"--trajectories {trajectories} must be a positive multiple of --group-size {group_size}"
        )
    return [
        {"prompt": f"Question {i}: what is {i} + {2 * i + 1}? Look it up."}
        for i in range(trajectories // group_size)
    ]


def run_once(
    engine: Any,
    rows: list[dict],
    *,
    group_size: int,
    turns: int,
    tool_ms: float,
    max_new_tokens: int,
    seed: int,
) -> tuple[dict[str, Any], list[list[int]]]:
    """One batch of trajectories: its figures, and every trajectory's ids (group-major)."""
    n = len(rows) * group_size
    # One executor for the batch; a slot per trajectory, so no tool call waits for another's to finish.
    executor = ToolExecutor([sleep_tool(tool_ms)], timeout_s=tool_ms / 1000.0 + 30.0, max_concurrent=n)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True, seed=seed)
    limits = MultiTurnLimits(max_turns=turns, max_tokens=turns * (max_new_tokens + 64))
    timed = TimedEngine(engine)
    t0 = time.perf_counter()
    groups, stats = rollout_episodes(
        timed, rows, lambda: SleepToolEnv(executor, turns), sampling, limits, group_size=group_size
    )
    wall = time.perf_counter() - t0
    episodes = [e for g in groups for e in g]
    short = [e.trajectory.turns for e in episodes if e.trajectory.turns != turns or not e.done]
    if short:
        raise RuntimeError(
            f"{len(short)} trajectories did not run {turns} turns to the end (turns {short[:5]}): the token "
            f"limits cut them; lower --max-new-tokens or --turns"
        )
    failed = {k: v for k, v in stats.tools.as_dict().items() if v and k != "tool_calls"}
    if failed:
        raise RuntimeError(f"tool calls failed ({failed}): the runs would insert other tool messages")
    trajs = [e.trajectory for e in episodes]
    record = {
        "tool_ms": tool_ms,
        "wall_s": wall,
        "trajectories": stats.trajectories,
        "turns": stats.turns,
        "tool_calls": stats.tools.tool_calls,
        "prompt_tokens": sum(t.prompt_ids.numel() for t in trajs),
        "model_tokens": stats.model_tokens,
        "env_tokens": stats.env_tokens,
        "model_tokens_per_s": stats.model_tokens / wall,
        "turn_s_mean": sum(timed.turn_seconds) / len(timed.turn_seconds),
        "route_rows_received": stats.route_rows_received,
        "route_rows_if_resent": stats.route_rows_if_resent,
        "route_bytes_received": stats.route_bytes_received,
    }
    return record, [t.ids.tolist() for t in trajs]


def run_config(
    trajectories: int, turns: int, tool_ms: float, max_new_tokens: int, group_size: int, reps: int, seed: int
) -> dict[str, Any]:
    """A comparison's settings, as its JSON result records them."""
    return dict(
        trajectories=trajectories,
        turns=turns,
        tool_ms=tool_ms,
        max_new_tokens=max_new_tokens,
        group_size=group_size,
        reps=reps,
        seed=seed,
    )


def compare(
    engine: Any,
    *,
    trajectories: int = 32,
    turns: int = 3,
    tool_ms: float = 200.0,
    max_new_tokens: int = 64,
    group_size: int = 4,
    reps: int = 1,
    seed: int = 0,
    reset: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """The same batch with a `tool_ms` tool and with a 0 ms tool, `reps` times each (alternating, best wall
    time kept); `reset()` runs before every timed run (the real engine: flush the prefix cache). Raises
    AssertionError when any run's token ids differ from the first run's."""
    if turns < 2:
        raise ValueError(f"--turns {turns}: a tool runs between turns, so at least 2")
    rows = bench_rows(trajectories, group_size)
    kw = dict(group_size=group_size, turns=turns, max_new_tokens=max_new_tokens, seed=seed)
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "tool": []}
    first_ids: list[list[int]] | None = None
    for _ in range(reps):
        for name, ms in (("baseline", 0.0), ("tool", tool_ms)):
            if reset is not None:
                reset()
            rec, ids = run_once(engine, rows, tool_ms=ms, **kw)
            runs[name].append(rec)
            first_ids = ids if first_ids is None else first_ids
            differ = sum(x != y for x, y in zip(first_ids, ids))
            assert differ == 0, (
                f"{differ} of {trajectories} trajectories have other token ids than in the first run: the runs "
                "sampled different tokens, so their times are not comparable"
            )
    base = min(runs["baseline"], key=lambda r: r["wall_s"])
    tool = min(runs["tool"], key=lambda r: r["wall_s"])
    serial_tool_s = tool["tool_calls"] * tool_ms / 1000.0
    critical_path_s = base["wall_s"] + (turns - 1) * tool_ms / 1000.0
    extra_s = tool["wall_s"] - base["wall_s"]
    hideable_s = serial_tool_s - (turns - 1) * tool_ms / 1000.0  # all but one trajectory's own calls
    n = tool["trajectories"]
    layers, topk = engine.num_layers, engine.topk
    wire = layers * topk * WIRE_ITEMSIZE
    received, resent = tool["route_rows_received"] * wire, tool["route_rows_if_resent"] * wire
    return {
        "config": run_config(trajectories, turns, tool_ms, max_new_tokens, group_size, reps, seed),
        "baseline": base,
        "tool": tool,
        "runs": runs,
        "identical_ids": True,  # asserted above, for every run
        "ratio": tool["wall_s"] / base["wall_s"],
        "goal_ratio": GOAL_RATIO,
        "meets_goal": tool["wall_s"] / base["wall_s"] <= GOAL_RATIO,
        "serial_tool_s": serial_tool_s,
        "no_overlap_s": base["wall_s"] + serial_tool_s,
        "no_overlap_ratio": (base["wall_s"] + serial_tool_s) / base["wall_s"],
        "critical_path_s": critical_path_s,
        "critical_path_ratio": critical_path_s / base["wall_s"],
        "tool_time_hidden_frac": (serial_tool_s - extra_s) / hideable_s if hideable_s > 0 else None,
        "routes": {
            "layers": layers,
            "topk": topk,
            "rows_received_per_traj": tool["route_rows_received"] / n,
            "rows_if_resent_per_traj": tool["route_rows_if_resent"] / n,
            "wire_bytes_received_per_traj": received / n,
            "wire_bytes_if_resent_per_traj": resent / n,
            "resent_over_received": resent / received if received else None,
            "stored_bytes_received_per_traj": tool["route_bytes_received"] / n,
        },
    }


class FixedToolEnv:
    """The driver's side of the endpoint comparison: exactly `turns` model turns, each but the last answered,
    after `tool_ms` on a thread, with the fixed tool message `fixed_tool_agent` sends."""

    def __init__(self, turns: int, tool_ms: float) -> None:
        self.turns, self.tool_ms, self.step_count = turns, tool_ms, 0

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, assistant_message: Message) -> StepResult:
        import asyncio

        self.step_count += 1
        if self.step_count >= self.turns:
            return StepResult([], True, 0.0)
        await asyncio.to_thread(time.sleep, self.tool_ms / 1000.0)
        return StepResult([tool_message(self.step_count)], False)


def tool_message(k: int) -> Message:
    return {"role": "tool", "tool_call_id": f"call_{k}", "name": TOOL_NAME, "content": TOOL_ANSWER}


def fixed_tool_agent(base_url: str, row: dict[str, Any], *, turns: int, tool_ms: float) -> float:
    """`FixedToolEnv`'s conversation from an agent's side, through the real OpenAI client."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(row["prompt"])}]
    for k in range(1, turns + 1):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        if k == turns:
            break
        messages.append(reply.model_dump(exclude_none=True))
        time.sleep(tool_ms / 1000.0)
        messages.append(tool_message(k))
    return 0.0


def compare_endpoint(
    engine: Any,
    *,
    trajectories: int = 32,
    turns: int = 3,
    tool_ms: float = 200.0,
    max_new_tokens: int = 64,
    group_size: int = 4,
    reps: int = 1,
    seed: int = 0,
    reset: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """The same batch through the built-in driver and through the agent endpoint, `reps` times each
    (alternating, best wall time kept); AssertionError when any run's ids differ from the first run's."""
    import functools

    from megagrpo.rollout.agents.endpoint import AgentRunner, EndpointOptions, rollout_sessions

    rows = bench_rows(trajectories, group_size)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True, seed=seed)
    limits = MultiTurnLimits(max_turns=turns, max_tokens=turns * (max_new_tokens + 64))
    agent = AgentRunner(functools.partial(fixed_tool_agent, turns=turns, tool_ms=tool_ms))
    runs: dict[str, list[float]] = {"driver": [], "endpoint": []}
    first: list[list[int]] | None = None
    for _ in range(reps):
        for name in runs:
            if reset is not None:
                reset()
            t0 = time.perf_counter()
            if name == "driver":
                groups, _ = rollout_episodes(
                    engine,
                    rows,
                    lambda: FixedToolEnv(turns, tool_ms),
                    sampling,
                    limits,
                    group_size=group_size,
                )
            else:
                groups, _ = rollout_sessions(
                    engine, rows, agent, sampling, limits, group_size=group_size,
                    options=EndpointOptions(timeout_s=600.0, max_concurrent=len(rows) * group_size),  # as the driver
                )  # fmt: skip
            runs[name].append(time.perf_counter() - t0)
            episodes = [e for g in groups for e in g]
            bad = [e.agent_failure or e.truncation for e in episodes if e.agent_failure or e.truncated]
            assert not bad, f"{name}: {len(bad)} trajectories failed or were cut ({bad[:3]})"
            ids = [e.trajectory.ids.tolist() for e in episodes]
            first = ids if first is None else first
            differ = sum(x != y for x, y in zip(first, ids))
            assert differ == 0, (
                f"{name}: {differ} of {trajectories} trajectories have other ids than the first run"
            )
    driver, endpoint = min(runs["driver"]), min(runs["endpoint"])
    return {
        "config": run_config(trajectories, turns, tool_ms, max_new_tokens, group_size, reps, seed),
        "driver_s": driver,
        "endpoint_s": endpoint,
        "runs": runs,
        "identical_ids": True,  # asserted above, for every run of both
        "ratio": endpoint / driver,
        "goal_ratio": GOAL_ENDPOINT_RATIO,
        "meets_goal": endpoint / driver <= GOAL_ENDPOINT_RATIO,
    }


def render_endpoint(result: Mapping[str, Any]) -> None:
    from rich.console import Console

    c, ok = result["config"], result["meets_goal"]
    Console().print(
        f"endpoint vs driver, {c['trajectories']} trajectories x {c['turns']} turns, {c['max_new_tokens']} tokens "
        f"per turn, {c['tool_ms']:g} ms tool (best of {c['reps']}): driver {result['driver_s']:.2f} s, endpoint "
        f"{result['endpoint_s']:.2f} s = [{'green' if ok else 'red'}]{result['ratio']:.2f}x[/] (goal <= "
        f"{result['goal_ratio']}x); identical token ids: {result['identical_ids']}"
    )


def render(result: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    c = result["config"]
    t = Table(
        title=f"{c['trajectories']} trajectories x {c['turns']} turns, {c['max_new_tokens']} tokens per turn, "
        f"one CPU engine (best of {c['reps']})"
    )
    for col in (
        "run",
        "wall s",
        "turns",
        "tool calls",
        "model tokens",
        "env tokens",
        "tok/s",
        "turn s (mean)",
    ):
        t.add_column(col, justify="left" if col == "run" else "right")
    for name in ("baseline", "tool"):
        r = result[name]
        t.add_row(
            f"{name} ({r['tool_ms']:g} ms tool)", f"{r['wall_s']:.2f}", str(r["turns"]), str(r["tool_calls"]),
            str(r["model_tokens"]), str(r["env_tokens"]), f"{r['model_tokens_per_s']:.0f}", f"{r['turn_s_mean']:.3f}",
        )  # fmt: skip
    con.print(t)
    ok = result["meets_goal"]
    hidden = result["tool_time_hidden_frac"]
    con.print(
        f"ratio tool/baseline: [{'green' if ok else 'red'}]{result['ratio']:.2f}x[/] (goal <= {result['goal_ratio']}x)"
        + (f", {100 * hidden:.0f}% of the hideable tool time hidden" if hidden is not None else "")
    )
    con.print(
        f"serial references: the {result['tool']['tool_calls']} tool calls one after another "
        f"{result['serial_tool_s']:.1f} s; baseline + them (no overlap) {result['no_overlap_s']:.1f} s "
        f"= {result['no_overlap_ratio']:.2f}x"
    )
    con.print(
        f"critical path (baseline + one trajectory's own {c['turns'] - 1} tool calls, which nothing hides): "
        f"{result['critical_path_s']:.2f} s = {result['critical_path_ratio']:.2f}x"
    )
    con.print(f"identical token ids across runs: {result['identical_ids']}")
    r = result["routes"]
    con.print(
        f"routes per trajectory (int32 on the wire, L={r['layers']} K={r['topk']}): received "
        f"{r['wire_bytes_received_per_traj']:.0f} B ({r['rows_received_per_traj']:.0f} rows) vs resend-every-turn "
        f"{r['wire_bytes_if_resent_per_traj']:.0f} B ({r['rows_if_resent_per_traj']:.0f} rows): "
        f"{r['resent_over_received']:.2f}x; stored {r['stored_bytes_received_per_traj']:.0f} B"
    )


def flush_prefix_cache(engine: Any, timeout_s: float = 120.0) -> None:
    """Empty the engine's prefix cache (SGLang's flush succeeds only once the scheduler is idle)."""
    deadline = time.monotonic() + timeout_s
    while not getattr(engine.engine.flush_cache(), "success", True):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the SGLang scheduler did not become idle within {timeout_s:.0f} s")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--turns", type=int, default=3, help="model turns per trajectory (tools between them)")
    p.add_argument("--tool-ms", type=float, default=200.0, help="latency of each tool call")
    p.add_argument(
        "--max-new-tokens", type=int, nargs="+", default=[64], help="tokens decoded per turn (one run each)"
    )
    p.add_argument("--group-size", type=int, default=4, help="samples per data row")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each batch, alternating (best kept)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads here and in the engine")
    p.add_argument(
        "--endpoint", action="store_true", help="also time the agent endpoint against the built-in driver"
    )
    p.add_argument("--json", help="write the figures (and the machine) to this file")
    a = p.parse_args(argv)
    bench_rows(a.trajectories, a.group_size)  # fail on bad sizes before the engine starts
    machine = describe()
    print(headline(machine), flush=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # read by the engine's spawned processes at start

    import torch

    torch.set_num_threads(a.threads)
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from megagrpo.rollout import RolloutConfig, RolloutEngine
    from megagrpo.tiny_model import make_tiny_model

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_agentic_") as tmp:
        model = make_tiny_model(Path(tmp) / "model", "qwen3_moe", experts=8, topk=2, seed=0)
        longest = max(a.max_new_tokens)
        kv_tokens = max(4096, 2 * a.trajectories * (96 + a.turns * (longest + 32)))
        cfg = RolloutConfig(str(model), dtype="float32", max_total_tokens=kv_tokens, seed=0)
        t0 = time.perf_counter()
        with RolloutEngine(cfg) as engine:
            print(f"engine started in {time.perf_counter() - t0:.0f} s", flush=True)
            # first-batch costs, outside the timed runs
            compare(engine, trajectories=a.group_size, group_size=a.group_size, turns=a.turns, tool_ms=0.0,
                    max_new_tokens=longest)  # fmt: skip
            for n in a.max_new_tokens:
                result = compare(
                    engine,
                    trajectories=a.trajectories,
                    turns=a.turns,
                    tool_ms=a.tool_ms,
                    max_new_tokens=n,
                    group_size=a.group_size,
                    reps=a.reps,
                    reset=lambda: flush_prefix_cache(engine),
                )
                results.append(result)
                render(result)
                if a.endpoint:
                    result = compare_endpoint(
                        engine,
                        trajectories=a.trajectories,
                        turns=a.turns,
                        tool_ms=a.tool_ms,
                        max_new_tokens=n,
                        group_size=a.group_size,
                        reps=a.reps,
                        reset=lambda: flush_prefix_cache(engine),
                    )
                    results.append(result)
                    render_endpoint(result)
    machine = describe(machine)
    print(headline(machine))
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"machine": machine, "threads": a.threads, "results": results}, indent=2) + "\n"
        )
        print(f"figures: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
