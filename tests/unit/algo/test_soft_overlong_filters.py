"""The soft overlong penalty as the trainer applies it: integer lengths from the completions, the
config's section, and the filter's own validation kept (issue: grpo_math_dense.yaml crashed at step 1)."""

from __future__ import annotations

import pytest
import torch

from megagrpo.algo.filters import soft_overlong_penalty
from megagrpo.config import load_config
from megagrpo.trainer.grpo import length_shaped_rewards
from tools import gen_config_docs as gen


def response_lengths(lengths):
    """int64 [B], as the data plane publishes them (`trainer.rows.StepRows.response_len`)."""
    return torch.tensor(lengths, dtype=torch.int64)


def test_the_shipped_dense_config_shapes_rewards_by_length():
    cfg = load_config(gen.REPO / "configs" / "grpo_math_dense.yaml", check_paths=False)
    so = cfg.algo.soft_overlong
    assert so.enabled and (so.max_len, so.cache_len) == (4096, 512)
    lengths = response_lengths([10, 3584, 3840, 4096])
    assert lengths.dtype == torch.int64
    rewards = torch.ones(2, 2)
    shaped = length_shaped_rewards(rewards, lengths, so)
    # 0 up to max_len - cache_len = 3584, then linear to -factor at max_len (DAPO Eq. 13)
    torch.testing.assert_close(shaped, torch.tensor([[1.0, 1.0], [0.5, 0.0]]))


def test_disabled_leaves_rewards_alone_and_the_filter_still_rejects_fractional_lengths():
    cfg = load_config(
        gen.REPO / "configs" / "grpo_math_dense.yaml",
        ["algo.soft_overlong.enabled=false"],
        check_paths=False,
    )
    rewards = torch.tensor([[1.0, 0.0]])
    lengths = response_lengths([4096, 9000])
    assert length_shaped_rewards(rewards, lengths, cfg.algo.soft_overlong) is rewards
    with pytest.raises(ValueError, match="integer tensor"):
        soft_overlong_penalty(lengths.float(), 4096, 512)
