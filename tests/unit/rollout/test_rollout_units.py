"""Pure pieces of rollout/sync: route decoding, result assembly, buckets, SGLang layout, validation,
the dynamic-sampling loop (with a fake generator), and the pure-torch sgl_kernel stand-in."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout import DynamicSamplingConfig, SamplingConfig, decode_routes, dynamic_sample
from megagrpo.rollout.completion import Completion, completion_from_output
from megagrpo.sync import bucketize, layer_of, validate_buckets
from megagrpo.sync.sglang_layout import sglang_params


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(a.astype(np.int32).tobytes()).decode()


def test_decode_routes_fills_last_row():
    raw = np.arange(4 * 3 * 2).reshape(4, 3, 2)
    r = decode_routes(_b64(raw), num_tokens=5, num_layers=3, topk=2)
    assert r.shape == (5, 3, 2) and r.dtype == torch.int32
    assert torch.equal(r[:4], torch.from_numpy(raw).int()) and bool((r[4] == -1).all())
    with pytest.raises(MegagrpoError, match="expected"):
        decode_routes(_b64(raw), num_tokens=6, num_layers=3, topk=2)


def test_completion_from_output_aligns_output_routes():
    p, o = [1, 2, 3], [7, 8]
    routes = np.arange((len(p) + len(o) - 1) * 2).reshape(-1, 1, 2)
    out = {
        "output_ids": o,
        "text": "x",
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 8},
            "output_token_logprobs": [(-0.5, 7, None), (-1.5, 8, None)],
            "routed_experts": _b64(routes),
        },
    }
    c = completion_from_output(out, prompt_index=0, sample_index=1, prompt_ids=p, num_layers=1, topk=2)
    assert c.finish_reason == "stop" and c.logprobs.tolist() == [-0.5, -1.5]
    assert c.output_routes.shape == (2, 1, 2)
    assert c.output_routes[0].tolist() == routes[3].tolist()  # output token 0 as an input (row P)
    assert c.output_routes[1].tolist() == [[-1, -1]]  # the last token was never an input
    out["meta_info"]["finish_reason"] = {"type": "abort"}
    with pytest.raises(RuntimeError, match="abort"):
        completion_from_output(out, prompt_index=0, sample_index=0, prompt_ids=p, num_layers=1, topk=2)


def _named(layers=3, experts=4):
    out = [("model.embed_tokens.weight", torch.zeros(16, 8))]
    for i in range(layers):
        out.append((f"model.layers.{i}.self_attn.q_proj.weight", torch.zeros(8, 8)))
        out += [
            (f"model.layers.{i}.mlp.experts.{e}.up_proj.weight", torch.zeros(4, 8)) for e in range(experts)
        ]
    out.append(("lm_head.weight", torch.zeros(16, 8)))
    return out


def test_bucketize_keeps_layers_together_and_order():
    named = _named()
    layer_bytes = (64 + 4 * 32) * 4
    buckets = list(bucketize(named, bucket_bytes=layer_bytes + 16 * 8 * 4))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for b in buckets:
        assert sum(t.numel() * 4 for _, t in b) <= layer_bytes + 16 * 8 * 4
        layers = {layer_of(n) for n, _ in b} - {None}
        for lid in layers:  # every layer in the bucket is there whole
            assert sum(layer_of(n) == lid for n, _ in b) == 5
    small = list(bucketize(named, bucket_bytes=100))  # smaller than any layer: split, never empty
    assert all(small) and [n for b in small for n, _ in b] == [n for n, _ in named]
    with pytest.raises(ValueError):
        list(bucketize(named, 0))


def test_sglang_layout_fuses_like_sglang():
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.full((4, 2), 1.0),
        "model.layers.0.self_attn.k_proj.weight": torch.full((2, 2), 2.0),
        "model.layers.0.self_attn.v_proj.weight": torch.full((2, 2), 3.0),
        "model.layers.0.mlp.gate.weight": torch.zeros(2, 2),
        "model.norm.weight": torch.ones(2),
    }
    for e in range(2):
        hf[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = torch.full((3, 2), 10.0 + e)
        hf[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = torch.full((3, 2), 20.0 + e)
        hf[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.full((2, 3), 30.0 + e)
    sg = sglang_params(hf)
    assert sg["model.layers.0.self_attn.qkv_proj.weight"][:, 0].tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    w13 = sg["model.layers.0.mlp.experts.w13_weight"]
    assert w13.shape == (2, 6, 2) and w13[1, :, 0].tolist() == [11, 11, 11, 21, 21, 21]
    assert sg["model.layers.0.mlp.experts.w2_weight"].shape == (2, 2, 3)
    assert "model.layers.0.mlp.gate.weight" in sg and "model.norm.weight" in sg


def test_validate_buckets_names_the_bad_tensor():
    expected = {"a": (2, 2), "b": (3,)}
    validate_buckets([[("a", torch.zeros(2, 2))], [("b", torch.zeros(3))]], expected)
    with pytest.raises(MegagrpoError, match=r"missing.*'b'"):
        validate_buckets([[("a", torch.zeros(2, 2))]], expected)
    validate_buckets([[("a", torch.zeros(2, 2))]], expected, partial=True)
    with pytest.raises(MegagrpoError, match=r"'b' has shape \(4,\)"):
        validate_buckets([[("a", torch.zeros(2, 2)), ("b", torch.zeros(4))]], expected)
    with pytest.raises(MegagrpoError, match="'c' is not in"):
        validate_buckets([[("c", torch.zeros(1))]], expected)
    with pytest.raises(MegagrpoError, match="'a' is sent twice"):
        validate_buckets([[("a", torch.zeros(2, 2))], [("a", torch.zeros(2, 2))]], expected)
    with pytest.raises(MegagrpoError, match="'b' holds NaN"):
        validate_buckets([[("a", torch.zeros(2, 2)), ("b", torch.full((3,), float("nan")))]], expected)


def _fake_generate(prompts, sampling, group_size, *, index_offset=0):
    # prompt value v: every completion's first token is v, except prompts divisible by 3 (mixed groups)
    out = []
    for i, p in enumerate(prompts):
        v = p[0]
        grp = []
        for g in range(group_size):
            tok = v + g if v % 3 == 0 else v
            grp.append(
                Completion(i, g, torch.tensor(p), torch.tensor([tok]), torch.zeros(1), "length", "", None)
            )
        out.append(grp)
    return out


def test_dynamic_sample_refills_and_caps_rounds():
    reward = lambda ps, gs: torch.tensor([float(c.output_ids[0] % 2) for g in gs for c in g])  # noqa: E731
    s = SamplingConfig(max_new_tokens=1)
    batch = dynamic_sample(
        _fake_generate,
        iter([[v] for v in range(1, 100)]),
        s,
        DynamicSamplingConfig(4, 2, oversample=1.5, max_rounds=4),
        reward,
    )
    assert batch.full and len(batch.groups) == 4 and batch.rewards.shape == (4, 2)
    assert [p[0] for p in batch.prompts] == [3, 6, 9, 12]
    assert batch.rounds > 1 and batch.generated_groups >= 4 + batch.dropped_groups
    assert batch.metrics()["rollout/dynamic_dropped_frac"] == batch.dropped_groups / batch.generated_groups
    capped = dynamic_sample(
        _fake_generate,
        iter([[v] for v in range(1, 100)]),
        s,
        DynamicSamplingConfig(4, 2, oversample=1.5, max_rounds=1),
        reward,
    )
    assert capped.rounds == 1 and not capped.full and len(capped.groups) == 2  # prompts 3, 6 of 1..6
    with pytest.raises(MegagrpoError, match="one reward per completion"):
        dynamic_sample(
            _fake_generate, iter([[1]]), s, DynamicSamplingConfig(1, 2), lambda ps, gs: torch.zeros(5)
        )
    with pytest.raises(MegagrpoError, match="GRPO needs at least 2"):
        dynamic_sample(_fake_generate, iter([[1]]), s, DynamicSamplingConfig(1, 1), reward)


def test_assign_req_to_token_pool_stand_in_matches_reference():
    from megagrpo.compat.sglang_cpu import assign_req_to_token_pool_cpu

    g = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(6, 16, dtype=torch.int32)
    ref = req_to_token.clone()
    idx = torch.tensor([4, 1, 3])
    start = torch.tensor([2, 0, 5])
    end = torch.tensor([5, 4, 5])
    loc = torch.randint(0, 1000, (10,), generator=g)
    assign_req_to_token_pool_cpu(idx, req_to_token, start, end, loc, 16)
    off = 0
    for i in range(3):
        n = int(end[i] - start[i])
        ref[idx[i], start[i] : end[i]] = loc[off : off + n].int()
        off += n
    assert torch.equal(req_to_token, ref)
