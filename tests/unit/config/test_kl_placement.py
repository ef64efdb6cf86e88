"""algo.kl.placement: its default, and the combination it refuses (GDPO advantages)."""

from __future__ import annotations

import pytest

from megagrpo.config import config_from_dict
from megagrpo.errors import MegagrpoError

BASE = {"model": {"hf_path": "m"}}


def test_placement_defaults_to_the_loss_and_accepts_the_reward():
    assert config_from_dict(BASE).algo.kl.placement == "loss"
    cfg = config_from_dict(
        {**BASE, "algo": {"kl": {"coef": 0.05, "placement": "reward"}, "advantages": "rloo"}}
    )
    assert cfg.algo.kl.placement == "reward"


def test_reward_placement_with_gdpo_is_rejected_naming_both_fields():
    with pytest.raises(MegagrpoError) as e:
        config_from_dict(
            {
                **BASE,
                "algo": {"kl": {"coef": 0.05, "placement": "reward"}, "advantages": "gdpo"},
                "rewards": {"combine": "gdpo"},
            }
        )
    msg = str(e.value)
    assert "algo.kl.placement: 'reward' with algo.advantages=gdpo" in msg
    assert "set algo.kl.placement=loss" in msg


def test_reward_placement_with_rollout_old_logp_is_allowed():
    cfg = config_from_dict(
        {
            **BASE,
            "algo": {"kl": {"coef": 0.05, "placement": "reward"}, "old_logp": "rollout"},
            "diagnostics": {"mismatch": False},
        }
    )
    assert cfg.algo.old_logp == "rollout"
