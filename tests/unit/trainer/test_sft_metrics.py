"""An SFT step logs the optimizer's grad norm and learning rate (the old key filter matched no key)."""

from __future__ import annotations

import torch

from megagrpo.learner.train_step import optimizer_step
from megagrpo.trainer.sft import SFT_LEARNER_METRICS, sft_metrics


class _Optimizer:
    """The two calls `optimizer_step` makes of megatron's optimizer, with known answers."""

    param_groups = [{"lr": 3e-4}]

    def step(self):
        return True, torch.tensor(1.5), 0

    def zero_grad(self):
        pass


def test_sft_metrics_keep_grad_norm_and_lr_under_the_learners_names():
    learner = {"loss/policy": 2.0, "loss/entropy": 0.7, "loss/clip_frac_high": 0.0}
    learner.update(optimizer_step(_Optimizer(), None))
    out = sft_metrics(learner, tokens=12.0)
    assert out["sft/nll"] == 2.0 and out["sft/tokens"] == 12.0
    assert out["loss/grad_norm"] == 1.5 and out["loss/lr"] == 3e-4 and out["loss/update_skipped"] == 0.0
    assert out["loss/entropy"] == 0.7
    assert "loss/clip_frac_high" not in out  # RL-only statistics of the REINFORCE form of the NLL
    assert set(SFT_LEARNER_METRICS) <= set(out)
