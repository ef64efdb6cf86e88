"""The arithmetic of tools/bench_step.py: phases, compute vs framework overhead, warm-up and skipped steps."""

from __future__ import annotations

import asyncio

import pytest

from tools.bench_step import OTHER, PHASES, ComputeClock, parity_reward, step_record, summarize


def metrics(step: float, skipped: bool = False, **phases: float) -> dict[str, float]:
    m = {"perf/step_seconds": step, "rollout/skipped_step": float(skipped)}
    m.update({f"perf/{k}_seconds": v for k, v in phases.items()})
    return m


def test_phases_other_compute_and_overhead():
    recs = [
        step_record(metrics(100.0, rollout=99.0), {"rollout": {"generate": 99.0}}),  # warm-up: ignored
        step_record(
            metrics(10.0, rollout=4.0, reward=0.5, sleep=0.5, old_logp=1.0, train=3.0, sync=0.5),
            {
                "rollout": {"generate": 3.0},
                "old_logp": {"forward_backward": 0.8},
                "train": {"forward_backward": 2.0, "optimizer": 0.5},
                "sync": {"weight_load": 0.25},
            },
        ),
        step_record(
            metrics(20.0, rollout=8.0, reward=1.0, sleep=1.0, old_logp=2.0, train=6.0, sync=1.0),
            {
                "rollout": {"generate": 6.0},
                "old_logp": {"forward_backward": 1.6},
                "train": {"forward_backward": 4.0, "optimizer": 1.0},
                "sync": {"weight_load": 0.5},
                OTHER: {"forward_backward": 0.3},
            },
        ),
    ]
    s = summarize(recs, warmup=1)
    assert s["steps_measured"] == 2
    assert s["step_seconds"] == pytest.approx(15.0)
    assert s["phases"]["rollout"]["seconds"] == pytest.approx(6.0)
    assert s["phases"]["rollout"]["overhead_seconds"] == pytest.approx(1.5)
    assert s["phases"]["train"]["compute_seconds"] == pytest.approx(3.75)
    assert s["phases"][OTHER]["seconds"] == pytest.approx(15.0 - 14.25)
    assert s["phases"][OTHER]["compute_seconds"] == pytest.approx(0.15)
    assert sum(f["share"] for f in s["phases"].values()) == pytest.approx(1.0)
    assert s["compute_by_kind"] == pytest.approx(
        {"generate": 4.5, "forward_backward": 4.35, "optimizer": 0.75, "weight_load": 0.375}
    )
    assert s["compute_seconds"] == pytest.approx(9.975)
    assert s["overhead_seconds"] == pytest.approx(15.0 - 9.975)
    assert s["overhead_share"] == pytest.approx((15.0 - 9.975) / 15.0)
    assert s["compute_share"] + s["overhead_share"] == pytest.approx(1.0)
    assert s["meets_goal"] is False
    assert sum(f["overhead_seconds"] for f in s["phases"].values()) == pytest.approx(s["overhead_seconds"])


def test_skipped_steps_are_excluded_and_an_empty_measure_raises():
    good = step_record(metrics(2.0, train=2.0), {"train": {"forward_backward": 1.9}})
    skipped = step_record(metrics(50.0, skipped=True, rollout=50.0), {"rollout": {"generate": 49.0}})
    s = summarize([good, skipped, good], warmup=0)
    assert s["steps_measured"] == 2 and s["steps_skipped"] == 1
    assert s["overhead_share"] == pytest.approx(0.05)
    assert s["meets_goal"] is True
    with pytest.raises(ValueError, match="no measured step"):
        summarize([good, skipped], warmup=1)
    with pytest.raises(ValueError, match="warmup"):
        summarize([good], warmup=-1)


def test_compute_clock_attributes_sync_and_async_calls_to_the_current_phase():
    clock = ComputeClock()
    add = clock.timed("optimizer", lambda a, b: a + b)

    async def gen(x):
        return x * 2

    agen = clock.timed_async("generate", gen)
    clock.phase = "train"
    assert add(2, 3) == 5
    clock.phase = "rollout"
    assert asyncio.run(agen(4)) == 8
    taken = clock.take()
    assert set(taken) == {"train", "rollout"}
    assert set(taken["train"]) == {"optimizer"} and taken["train"]["optimizer"] >= 0.0
    assert set(taken["rollout"]) == {"generate"}
    assert clock.take() == {}
    assert set(PHASES) >= {"rollout", "train", "sync"}


def test_parity_reward_varies_with_length():
    assert parity_reward("p", "ab", {}) == 1.0
    assert parity_reward("p", "abc", {}) == 0.0
