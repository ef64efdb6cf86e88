"""Shared by the GPU tier: the GRPO loss every train-step test runs."""

from __future__ import annotations

import torch


def grpo_loss(batch: dict[str, torch.Tensor]):
    """A per-micro-batch GRPO loss (clip 0.2/0.28, token-mean over the whole `batch`'s loss mask)."""
    from megagrpo.algo.aggregation import loss_normaliser
    from megagrpo.algo.losses import policy_loss

    norm = loss_normaliser(batch["loss_mask"], "token-mean")

    def loss_fn(logp, entropy, mb):
        return policy_loss(
            logp, mb["old_logp"], mb["advantages"], mb["loss_mask"], variant="grpo", clip_low=0.2,
            clip_high=0.28, agg="token-mean", normaliser=norm,
        )  # fmt: skip

    return loss_fn
