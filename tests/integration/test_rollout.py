"""RolloutEngine against the HF reference: routes, logprobs, sleep/wake, bad input, dynamic sampling."""

from __future__ import annotations

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout import DynamicSamplingConfig, SamplingConfig, dynamic_sample

# Measured here (fp32 engine vs fp32 transformers, tiny Qwen3-MoE, tools/bench_sync.py): max |delta logprob|
# 4.8e-7. The tolerance leaves room for other CPUs; bf16 engines need ~1e-2 (0.008 seen in issue 2).
LOGPROB_TOL_FP32 = 2e-4


def _hf_forward(model, ids: list[int]):
    """HF logprobs of tokens 1..L-1 [L-1] and the router's own top-k per layer [L, layers, topk] (sorted)."""
    captured = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out[2].detach().clone()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    logprobs = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    routes = torch.stack(captured, 1)  # [L, layers, topk]
    return logprobs, routes


@pytest.fixture(scope="module")
def sampled(sglang_engine):
    prompts = [[5, 6, 7, 8, 9], [{"role": "user", "content": "what is 12 + 34?"}]]
    return sglang_engine.generate(prompts, SamplingConfig(max_new_tokens=12, ignore_eos=True), group_size=2)


def test_routes_equal_hf_router_topk(sampled, hf_reference):
    for group in sampled:
        for c in group:
            full = torch.cat([c.prompt_ids, c.output_ids]).tolist()
            _, hf_routes = _hf_forward(hf_reference, full)
            n = len(full)
            assert c.routes.shape == hf_routes.shape == (n, 2, 2)
            # rows 0..n-2: the route of token t as an input; the last output token was never an input
            eng = c.routes[:-1].sort(-1).values
            ref = hf_routes[:-1].to(torch.int32).sort(-1).values
            assert torch.equal(eng, ref), (eng != ref).nonzero()[:5]
            assert torch.equal(c.output_routes[:-1].sort(-1).values, ref[c.prompt_ids.numel() :])


def test_sampler_logprobs_match_hf(sampled, hf_reference):
    worst = 0.0
    for group in sampled:
        for c in group:
            full = torch.cat([c.prompt_ids, c.output_ids]).tolist()
            hf_lp, _ = _hf_forward(hf_reference, full)
            out_lp = hf_lp[c.prompt_ids.numel() - 1 :]  # logprob of each output token
            worst = max(worst, float((out_lp - c.logprobs).abs().max()))
    assert worst < LOGPROB_TOL_FP32, worst


def test_chat_prompt_uses_template(sampled, sglang_engine):
    ids = sampled[1][0].prompt_ids.tolist()
    text = sglang_engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_stop_string_and_finish_reasons(sglang_engine):
    # greedy continuation of a fixed prompt; then stop on a string that greedy decoding produces
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    (c,) = sglang_engine.generate([[11, 12, 13]], greedy)[0]
    assert c.finish_reason == "length" and c.output_ids.numel() == 10
    stop_at = sglang_engine.tokenizer.decode(c.output_ids[3:5].tolist())
    if not stop_at.strip():
        pytest.fail(f"greedy tokens decode to whitespace {stop_at!r}; pick another prompt")
    (s,) = sglang_engine.generate([[11, 12, 13]], SamplingConfig(**{**greedy.__dict__, "stop": (stop_at,)}))[
        0
    ]
    assert s.finish_reason == "stop"
    assert s.output_ids.numel() <= 5 and torch.equal(s.output_ids, c.output_ids[: s.output_ids.numel()])


def test_sleep_wake_gives_identical_output(sglang_engine):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = sglang_engine.generate([[21, 22, 23], [30, 31]], greedy, group_size=2)
    sglang_engine.release(["kv_cache"])
    sglang_engine.release(["weights"])
    assert sglang_engine.asleep
    with pytest.raises(MegagrpoError, match="resume"):
        sglang_engine.generate([[21, 22, 23]], greedy)
    sglang_engine.resume()
    assert not sglang_engine.asleep
    after = sglang_engine.generate([[21, 22, 23], [30, 31]], greedy, group_size=2)
    for gb, ga in zip(before, after):
        for b, a in zip(gb, ga):
            assert torch.equal(b.output_ids, a.output_ids)
            assert torch.equal(b.logprobs, a.logprobs)
            assert torch.equal(b.routes, a.routes)


def test_bad_input(sglang_engine):
    s = SamplingConfig(max_new_tokens=4)
    with pytest.raises(MegagrpoError, match="empty prompt list"):
        sglang_engine.generate([], s)
    with pytest.raises(MegagrpoError, match=r"prompts\[1\] is empty"):
        sglang_engine.generate([[1, 2], []], s)
    too_long = [7] * sglang_engine.context_len
    with pytest.raises(MegagrpoError, match=r"prompts\[0\] has \d+ tokens.*exceeds the engine context"):
        sglang_engine.generate([too_long], s)
    with pytest.raises(MegagrpoError, match="outside"):
        sglang_engine.generate([[1, 10**6]], s)
    with pytest.raises(MegagrpoError, match="memory tags"):
        sglang_engine.release(["optimizer"])
    with pytest.raises(MegagrpoError, match="GRPO needs at least 2"):
        dynamic_sample(
            sglang_engine.generate, iter([[1, 2]]), s, DynamicSamplingConfig(1, 1), lambda p, g: None
        )


def test_dynamic_sampling_drops_zero_variance_groups(sglang_engine):
    prompts = iter([[40 + i, 41 + i, 42 + i] for i in range(64)])

    def reward_fn(prompts, groups):  # 1 when the first sampled token is even: groups of 2 are often uniform
        return torch.tensor([float(c.output_ids[0] % 2 == 0) for g in groups for c in g])

    cfg = DynamicSamplingConfig(batch_prompts=3, group_size=2, oversample=2.0, max_rounds=4)
    batch = dynamic_sample(sglang_engine.generate, prompts, SamplingConfig(max_new_tokens=2), cfg, reward_fn)
    assert 1 <= batch.rounds <= 4
    assert len(batch.groups) == batch.rewards.shape[0] <= 3
    assert bool((batch.rewards.amax(1) > batch.rewards.amin(1)).all())
    assert batch.generated_groups >= len(batch.groups) + batch.dropped_groups - 0
    m = batch.metrics()
    assert m["rollout/dynamic_rounds"] == batch.rounds
    assert 0.0 <= m["rollout/dynamic_dropped_frac"] <= 1.0
    assert batch.full == (len(batch.groups) == 3)
