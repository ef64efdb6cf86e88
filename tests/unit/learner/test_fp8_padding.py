"""Issue 16, items 1-2. FP8 padding: the token counts Transformer Engine's FP8 GEMMs accept, and results
that do not depend on the padding. Context parallelism: rejected, naming mesh.cp, until the learner splits
sequences over CP ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megagrpo.learner import forward, layout


def _config(tp=1, sp=False, cp=1, fp8=None, recipe="delayed"):
    return SimpleNamespace(
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        context_parallel_size=cp,
        fp8=fp8,
        fp8_recipe=recipe,
    )


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (_config(), (1, 1)),
        (_config(tp=4, sp=True), (4, 4)),
        (_config(fp8="hybrid"), (1, 16)),
        # each TP rank holds N / 4 tokens under sequence parallelism, which must be a multiple of 16
        (_config(tp=4, sp=True, fp8="e4m3"), (4, 64)),
        (_config(tp=4, sp=False, fp8="e4m3"), (1, 16)),
        (_config(tp=2, sp=True, cp=2, fp8="hybrid", recipe="blockwise"), (8, 64)),
        (_config(fp8="e4m3", recipe="mxfp8"), (1, 32)),
    ],
)
def test_pad_multiples(cfg, expected):
    assert forward.pad_multiples(cfg) == expected


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    row=st.sampled_from([1, 2, 4]),
    align=st.sampled_from([1, 16, 32]),
)
def test_pack_total_multiple_pads_only_the_last_row(lens, row, align):
    total = row * align
    T = max(lens)
    g = torch.Generator().manual_seed(len(lens))
    ids = torch.randint(1, 50, (len(lens), T), generator=g)
    lens_t = torch.tensor(lens)
    ids = torch.where(torch.arange(T) < lens_t.unsqueeze(1), ids, 0)
    p = layout.pack(ids, lens_t, pad_multiple=row, total_multiple=total)
    plain = layout.pack(ids, lens_t, pad_multiple=row)
    assert p.num_tokens % total == 0
    assert p.num_tokens - plain.num_tokens < total  # the least padding that reaches the multiple
    assert torch.equal(p.cu_seqlens, plain.cu_seqlens)
    assert torch.equal(p.cu_seqlens_padded[:-1], plain.cu_seqlens_padded[:-1])
    assert torch.equal(layout.unpack_values(p.input_ids, p, T), ids)
    assert p.max_seqlen == int((p.cu_seqlens_padded[1:] - p.cu_seqlens_padded[:-1]).max())


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batches_reach_the_fp8_multiple(packed):
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 17, 9, 30])
    ids = torch.where(torch.arange(30) < lens.unsqueeze(1), torch.randint(1, 90, (4, 30), generator=g), 0)
    opts = forward.RunOptions(vocab_size=100, num_micro_batches=2, packed=packed)
    mbs = forward.build_micro_batches(
        {"input_ids": ids, "seq_lens": lens},
        opts,
        dp_rank=0,
        dp_size=1,
        pad_multiple=2,
        total_multiple=32,
        device=torch.device("cpu"),
    )
    for mb in mbs:
        assert mb.input_ids.numel() % 32 == 0
        assert mb.targets.shape == mb.input_ids.shape


@pytest.fixture(scope="module")
def learner():
    from megagrpo.compat import apply_cpu_compat
    from megagrpo.config.model import ModelArch
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.learner.mesh import DistEnv

    apply_cpu_compat()
    arch = ModelArch(
        family="qwen3_moe", vocab_size=200, hidden_size=32, num_layers=2, num_attention_heads=4,
        num_kv_heads=2, head_dim=8, ffn_hidden_size=64, max_position_embeddings=128, rope_theta=1e4,
        norm_eps=1e-6, qk_norm=True, num_experts=4, moe_topk=2, moe_ffn_hidden_size=16,
    )  # fmt: skip
    env = DistEnv.from_environ({})
    lrn = Learner(arch, LearnerConfig(seed=1, num_micro_batches=2), env=env)
    yield lrn
    lrn.close(process_group=True)


@pytest.mark.parametrize("packed", [True, False])
def test_logprobs_do_not_depend_on_the_fp8_padding(learner, monkeypatch, packed):
    """A MoE model: the padding tokens also pass the routers (dropless, so they take no real token's
    place); logprobs and entropy of the real tokens stay the same to the last bit of fp32 tolerance."""
    import dataclasses

    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([7, 19, 12, 3])
    ids = torch.where(torch.arange(19) < lens.unsqueeze(1), torch.randint(1, 200, (4, 19), generator=g), 0)
    batch = {"input_ids": ids, "seq_lens": lens}
    learner.cfg = dataclasses.replace(learner.cfg, packed=packed)
    plain = learner.forward(batch)
    monkeypatch.setattr(forward, "pad_multiples", lambda config: (1, 16))
    padded = learner.forward(batch)
    torch.testing.assert_close(padded["logprobs"], plain["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(padded["entropy"], plain["entropy"], rtol=0, atol=1e-5)
    assert plain["logprobs"][0, 1:7].abs().sum() > 0


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_is_rejected_naming_the_field(cp):
    from megagrpo.config import config_from_dict
    from megagrpo.errors import MegagrpoError
    from megagrpo.learner.mesh import MeshConfig

    with pytest.raises(MegagrpoError, match=rf"mesh.cp: {cp}: context parallelism is not supported"):
        MeshConfig(cp=cp).data_parallel_size(8)  # what init_mesh checks
    with pytest.raises(MegagrpoError, match=r"mesh\.cp.*context parallelism is not supported"):
        config_from_dict({"model": {"hf_path": "m"}, "mesh": {"cp": cp}})
