"""The CPU engine's MLA attention (compat/sglang_cpu.py, `_latent_as_value`): attending with the whole latent
as the value and keeping the first kv_lora_rank output columns equals SGLang's own torch-native attention
over the latent prefix, for extend (with a cached prefix) and decode; any other value cache is upstream's."""

from __future__ import annotations

import pytest
import torch

from megagrpo.compat import patching
from megagrpo.compat.sglang_cpu import _latent_as_value

# DeepSeek-V3's absorbed MLA in miniature: 4 query heads over 1 latent "head" of kv_lora_rank 16 + rope 8.
HEADS, RANK, ROPE, POOL = 4, 16, 8, 40


def _case(decode: bool):
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(POOL, 1, RANK + ROPE, generator=g)
    seq_lens = torch.tensor([7, 12])
    new = torch.tensor([1, 1]) if decode else torch.tensor([3, 12])  # the first request has a cached prefix
    req_to_token = torch.randperm(POOL, generator=g)[:24].view(2, 12)
    query = torch.randn(int(new.sum()), HEADS, RANK + ROPE, generator=g)
    common = dict(req_to_token=req_to_token, req_pool_indices=torch.tensor([0, 1]), seq_lens=seq_lens)
    if decode:
        return query, k_cache, dict(common, scaling=0.3, enable_gqa=True, causal=False)
    lens = dict(extend_prefix_lens=seq_lens - new, extend_seq_lens=new)
    return query, k_cache, dict(common, **lens, scaling=0.3, enable_gqa=True, causal=True)


@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_latent_as_value_equals_upstream_mla_attention(decode):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    method = "_run_sdpa_forward_decode" if decode else "_run_sdpa_forward_extend"
    upstream = TorchNativeAttnBackend.__dict__[method]
    upstream = getattr(upstream, "__wrapped__", upstream)  # SGLang's own, also where apply() already ran
    backend = object.__new__(TorchNativeAttnBackend)  # the methods read nothing of the instance here
    query, k_cache, kw = _case(decode)
    v_cache = k_cache[..., :RANK]  # what MLATokenToKVPool.get_value_buffer returns

    expected = upstream(backend, query, query.new_empty(len(query), HEADS, RANK), k_cache, v_cache, **kw)
    before = patching.HITS["test.mla"]
    got = _latent_as_value(upstream, "test.mla")(
        backend, query, query.new_empty(len(query), HEADS, RANK), k_cache, v_cache, **kw
    )
    assert patching.HITS["test.mla"] == before + 1  # the latent-as-value path ran
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the data tell the columns apart: the key's last RANK columns as the value give another output
    shifted = upstream(backend, query, torch.empty_like(got), k_cache, k_cache[..., ROPE:].clone(), **kw)
    assert (shifted - expected).abs().max() > 1e-2

    # a value cache that is not the key cache's prefix (same values, own memory) is left to upstream
    got = _latent_as_value(upstream, "test.mla")(
        backend, query, torch.empty_like(got), k_cache, v_cache.clone(), **kw
    )
    assert patching.HITS["test.mla"] == before + 1
    assert torch.equal(got, expected)
