"""The trainer's KL-in-reward hunk (algo.kl.placement=reward) on a hand-made batch: rewards reshaped to
their groups, advantages replaced by those of the penalised rewards, and the loss without a KL term."""

from __future__ import annotations

import types

import pytest
import torch

from megagrpo.algo.advantages import group_advantages
from megagrpo.algo.kl import kl_penalised_rewards
from megagrpo.config import config_from_dict
from megagrpo.diagnostics.reduce import LocalReducer
from megagrpo.trainer.grpo import GRPOTrainer

G = 2


def make_cfg(placement: str):
    return config_from_dict(
        {
            "model": {"hf_path": "m"},
            "rollout": {"group_size": G},
            "algo": {"advantages": "rloo", "kl": {"coef": 0.3, "estimator": "k2", "placement": placement}},
        }
    )


def learner_batch():
    # Two groups of G=2; prompt of 2 tokens, responses of 3, 1, 2, 3 tokens; row 3 filtered from the loss.
    seq_lens = torch.tensor([5, 3, 4, 5])
    response_len = torch.tensor([3, 1, 2, 3])
    cols = torch.arange(5)
    resp = (cols >= (seq_lens - response_len)[:, None]) & (cols < seq_lens[:, None])
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.zeros(4, 5, dtype=torch.int64),
        "seq_lens": seq_lens,
        "response_len": response_len,
        "loss_mask": resp & torch.tensor([True, True, True, False])[:, None],
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "advantages": torch.tensor([0.5, -0.5, 0.0, 0.0]),
        "old_logp": -torch.rand(4, 5, generator=g),
        "ref_logp": -torch.rand(4, 5, generator=g),
    }, resp


def test_reward_placement_replaces_the_advantages_per_group():
    cfg = make_cfg("reward")
    batch, resp = learner_batch()
    shaped, pen = kl_penalised_rewards(
        torch.tensor([1.0, 0.0, 1.0, 1.0]), batch["old_logp"], batch["ref_logp"], resp, 0.3, "k2"
    )
    want = group_advantages(shaped.view(2, G), "rloo").reshape(-1)
    # The local batch holds the rows in the data plane's order, not the groups' (local row i is global
    # row order[i]); the advantages must still come from each row's own group.
    order = torch.tensor([2, 0, 3, 1])
    local = {k: v[order] for k, v in batch.items()}
    trainer = types.SimpleNamespace(cfg=cfg, _dp_reducer=LocalReducer)
    rows = types.SimpleNamespace(local=order, session=torch.arange(4), session_response_len=torch.zeros(4))
    m = GRPOTrainer._kl_in_reward(trainer, local, rows)
    torch.testing.assert_close(local["advantages"], want[order])
    # The overlong-filtered row 3 still pays its penalty, so its group's baseline is not biased.
    assert pen[3] > 0
    assert want[2] != 0  # equal raw rewards, different penalties
    assert m["reward/kl_penalty_mean"] == pytest.approx(float(pen.mean()))
    assert m["adv/abs_max"] == pytest.approx(float(want.abs().max()))


@pytest.mark.parametrize("placement,kl_coef", [("loss", 0.3), ("reward", 0.0)])
def test_the_loss_carries_the_kl_only_with_the_loss_placement(placement, kl_coef, monkeypatch):
    seen = {}

    def fake_policy_loss(*args, **kwargs):
        seen.update(kwargs)
        return torch.zeros(()), {}

    monkeypatch.setattr("megagrpo.trainer.grpo.policy_loss", fake_policy_loss)
    cfg = make_cfg(placement)
    loss_fn = GRPOTrainer._loss_fn(types.SimpleNamespace(cfg=cfg), 1.0)
    batch, _ = learner_batch()
    loss_fn(batch["old_logp"], None, batch)
    assert seen["kl_coef"] == kl_coef
    assert seen["ref_logp"] is batch["ref_logp"]  # loss/kl is measured under both placements
