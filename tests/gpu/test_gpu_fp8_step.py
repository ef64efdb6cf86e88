"""Issue 28: an FP8 GRPO step (Transformer Engine; `model.fp8: hybrid` with each `model.fp8_recipe`,
delayed and blockwise) on the small MoE, against the same step in bf16 on the same TE layers.

test_gpu_fp8_pad.py covers the token padding FP8's GEMMs need (finite results on odd token counts). This
file adds what the issue asks beyond it: the FP8 step's logprobs stay close to bf16's, before and after
the update, its loss and gradient norm are the bf16 step's up to FP8 rounding, and the update follows the
policy gradient (the advantage-weighted change of the logprobs is positive), as bf16's does. Every micro-batch here has a token
count that is not a multiple of 16, so the padding is in use throughout.

The model is the tiny Qwen3-MoE at hidden 128 (head_dim 32, experts of 128 x 128): blockwise scaling
quantizes in 1 x 128 and 128 x 128 blocks, so no dimension is smaller than a block. Delayed scaling
takes its scales from the previous passes' amax history (scale 1 on the very first pass, which would flush
the small gradients to zero in E5M2), so each FP8 learner runs one forward and backward (no update) before
anything is measured.

Tolerances: e4m3 keeps 3 mantissa bits (a relative rounding of up to 6% on each GEMM input), on logits of
a few tenths around log(1/1024) here. Measured on an H200 (2026-11-28, docs/gpu.md): |dlogp| vs bf16 after
the step mean 0.023 (bound 0.03) and max 0.126 (bound 0.3), loss within 0.002 (0.05), grad norm within 1.1%
(25%).
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

LENS = [13, 7, 29, 5, 22, 11]  # three token-balanced micro-batches of 29 tokens: not a multiple of 16
ADV = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5]
LOGP_MEAN_TOL, LOGP_MAX_TOL = 0.03, 0.3
LOSS_TOL = 0.05  # absolute, on a token-mean GRPO loss of order |advantage| = 1
GRAD_NORM_RTOL = 0.25


@pytest.fixture(scope="module")
def hf_moe128(tiny_model):
    return tiny_model("qwen3_moe", hidden=128, layers=2, experts=8, topk=2, vocab_size=1024, seed=4)


def make_batch(vocab: int = 1024) -> dict[str, torch.Tensor]:
    lens = torch.tensor(LENS)
    T = int(lens.max())
    pos = torch.arange(T).unsqueeze(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.where(pos < lens[:, None], torch.randint(3, vocab, (len(LENS), T), generator=g), 0)
    mask = (pos >= 2) & (pos < lens[:, None])
    return {"input_ids": ids, "seq_lens": lens, "loss_mask": mask, "advantages": torch.tensor(ADV)}


def grpo_step(hf_dir, env, batch, *, fp8, recipe="delayed", layer_spec="transformer_engine"):
    """One learner: (logprobs before, step metrics, logprobs after, the padding it used). `batch` holds
    `old_logp` (the bf16 learner's, as a sampler's would be), so the step's ratios are FP8's drift."""
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.learner import forward
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.learner.model import model_config
    from megagrpo.learner.optimizer import OptimizerConfig
    from megagrpo.learner.train_step import forward_backward
    from megagrpo.trainer.weights import load_hf_into_learner

    cfg = LearnerConfig(
        dtype=torch.bfloat16, layer_spec=layer_spec, fp8=fp8, fp8_recipe=recipe, num_micro_batches=3, seed=1,
    )  # fmt: skip
    opt = OptimizerConfig(lr=2e-3, clip_grad=1.0, weight_decay=0.0)
    learner = Learner(arch_from_hf(hf_dir / "config.json"), cfg, optimizer=opt, env=env)
    try:
        load_hf_into_learner(learner, hf_dir)
        config = model_config(learner.model)
        padding = (forward.pad_multiples(config), bool(config.moe_router_padding_for_quantization))
        if fp8:  # delayed scaling: an amax history of every forward and backward GEMM input first
            warm = dict(batch)
            warm.setdefault("old_logp", learner.forward(batch)["logprobs"].cpu())  # ratios of 1, as measured
            forward_backward(learner.model, warm, grpo_loss(warm), learner.run_options())
        before = learner.forward(batch)["logprobs"].cpu()
        step_batch = {**batch, "old_logp": batch.get("old_logp", before)}
        metrics = learner.train_step(step_batch, grpo_loss(step_batch))  # zeroes the warm-up's grads first
        after = learner.forward(batch)["logprobs"].cpu()
    finally:
        learner.close()
    return before, metrics, after, padding


def _diff(a, b, mask) -> tuple[float, float]:
    d = (a - b)[mask].abs()
    return float(d.mean()), float(d.max())


def objective_gain(before, after, batch) -> float:
    """Σ_i A_i · (mean Δlogp of sample i): positive when the step followed the policy gradient (one Adam
    step guarantees it to first order, not the sign of every sample's own change)."""
    mask = batch["loss_mask"].float()
    delta = ((after - before) * mask).sum(1) / mask.sum(1)
    return float((delta * batch["advantages"]).sum())


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_fp8_grpo_step_tracks_the_bf16_step(one_rank, hf_moe128, recipe):
    batch = make_batch()
    mask = batch["loss_mask"]
    ref_before, ref_metrics, ref_after, ref_pad = grpo_step(hf_moe128, one_rank, batch, fp8=None)
    batch["old_logp"] = ref_before
    before, metrics, after, pad = grpo_step(hf_moe128, one_rank, batch, fp8="hybrid", recipe=recipe)

    assert ref_pad == ((1, 1), False)
    assert pad == ((1, 16), True), pad  # FP8: token counts padded to 16, routing map padded per expert
    for m in (ref_metrics, metrics):
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    assert torch.isfinite(before).all() and torch.isfinite(after).all()
    d_before, d_after = _diff(before, ref_before, mask), _diff(after, ref_after, mask)
    moved = _diff(ref_after, ref_before, mask)
    print(
        f"fp8 {recipe}: |dlogp| vs bf16 (mean, max) before {d_before}, after the step {d_after}; the bf16 "
        f"step moved {moved}; loss {metrics['loss/total']:.5g} vs {ref_metrics['loss/total']:.5g}, grad norm "
        f"{metrics['loss/grad_norm']:.4g} vs {ref_metrics['loss/grad_norm']:.4g}"
    )
    assert d_before[0] < LOGP_MEAN_TOL and d_before[1] < LOGP_MAX_TOL, d_before
    assert d_after[0] < LOGP_MEAN_TOL and d_after[1] < LOGP_MAX_TOL, d_after
    assert abs(metrics["loss/total"] - ref_metrics["loss/total"]) < LOSS_TOL
    g, g_ref = metrics["loss/grad_norm"], ref_metrics["loss/grad_norm"]
    assert g > 0 and abs(g - g_ref) <= GRAD_NORM_RTOL * g_ref, (g, g_ref)
    gains = objective_gain(ref_before, ref_after, batch), objective_gain(before, after, batch)
    print(f"advantage-weighted dlogp of the step: bf16 {gains[0]:.4g}, fp8 {gains[1]:.4g}")
    assert gains[0] > 0 and gains[1] > 0, gains
