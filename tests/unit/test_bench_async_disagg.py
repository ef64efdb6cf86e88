"""The pure parts of tools/bench_async.py: the disaggregated run is the pinned runs' config launched as a
user launches it (1 learner rank + 1 engine rank), the steps left out of the figures, and the ratios."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from megagrpo.cli import build_parser
from megagrpo.config import check_mesh, load_config
from tools.bench_async import DISAGG_NPROC, disaggregated_command, figures, overrides, ratios

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/demo_qwen3_moe.yaml"


def bench_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"steps": 8, "prompts": 8, "group_size": 8, "new_tokens": 48, **kw})


def test_the_disaggregated_launch_is_the_users_command_with_the_shared_overrides(tmp_path):
    over = overrides(tmp_path, tmp_path / "model", "async_disaggregated", bench_args())
    cmd = disaggregated_command(CONFIG, over, k=1)
    assert cmd[:4] == [sys.executable, "-m", "megagrpo.cli", "train"]
    # megagrpo's own parser reads it: the config, --nproc 2, and every override after it
    args, extra = build_parser().parse_known_args(cmd[3:])
    assert args.cmd == "train" and args.config == str(CONFIG) and args.nproc == DISAGG_NPROC == 2
    given = [*args.overrides, *extra]
    assert given[: len(over)] == over  # the pinned runs' overrides, in full
    assert given[len(over) :] == [
        "rollout.placement.kind=disaggregated",
        "rollout.num_engines=1",
        "rollout.mode=async",
        "rollout.max_staleness=1",
    ]
    assert not any("engine_cores" in o for o in given)  # ignored when disaggregated: not passed


def test_the_disaggregated_config_splits_two_ranks_into_one_learner_and_one_engine(tmp_path):
    over = overrides(tmp_path, tmp_path / "model", "async_disaggregated", bench_args(steps=6, prompts=4))
    cmd = disaggregated_command(CONFIG, over, k=2)
    cfg = load_config(CONFIG, cmd[cmd.index("--nproc") + 2 :], stage="train", check_paths=False)
    r = cfg.rollout
    assert (r.mode, r.max_staleness, r.placement.kind) == ("async", 2, "disaggregated")
    assert (r.prompts_per_step, r.group_size, r.max_new_tokens) == (4, 8, 48)
    assert cfg.schedule.steps == 6 and cfg.algo.dynamic_sampling is False
    mesh = check_mesh(cfg, DISAGG_NPROC, "train", on_gpu=False)
    assert (mesh.learners, mesh.num_engines, mesh.engine_ranks) == (1, 1, 1)


def record(step: int, seconds: float) -> dict:
    return {
        "step": step,
        "perf/step_seconds": seconds,
        "perf/rollout_seconds": 0.5,
        "perf/learner_idle_seconds": 0.6,
        "perf/sampler_idle_seconds": 0.2,
        "perf/sync_seconds": 0.3,
        "rollout/completions": 64.0,
        "rollout/staleness_mean": 1.0,
    }


def test_figures_leave_out_the_first_and_the_last_step():
    recs = [record(1, 100.0), *(record(s, 2.0 + (s % 2)) for s in range(2, 8)), record(8, 50.0)]
    f = figures(recs)
    assert f["measured_steps"] == 6  # steps 2-7 of 8
    assert f["step_seconds"] == pytest.approx(2.5)
    assert f["steps_per_minute"] == pytest.approx(24.0)
    assert f["sync_seconds"] == pytest.approx(0.3) and f["sleep_seconds"] == 0.0
    # idle 0.6 = the rollout phase 0.5 + the wait before the sync
    assert f["sync_wait_seconds"] == pytest.approx(0.1)


def test_ratios_are_against_colocated():
    colo = {"steps_per_minute": 20.0}
    got = ratios(
        colo, {"async": {"steps_per_minute": 40.0}, "async_disaggregated": {"steps_per_minute": 30.0}}
    )
    assert got == {"async": pytest.approx(2.0), "async_disaggregated": pytest.approx(1.5)}
