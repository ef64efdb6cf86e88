"""KL in the reward (algo.kl.placement=reward): the penalised rewards against a per-token Python
reference, and the response mask the trainer feeds it."""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.algo.advantages import group_advantages
from megagrpo.algo.kl import ESTIMATORS, kl_penalised_rewards
from megagrpo.trainer.batch import response_mask

F64 = torch.float64


def reference_kl(lp: float, ref: float, estimator: str) -> float:
    """Schulman (2020) estimators written from the formulas, one token at a time."""
    r = ref - lp  # log(pi_ref / pi_theta)
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return r * r / 2
    if estimator == "low_var_kl":
        r = min(max(r, -20.0), 20.0)
        return min(max(math.exp(r) - 1 - r, -10.0), 10.0)
    return math.exp(r) - 1 - r


def reference_penalised(rewards, logp, ref_logp, mask, coef, estimator):
    out, pen = [], []
    for i in range(len(rewards)):
        s = sum(
            reference_kl(logp[i][t], ref_logp[i][t], estimator) for t in range(len(mask[i])) if mask[i][t]
        )
        pen.append(coef * s)
        out.append(rewards[i] - coef * s)
    return out, pen


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_penalised_rewards_match_the_per_token_reference(estimator):
    g = torch.Generator().manual_seed(7)
    B, T = 6, 9
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    ref_logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
    ref_logp[0, 4] = logp[0, 4] + 30.0  # a wild token: low_var_kl clamps it, k3 does not
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[1] = False  # an empty response gets no penalty
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0, 2.0, 0.0], dtype=F64)
    # Outside the response the inputs may hold anything.
    logp_dirty = torch.where(mask, logp, torch.nan)
    shaped, penalty = kl_penalised_rewards(rewards, logp_dirty, ref_logp, mask, 0.1, estimator)
    want, want_pen = reference_penalised(
        rewards.tolist(), logp.tolist(), ref_logp.tolist(), mask.tolist(), 0.1, estimator
    )
    torch.testing.assert_close(shaped, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(penalty, torch.tensor(want_pen, dtype=F64), rtol=1e-12, atol=1e-12)
    assert penalty[1] == 0.0
    if estimator != "k1":
        assert bool((penalty >= 0).all())


def test_penalty_by_hand_and_its_effect_on_group_advantages():
    # Two tokens, log r = log pi_ref - log pi = -1 and 0: k1 = 1 + 0, k3 = (e^-1 - 1 + 1) + 0 = e^-1.
    logp = torch.tensor([[0.0, -1.0], [0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    rewards = torch.tensor([1.0, 1.0])
    shaped, pen = kl_penalised_rewards(rewards, logp, ref, mask, 0.5, "k3")
    torch.testing.assert_close(pen, torch.tensor([0.5 * math.exp(-1), 0.0]))
    # Equal raw rewards give zero advantages; the penalty alone now separates the pair.
    adv = group_advantages(shaped.view(1, 2), "dr_grpo")
    torch.testing.assert_close(adv, torch.tensor([[-0.25 * math.exp(-1), 0.25 * math.exp(-1)]]))


def test_no_gradient_flows_and_dtype_is_fp32_at_least():
    logp = torch.full((2, 3), -1.0, dtype=torch.bfloat16, requires_grad=True)
    shaped, pen = kl_penalised_rewards(
        torch.zeros(2, dtype=torch.bfloat16), logp, torch.full((2, 3), -2.0), torch.ones(2, 3), 1.0
    )
    assert shaped.dtype == torch.float32 and not shaped.requires_grad and not pen.requires_grad


def test_zero_coef_keeps_the_rewards():
    rewards = torch.tensor([0.3, -0.7])
    shaped, pen = kl_penalised_rewards(rewards, torch.zeros(2, 4), -torch.ones(2, 4), torch.ones(2, 4), 0.0)
    assert torch.equal(shaped, rewards) and torch.equal(pen, torch.zeros(2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rewards": torch.zeros(3)}, "3 rewards"),
        ({"rewards": torch.zeros(2, 1)}, r"rewards must be \[B\]"),
        ({"coef": -0.1}, "coef"),
        ({"estimator": "k4"}, "estimator"),
        ({"response_mask": torch.ones(2, 5)}, "loss_mask has shape"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    args = {
        "rewards": torch.zeros(2),
        "logp": torch.zeros(2, 4),
        "ref_logp": torch.zeros(2, 4),
        "response_mask": torch.ones(2, 4),
        "coef": 0.1,
        "estimator": "k3",
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        kl_penalised_rewards(**args)


def test_response_mask_is_the_output_tokens_even_after_overlong_filtering():
    batch = {
        "input_ids": torch.zeros(2, 6, dtype=torch.int64),
        "seq_lens": torch.tensor([5, 6]),
        "response_len": torch.tensor([2, 4]),
        "loss_mask": torch.zeros(2, 6, dtype=torch.bool),  # both rows filtered out of the loss
    }
    want = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(response_mask(batch), want)
