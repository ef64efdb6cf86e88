"""`megagrpo train` with algo.kl.placement=reward, 2 steps, against the same seeded run without KL.

At step 1 the old policy is the reference, so the penalty is 0 and both runs make the same update; step 2
then samples the same completions with the same raw rewards in both runs, and only the KL penalty
(positive now that the policy has moved) separates their advantages.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.integration.pooled_runs import run_pooled


def write_config(tmp: Path, model: Path, kl: dict) -> Path:
    cfg = {
        "model": {"hf_path": str(model), "dtype": "float32"},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8},
        # dr_grpo: a group z-score would rescale every group to unit std and hide the penalty in adv/std.
        "algo": {"advantages": "dr_grpo", "dynamic_sampling": False, "kl": kl},
        "replay": "none",
        "data": {
            "synthetic": {"task": "addition", "max_digits": 2, "num_train": 64, "num_eval": 4, "seed": 3}
        },
        "rewards": {"functions": [{"name": "tests.integration.trainer_rewards:output_parity"}]},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.0},
        "schedule": {"steps": 2, "micro_batch_size": 16, "eval_every": 0, "save_every": 0, "seed": 0},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "logging": {"out_dir": str(tmp / "run"), "tensorboard": False, "console": False},
    }
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def records(run: Path) -> dict[int, dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): r for r in map(json.loads, filter(str.strip, lines))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs in one process with one pooled SGLang engine (`pooled_runs.py`): the second gets the
    engine back with the model's initial weights, as a fresh engine would load them."""
    from megagrpo.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("model") / "m", "qwen3_moe", seed=1)
    no_kl, in_reward = tmp_path_factory.mktemp("no_kl"), tmp_path_factory.mktemp("kl_reward")
    configs = [
        write_config(no_kl, model, {"coef": 0.0}),
        write_config(in_reward, model, {"coef": 0.5, "estimator": "k3", "placement": "reward"}),
    ]
    res = run_pooled(*map(str, configs), timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    return records(no_kl / "run"), records(in_reward / "run")


def test_reward_placement_penalises_rewards_and_changes_advantages(runs):
    no_kl, in_reward = runs
    first, second = in_reward[1], in_reward[2]
    # Step 1: the old policy is the reference, so KL(old || ref) is 0 to rounding.
    assert math.isfinite(first["reward/kl_penalty_mean"]) and abs(first["reward/kl_penalty_mean"]) < 1e-6
    assert first["adv/std"] == pytest.approx(no_kl[1]["adv/std"], abs=1e-6)
    # Step 2: the same samples and raw rewards, a positive penalty, different advantages.
    pen = second["reward/kl_penalty_mean"]
    assert math.isfinite(pen) and pen > 0, pen
    assert second["reward/mean"] == pytest.approx(no_kl[2]["reward/mean"], abs=1e-6)
    assert (second["adv/std"], second["adv/abs_max"]) != (no_kl[2]["adv/std"], no_kl[2]["adv/abs_max"])
    # The KL of the policy being updated is measured, not optimised, and only where a reference exists.
    assert math.isfinite(second["loss/kl"]) and second["loss/kl"] > 0
    assert "loss/kl" not in no_kl[2] and "reward/kl_penalty_mean" not in no_kl[2]
