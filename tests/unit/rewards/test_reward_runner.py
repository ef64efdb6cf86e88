"""RewardRunner: weighting, the [n, G, K] GDPO tensor, user rewards by import path, errors and timeouts."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from megagrpo.config import RewardsConfig
from megagrpo.errors import MegagrpoError
from megagrpo.rewards import DeadlinePool, RewardRunner


@pytest.fixture
def user_module():
    mod = types.ModuleType("megagrpo_test_user_rewards")

    def length_bonus(prompt, completion, sample):
        return len(completion) / 10

    def raises(prompt, completion, sample):
        if "boom" in completion:
            raise RuntimeError("verifier crashed")
        return 1.0

    def spins(prompt, completion, sample):
        if "hang" in completion:
            while True:  # a pure-Python hang: the deadline interrupts it
                pass
        return 1.0

    def make_scaled(scale):
        return lambda p, c, s: scale

    mod.length_bonus, mod.raises, mod.spins, mod.make_scaled = length_bonus, raises, spins, make_scaled
    mod.not_a_number = lambda p, c, s: "yes"
    mod.CONSTANT = 3
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


def runner(*functions, combine="weighted") -> RewardRunner:
    return RewardRunner(RewardsConfig.model_validate({"functions": list(functions), "combine": combine}))


COMPLETIONS = ["<answer>5</answer>", "<answer>6</answer>", "x", "<answer>7</answer>"]
SAMPLES = [{"answer": "5"}, {"answer": "5"}, {"answer": "7"}, {"answer": "7"}]


def test_weighted_combination_and_gdpo_tensor(user_module):
    r = runner(
        {"name": "arithmetic", "weight": 1.0},
        {"name": "format", "weight": 0.5},
        {"name": f"{user_module}:length_bonus", "weight": 2.0},
    )
    out = r.score(["p"] * 4, COMPLETIONS, SAMPLES, group_size=2)
    assert out.names == ["arithmetic", "format", "length_bonus"]
    assert out.per_reward.shape == (2, 2, 3) and out.rewards.shape == (2, 2) and out.failed.shape == (2, 2, 3)
    expected = torch.tensor([[1, 1, 1.8], [0, 1, 1.8], [0, 0, 0.1], [1, 1, 1.8]])
    torch.testing.assert_close(out.per_reward.reshape(4, 3), expected)
    torch.testing.assert_close(out.rewards.reshape(4), expected @ torch.tensor([1.0, 0.5, 2.0]))
    assert out.metrics["reward/arithmetic/mean"] == pytest.approx(0.5)
    assert out.metrics["reward/mean"] == pytest.approx(out.rewards.mean().item())
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/timeouts"] == 0
    r.close()


def test_raising_and_non_numeric_rewards_score_zero_and_are_counted(user_module):
    r = runner({"name": f"{user_module}.raises"}, {"name": f"{user_module}:not_a_number", "label": "nan"})
    out = r.score(["p"] * 4, ["ok", "boom", "ok", "boom"], [{}] * 4, group_size=2)
    torch.testing.assert_close(out.per_reward[..., 0].reshape(4), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert out.metrics["reward/raises/errors"] == 2 and out.metrics["reward/nan/errors"] == 4
    assert out.metrics["reward/errors"] == 6 and out.failed.sum() == 6
    out = r.score(["p"] * 2, ["boom", "ok"], [{}] * 2, group_size=2)
    assert out.metrics["reward/errors_total"] == 9  # the run keeps going and keeps counting
    resumed = runner(
        {"name": f"{user_module}.raises"}, {"name": f"{user_module}:not_a_number", "label": "nan"}
    )
    resumed.load_state_dict(r.state_dict())  # a checkpoint carries the run-long counters
    out = resumed.score(["p"] * 2, ["boom", "ok"], [{}] * 2, group_size=2)
    assert out.metrics["reward/errors_total"] == 12
    r.close()
    resumed.close()


def test_a_hanging_reward_times_out_without_stopping_the_batch(user_module):
    r = runner({"name": f"{user_module}:spins", "timeout_s": 0.3}, {"name": "format"})
    out = r.score(["p"] * 4, ["hang", "<answer>1</answer>", "hang", "ok"], [{}] * 4, group_size=2)
    torch.testing.assert_close(out.per_reward[..., 0].reshape(4), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    torch.testing.assert_close(out.per_reward[..., 1].reshape(4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert out.metrics["reward/timeouts"] == 2 and out.metrics["reward/spins/timeouts"] == 2
    assert out.failed[..., 0].reshape(4).tolist() == [True, False, True, False]
    # the pool replaced the two stuck workers: later batches still run at full width
    again = r.score(["p"] * 2, ["ok", "ok"], [{}] * 2, group_size=2)
    assert again.per_reward[..., 0].flatten().tolist() == [1.0, 1.0]
    assert r.pool.abandoned_threads == 2
    r.close()


def test_deadline_pool_spinning_thread_is_stopped():
    import threading

    def spin():
        while True:
            pass

    pool = DeadlinePool(1, name="spin-test")
    out = pool.map([(spin, 0.1), (lambda: 7, 1.0)])
    assert out[0].timed_out and out[1].value == 7
    deadline = time.monotonic() + 5
    while any(t.name == "spin-test-0" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "spin-test-0" for t in threading.enumerate()), (
        "the spinning worker was not stopped"
    )
    pool.close()


def test_factory_by_import_path_and_bad_names(user_module):
    r = runner({"name": f"{user_module}:make_scaled", "kwargs": {"scale": 0.25}, "label": "scaled"})
    assert r.score(["p"] * 2, ["a", "b"], [{}] * 2, 2).per_reward.flatten().tolist() == [0.25, 0.25]
    with pytest.raises(MegagrpoError, match=r"rewards.functions\[0\].name: 'nope' is not a built-in"):
        runner({"name": "nope"})
    with pytest.raises(MegagrpoError, match="cannot import 'no_such_module_xyz:f'"):
        runner({"name": "no_such_module_xyz:f"})
    with pytest.raises(MegagrpoError, match="is a int, not a callable"):
        runner({"name": f"{user_module}:CONSTANT"})
    with pytest.raises(MegagrpoError, match=r"rewards.functions\[0\].kwargs: .* not valid for 'format'"):
        runner({"name": "format", "kwargs": {"colour": "red"}})


def test_bad_batches_are_rejected():
    r = runner({"name": "format"})
    with pytest.raises(MegagrpoError, match="same length"):
        r.score(["p"], ["a", "b"], [{}, {}], 2)
    with pytest.raises(MegagrpoError, match="do not split into groups of 2"):
        r.score(["p"] * 3, ["a"] * 3, [{}] * 3, 2)
    r.close()
