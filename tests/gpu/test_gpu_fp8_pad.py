"""Issue 16, item 1 on CUDA with Transformer Engine: FP8 training on micro-batches whose token counts are
not multiples of 16 (TE's FP8 GEMMs assert that they are; the learner pads to `forward.pad_multiples`).

Needs Transformer Engine; skipped with that reason where it is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.gpu._common import grpo_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="FP8 needs Transformer Engine"
    ),
]


@pytest.mark.parametrize("packed", [True, False])
def test_fp8_forward_and_step_on_odd_token_counts(one_rank, hf_moe, packed):
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.learner import forward
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.learner.model import model_config
    from megagrpo.learner.optimizer import OptimizerConfig
    from megagrpo.trainer.weights import load_hf_into_learner

    arch = arch_from_hf(hf_moe / "config.json")
    cfg = LearnerConfig(
        dtype=torch.bfloat16, layer_spec="transformer_engine", fp8="hybrid", packed=packed,
        num_micro_batches=2, seed=1,
    )  # fmt: skip
    learner = Learner(arch, cfg, optimizer=OptimizerConfig(lr=1e-4), env=one_rank)
    try:
        load_hf_into_learner(learner, hf_moe)
        config = model_config(learner.model)
        assert forward.pad_multiples(config) == (1, 16)
        assert config.moe_router_padding_for_quantization
        lens = torch.tensor([13, 7, 29, 5])  # 20 and 34 tokens per micro-batch before padding
        T = int(lens.max())
        pos = torch.arange(T).unsqueeze(0)
        g = torch.Generator().manual_seed(0)
        ids = torch.where(pos < lens[:, None], torch.randint(3, 1024, (4, T), generator=g), 0)
        mask = (pos >= 2) & (pos < lens[:, None])
        batch = {
            "input_ids": ids,
            "seq_lens": lens,
            "loss_mask": mask,
            "advantages": torch.tensor([1.0, -1, 0.5, -0.5]),
        }
        out = learner.forward(batch)
        assert torch.isfinite(out["logprobs"]).all() and (out["logprobs"][mask] < 0).all()
        batch["old_logp"] = out["logprobs"]
        metrics = learner.train_step(batch, grpo_loss(batch))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    finally:
        learner.close()
