"""gpt-oss's attention in the learner's core attention (issue 44): learned sinks and sliding windows per
layer, as transformers' eager `eager_attention_forward` computes them, padded and packed (THD)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from megagrpo.learner.attention import TorchCoreAttention
from megagrpo.learner.mesh import MeshConfig
from megagrpo.learner.model import transformer_config_from_arch
from tests.dist._common import TINY_GPT_OSS

HEADS, GROUPS, HD = 4, 2, 16


def _core(layer_number: int, *, sinks: bool = True, window: int = 4) -> TorchCoreAttention:
    arch = dataclasses.replace(
        TINY_GPT_OSS,
        attention_sinks=sinks,
        layer_types=("sliding_attention", "full_attention") * 2 if window else (),
        sliding_window=window,
    )
    config = transformer_config_from_arch(arch, MeshConfig())
    core = TorchCoreAttention(config, layer_number, AttnMaskType.causal, "self")
    if sinks:
        with torch.no_grad():
            core.softmax_offset.copy_(torch.tensor([1.5, -0.5, 0.0, 2.0]))
    return core.eval()


def _reference(q, k, v, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """transformers' gpt-oss eager attention on [b, s, h, d] inputs, with its own sliding-window mask."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s = q.shape[1]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)  # transformers' sliding_window_overlay: kv > q - window
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups = HEADS // GROUPS
    module.sinks = sinks if sinks is not None else torch.full((HEADS,), -torch.inf)
    module.training = False
    out, _ = eager_attention_forward(module, *(x.transpose(1, 2) for x in (q, k, v)), mask, scaling=HD**-0.5)
    return out  # [b, s, h, d]


def _inputs(b: int, s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(b, s, n, HD, generator=g) for n in (HEADS, GROUPS, GROUPS))


@pytest.mark.parametrize("layer_number,window", [(1, 4), (2, None), (3, 4)])
@pytest.mark.parametrize("sinks", [True, False])
def test_padded_rows_equal_transformers(layer_number, window, sinks):
    core = _core(layer_number, sinks=sinks)
    assert core.window == (None if window is None else window - 1)  # layers 1, 3 (1-based) slide
    q, k, v = _inputs(2, 12)
    got = core(*(x.transpose(0, 1) for x in (q, k, v)), None)  # [s, b, h*d]
    want = _reference(q, k, v, core.softmax_offset if sinks else None, window)
    torch.testing.assert_close(got.transpose(0, 1).reshape(want.shape), want, rtol=1e-6, atol=1e-6)


def test_packed_sequences_attend_within_themselves_with_their_own_window():
    core = _core(1)
    lens = [5, 9, 3]
    q, k, v = _inputs(1, sum(lens), seed=1)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
    )
    got = core(q[0], k[0], v[0], None, packed_seq_params=psp).reshape(sum(lens), HEADS, HD)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = _reference(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], core.softmax_offset, 4)[0]
        torch.testing.assert_close(got[lo:hi], want, rtol=1e-6, atol=1e-6)


def test_a_missing_sink_or_window_changes_the_output():
    q, k, v = _inputs(1, 12, seed=2)
    core = _core(1)
    want = _reference(q, k, v, core.softmax_offset, 4)
    for wrong in (_reference(q, k, v, None, 4), _reference(q, k, v, core.softmax_offset, None)):
        assert (wrong - want).abs().max() > 1e-2


def test_the_learner_config_reads_the_description():
    c = transformer_config_from_arch(TINY_GPT_OSS, MeshConfig())
    assert c.softmax_type == "learnable" and c.window_size == (3, 0)
    assert c.window_attn_skip_freq == [1, 0, 1, 0] and c.add_bias_linear
    assert c.activation_func.__name__ == "quick_gelu" and c.gated_linear_unit
    assert (c.activation_func_clamp_value, c.glu_linear_offset) == (7.0, 1.0)
    assert not c.moe_router_pre_softmax  # top-k logits, then a softmax over them
    assert (c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings) == (4.0, 64)
    assert c.yarn_correction_range_round_to_int is False


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5: megatron's clamped SwiGLU uses quick_gelu"),
        (dict(moe_expert_bias=False), "biases every linear layer or none"),
        (dict(moe_layer_pattern=(0, 1, 1, 1)), "dense MLP layers would get biases"),
        (dict(rope_mscale_all_dim=1.0), "default attention factor"),
        (dict(rotary_percent=0.5), "whole heads rotated"),
    ],
)
def test_what_megatron_cannot_compute_is_refused(change, words):
    from megagrpo.errors import MegagrpoError

    with pytest.raises(MegagrpoError, match=words):
        transformer_config_from_arch(dataclasses.replace(TINY_GPT_OSS, **change), MeshConfig())


def test_the_transformer_engine_spec_is_not_taken_for_gpt_oss(monkeypatch):
    """On a GPU with TE, `auto` takes TE for a bf16 learner, but keeps gpt-oss local (its TE names and
    expert biases are not mapped), and an explicit TE spec is refused by name."""
    import importlib.util

    from megagrpo.errors import MegagrpoError
    from megagrpo.learner import model as learner_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    plain = dataclasses.replace(TINY_GPT_OSS, attention_sinks=False, moe_expert_bias=False)
    assert learner_model.use_transformer_engine("auto", arch=plain, dtype=torch.bfloat16)
    assert not learner_model.use_transformer_engine("auto", arch=TINY_GPT_OSS, dtype=torch.bfloat16)
    with pytest.raises(MegagrpoError, match="attention sinks and expert biases on the Transformer Engine"):
        learner_model.use_transformer_engine("transformer_engine", arch=TINY_GPT_OSS)
