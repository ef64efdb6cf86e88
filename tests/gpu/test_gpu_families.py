"""Issue 37 on one GPU: the DeepSeek-V3 and GLM-4.5 families through SGLang's CUDA engine and megatron's
learner (Transformer Engine layers where the learner bundle is installed), the path `megagrpo train` runs.

Per family, one engine: the learner's weights are perturbed, the routers' correction biases too (a buffer,
not a parameter: it enters expert selection only), and sent the trainer's way over CUDA IPC
(`test_gpu_sync_r3.sync_like_the_trainer`). Then
* the engine's greedy tokens change, and each is the learner's own greedy choice after the same prefix
  (one teacher-forced forward over the engine's sequence), or within a near-tie of it (test_gpu_sync_r3's
  NEAR_TIE: two bf16 implementations may order near-equal logits differently); a free-running comparison
  stops at the first near-tie, and these wider random models meet one early (10 of 24 tokens compared on
  GLM-4.5 on an H200, every difference a near-tie);
* R3 replays the engine's routes exactly (nothing unconsumed, no fallback), and the learner's own routing
  agrees with the engine's on >= 95% of tokens: a bias that did not arrive, or arrived rounded, would move
  the selection of the biased experts (the perturbation is large next to the router's score gaps);
* the replayed logprobs are within the bf16 tolerances of test_gpu_sync_r3.

The models have SGLang's CUDA shapes: head_dim 128 (GLM-4.5's partial rotary leaves a rotary dim of 64),
DeepSeek-V3's own MLA dims (kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128), a q latent, a dense first
layer, a shared expert, group-limited top-k with a non-zero bias; GLM-4.5's experts are 176 wide (GLM-4.5's
1408 over TP8), no multiple of the kernels' block sizes.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_engine import PROMPTS
from tests.gpu.test_gpu_sync_r3 import (
    NEAR_TIE,
    NEW_TOKENS,
    R3_MAX_TOL,
    R3_MEAN_TOL,
    build_learner,
    perturb,
    r3_measurements,
    sampled_batch,
    sync_like_the_trainer,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = {
    "glm4_moe": dict(hidden=512, layers=3, experts=8, topk=2, moe_intermediate=176),
    "deepseek_v3": dict(hidden=512, layers=3, experts=8, topk=2, mla_dims=(512, 128, 64, 128)),
}
BIAS_NOISE = 0.5  # the tiny models' biases are 0.05-scale (tiny_model._randomise_v3_extras)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tiny_model):
    from megagrpo.rollout import RolloutConfig, RolloutEngine

    name = request.param
    model_dir = tiny_model(name, vocab_size=1024, seed=5, **FAMILIES[name])
    cfg = RolloutConfig(
        str(model_dir), dtype="bfloat16", mem_fraction_static=0.15, max_total_tokens=1 << 16, seed=0,
        extra_engine_args={"disable_cuda_graph": True},
    )  # fmt: skip
    eng = RolloutEngine(cfg).start()
    try:
        yield name, model_dir, eng
    finally:
        eng.shutdown()


@torch.no_grad()
def perturb_biases(learner, seed: int = 1) -> int:
    """Noise on every router's correction bias (megatron's `expert_bias` buffer); returns how many."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = 0
    for name, buf in learner.chunks[0].named_buffers():
        if name.endswith("expert_bias"):
            buf.add_((BIAS_NOISE * torch.randn(buf.shape, generator=g)).to(buf.device, buf.dtype))
            n += 1
    return n


@torch.no_grad()
def greedy_gaps(learner, prompt: list[int], engine_ids: list[int]) -> torch.Tensor:
    """Per engine token: the learner's top logprob minus that token's, after the same prefix (0 where the
    engine chose the learner's argmax)."""
    model = learner.model[0]
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(engine_ids)], device=device)
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    logits = model(ids, pos, None)[0, len(prompt) - 1 : -1, : learner.arch.vocab_size].float()
    lp = torch.log_softmax(logits, -1)
    chosen = lp.gather(1, torch.tensor(engine_ids, device=device).unsqueeze(1)).squeeze(1)
    return (lp.max(-1).values - chosen).cpu()


def test_family_sync_greedy_and_r3_on_the_gpu(family, one_rank):
    from megagrpo.rollout import SamplingConfig

    name, model_dir, engine = family
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    before = [g[0].output_ids.tolist() for g in engine.generate(PROMPTS, greedy)]
    learner = build_learner(model_dir, one_rank)
    try:
        perturb(learner)
        biases = perturb_biases(learner)
        stats = sync_like_the_trainer(learner, engine)
        after = [g[0].output_ids.tolist() for g in engine.generate(PROMPTS, greedy)]
        batch = sampled_batch(engine)
        learner.reload()
        gaps = torch.cat([greedy_gaps(learner, p, ids) for p, ids in zip(PROMPTS, after, strict=True)])
        m = r3_measurements(learner, batch)
    finally:
        learner.close()
    print(
        f"{name}: sync {stats.buckets} bucket(s), {stats.bytes} B in {stats.seconds:.3f} s, {biases} biases "
        f"moved; engine greedy = learner argmax on {int((gaps == 0).sum())}/{len(gaps)} tokens, largest gap "
        f"{float(gaps.max()):.4f} nats; R3: {m}"
    )
    assert biases == FAMILIES[name]["layers"] - 1, biases  # every MoE layer (the first is dense)
    assert after != before, "the sync changed no greedy token; the new weights did not arrive"
    assert len(gaps) == NEW_TOKENS * len(PROMPTS)
    assert float(gaps.max()) < NEAR_TIE, gaps  # every greedy token the learner's choice, up to a near-tie
    assert int((gaps == 0).sum()) >= len(gaps) * 3 // 4, gaps
    assert m["unconsumed"] == 0 and m["fallback"] == 0, m
    assert m["agreement"] >= 0.95, m
    assert m["r3_mean"] < R3_MEAN_TOL and m["r3_max"] < R3_MAX_TOL, m
    assert m["r3_mean"] <= m["free_mean"] + 1e-3, m
