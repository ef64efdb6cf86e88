"""Issue 28: SGLang's CUDA engine through megagrpo's `RolloutEngine` on the tiny Qwen3-MoE (`hf_moe_sglang`).

Generation returns token logprobs and MoE routes; the memory saver really gives the device memory of the
KV cache and the weights back (`release`) and takes it again (`resume`), measured from the driver with
`torch.cuda.mem_get_info` (the engine's scheduler is another process, so torch's allocator here does not
see it). A released weights region holds no copy, so the full cycle is the trainer's: release both, then
a weight sync resumes the weights and writes them, then the KV cache is resumed.

The engine is sized to fit beside a learner in one process: a KV cache of a fixed token count (1 GiB
here, enough to measure against the driver's 2 MiB granularity), and small decode CUDA graphs, so the
memory saver is exercised with graphs captured as in a training run. One engine serves the module.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KV_TOKENS = 1 << 22  # 256 bytes per token for hf_moe_sglang (2 layers x K,V x 2 heads x 16 x bf16): 1 GiB
PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202], [44, 45, 46, 47, 48, 49, 50, 51]]
NEW_TOKENS = 8


def engine_config(model_dir, **extra):
    """The module's engine: bf16, a 0.15 share of the device (the learner fits beside it), a fixed KV cache."""
    from megagrpo.rollout import RolloutConfig

    return RolloutConfig(
        str(model_dir), dtype="bfloat16", mem_fraction_static=0.15, max_total_tokens=KV_TOKENS, seed=0,
        extra_engine_args=extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(hf_moe_sglang):
    from megagrpo.rollout import RolloutEngine

    eng = RolloutEngine(engine_config(hf_moe_sglang, cuda_graph_max_bs_decode=4)).start()
    try:
        yield eng
    finally:
        eng.shutdown()


def greedy(engine, prompts=PROMPTS, new_tokens: int = NEW_TOKENS):
    """Greedy completions from an empty prefix cache (a cached prefix takes another kernel path)."""
    from megagrpo.rollout import SamplingConfig

    engine._wait_idle()  # flushes the cache once the scheduler is idle
    groups = engine.generate(
        prompts, SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    )
    return [g[0] for g in groups]


def kv_cache_bytes(engine) -> int:
    """Bytes of the engine's K and V buffers: SGLang's token count (+1 padding slot) x layers x K,V x heads x dim."""
    import json
    from pathlib import Path

    info = engine.engine.get_server_info()
    hf = json.loads((Path(engine.cfg.model_path) / "config.json").read_text())
    dtype_bytes = torch.empty(0, dtype=getattr(torch, engine.cfg.dtype)).element_size()
    per_token = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * hf["head_dim"] * dtype_bytes
    return (int(info["max_total_num_tokens"]) + 1) * per_token


def hf_tensors(model_dir, device: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by HF name, as an export yields them."""
    from safetensors.torch import load_file

    out = []
    for f in sorted(model_dir.glob("*.safetensors")):
        out += [(n, t.to(device=device, dtype=dtype)) for n, t in load_file(f).items()]
    return out


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_generation_returns_logprobs_and_routes(engine):
    from megagrpo.rollout import NO_ROUTE, SamplingConfig

    groups = engine.generate(
        PROMPTS, SamplingConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True), group_size=2
    )
    assert engine.num_layers == 2 and engine.topk == 2 and engine.routes_num_experts == 8
    tokens = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert len(group) == 2
        for c in group:
            P = len(prompt)
            assert c.prompt_ids.tolist() == prompt
            assert c.output_ids.shape == (NEW_TOKENS,) and c.finish_reason == "length"
            assert c.logprobs.shape == (NEW_TOKENS,) and c.logprobs.dtype == torch.float32
            assert bool(torch.isfinite(c.logprobs).all()) and bool((c.logprobs <= 0).all())
            assert bool((c.output_ids >= 0).all()) and bool((c.output_ids < 1024).all())
            # [tokens, layers, topk]; every fed token has a route, the last output token none
            assert c.routes.shape == (P + NEW_TOKENS, 2, 2) and c.routes.dtype == torch.int32
            fed = c.routes[:-1]
            assert bool((fed >= 0).all()) and bool((fed < 8).all()), fed
            assert bool((c.routes[-1] == NO_ROUTE).all())
            assert bool((fed[..., 0] != fed[..., 1]).all())  # a token's top-k experts are distinct
            assert c.output_routes.shape == (NEW_TOKENS, 2, 2)
            tokens += c.num_tokens
    print(f"engine: {len(PROMPTS) * 2} completions, {tokens} tokens with routes")


def test_memory_saver_frees_and_restores_the_device_memory(engine, hf_moe_sglang):
    from megagrpo.sync import bucketize, sync_weights

    kv = kv_cache_bytes(engine)
    weights = sum(
        t.numel() * 2 for _, t in hf_tensors(hf_moe_sglang, "cpu", torch.float32)
    )  # bf16 in the engine
    baseline = greedy(engine)

    # The KV cache alone: the weights stay, so the same greedy tokens come back without a sync.
    before = _free()
    engine.release(["kv_cache"])
    released = _free()
    engine.resume()
    resumed = _free()
    after_kv = greedy(engine)
    freed_kv = released - before
    print(
        f"kv_cache: {kv / 2**30:.3f} GiB, freed {freed_kv / 2**30:.3f} GiB, retaken {(released - resumed) / 2**30:.3f} GiB"
    )
    assert freed_kv >= 0.9 * kv, (freed_kv, kv)
    assert released - resumed >= 0.9 * kv, (released - resumed, kv)

    # The trainer's cycle: both released; the sync checks, resumes the weights and writes them; KV resumed.
    before = _free()
    engine.release(["kv_cache", "weights"])
    released = _free()
    stats = sync_weights(
        engine, bucketize(hf_tensors(hf_moe_sglang, "cuda", torch.bfloat16), bucket_bytes=256 << 10),
        before_send=lambda: engine.resume(["weights"]),
    )  # fmt: skip
    assert stats.buckets > 1 and not stats.packed  # the GPU transport: flattened buckets over CUDA IPC
    engine.resume()
    resumed = _free()
    after_all = greedy(engine)
    freed = released - before
    print(
        f"kv_cache + weights: {(kv + weights) / 2**30:.3f} GiB, freed {freed / 2**30:.3f} GiB, retaken "
        f"{(released - resumed) / 2**30:.3f} GiB; sync {stats.buckets} buckets, {stats.bytes} B, {stats.seconds:.2f} s"
    )
    assert freed >= 0.9 * (kv + weights), (freed, kv, weights)
    assert released - resumed >= 0.9 * (kv + weights), (released - resumed, kv, weights)

    for name, got in (("kv_cache", after_kv), ("kv_cache + weights", after_all)):
        for b, a in zip(baseline, got, strict=True):
            assert a.output_ids.tolist() == b.output_ids.tolist(), name
            # the same kernels on the same batch and weights (H200: expected bit-identical)
            assert float((a.logprobs - b.logprobs).abs().max()) < 1e-3, name
    print("greedy tokens after release/resume:", [c.output_ids.tolist() for c in after_all])
