"""Groups that SGLang fuses at load travel in one bucket (issue 43): on the released DeepSeek-V3-family
configs, built on the meta device, at the default `sync.bucket_mb`, and at any bucket size; a split group
is refused by name before anything is sent.

Why it matters: SGLang's DeepSeek-V3 loader caches q_a_proj until kv_a_proj_with_mqa arrives in the same
`load_weights` call; a pair split over two calls is dropped without a word and the engine keeps its old
fused weight (measured on a tiny DeepSeek-V3 before the fix: 5.2 nats from the learner, checksum false).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megagrpo.bridge.bucketing import BucketFiller
from megagrpo.bridge.export import iter_hf_buckets
from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.bridge.maps import hf_shapes, param_maps
from megagrpo.bridge.transforms import to_megatron
from megagrpo.config.schema import SyncConfig
from megagrpo.errors import MegagrpoError
from megagrpo.sync import bucketize, validate_buckets
from megagrpo.sync.sglang_layout import load_groups
from megagrpo.trainer.weights import fused_groups

MODELS = Path(__file__).resolve().parents[3] / "configs" / "models"
DEFAULT_BUCKET_BYTES = SyncConfig().bucket_mb << 20


def _meta_learner(arch) -> dict[str, torch.Tensor]:
    """The full model's megatron tensors (TP = EP = PP = 1) on the meta device, bf16 as the learner holds."""
    return {
        pm.mcore: to_megatron(
            pm,
            [torch.empty(s, dtype=torch.bfloat16, device="meta") for s in pm.hf_shapes],
            arch,
            arch.vocab_size,
        )
        for pm in param_maps(arch)
    }


def _split_groups(buckets, together) -> list[tuple[str, ...]]:
    where = {name: i for i, b in enumerate(buckets) for name, _ in b}
    return sorted(g for g in set(together.values()) if len({where[n] for n in g}) > 1)


@pytest.mark.parametrize("model", ["DeepSeek-V3", "Kimi-K2", "GLM-4.5-Air"])
def test_the_export_keeps_every_fused_group_in_one_bucket_at_the_default_size(model):
    arch = arch_from_hf(MODELS / model)
    params = _meta_learner(arch)
    together = fused_groups(arch)
    kinds = {n.rsplit(".", 2)[-2] for n in together}
    assert {"gate_proj", "up_proj"} <= kinds  # shared and routed experts' gate/up, the dense layers'
    if arch.is_mla:
        assert {"q_a_proj", "kv_a_proj_with_mqa"} <= kinds  # both ship a q latent
    else:
        assert {"q_proj", "k_proj", "v_proj"} <= kinds

    # The bucketing the trainer used before: closed on bytes alone, in the map's order.
    before = list(iter_hf_buckets(params, arch, bucket_bytes=DEFAULT_BUCKET_BYTES))
    cut = _split_groups(before, together)
    assert cut, "the old cut splits groups at the default size (the failure this test guards against)"
    with pytest.raises(MegagrpoError, match="later bucket"):
        validate_buckets(before, hf_shapes(arch), check_finite=False)

    buckets = list(iter_hf_buckets(params, arch, bucket_bytes=DEFAULT_BUCKET_BYTES, together=together))
    assert not _split_groups(buckets, together)
    validate_buckets(buckets, hf_shapes(arch), check_finite=False)  # the sync's own check agrees
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    # at real sizes no group's span outgrows a bucket: only a single tensor (the embedding) does
    assert all(s <= DEFAULT_BUCKET_BYTES or len(b) == 1 for s, b in zip(sizes, buckets))
    assert len(buckets) <= len(before) + arch.num_layers  # at most one extra cut per layer


@pytest.mark.parametrize("bucket_bytes", [1, 3000, 20000])
def test_tiny_buckets_never_cut_a_group(tiny_model, bucket_bytes):
    """At any size: a bucket exceeds its size only by one group's span (kv_a ... q_a in the map's order)."""
    d = tiny_model(arch="deepseek_v3", layers=3)
    arch = arch_from_hf(d)
    params = _meta_learner(arch)
    together = fused_groups(arch)
    buckets = list(iter_hf_buckets(params, arch, bucket_bytes=bucket_bytes, together=together))
    assert not _split_groups(buckets, together)
    assert {n for b in buckets for n, _ in b} == set(hf_shapes(arch))
    for b in buckets:
        names = [n for n, _ in b]
        if sum(t.numel() * t.element_size() for _, t in b) > bucket_bytes and len(b) > 1:
            assert any(n in together for n in names), names  # only a group's span may overflow
    flat = [(n, t) for b in buckets for n, t in b]
    assert not _split_groups(list(bucketize(flat, bucket_bytes)), together)  # the sync's own bucketer too


def test_a_split_group_is_refused_by_name():
    shapes = {
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (12, 16),
        "model.layers.0.self_attn.kv_b_proj.weight": (8, 8),
        "model.layers.0.self_attn.q_a_proj.weight": (4, 16),
    }
    t = {n: torch.zeros(s) for n, s in shapes.items()}
    names = list(shapes)
    assert set(load_groups(shapes)) == {names[0], names[2]}
    with pytest.raises(MegagrpoError, match=r"q_a_proj.*later bucket.*kv_a_proj_with_mqa"):
        validate_buckets([[(n, t[n]) for n in names[:2]], [(names[2], t[names[2]])]], shapes)
    validate_buckets([[(n, t[n]) for n in names]], shapes)
    # a partial sync that leaves a group incomplete is no split (SGLang loads it as any subset)
    validate_buckets([[(names[0], t[names[0]])]], shapes, partial=True)


def test_the_filler_cuts_before_an_open_group_and_carries_it():
    together = {"a": ("a", "c"), "c": ("a", "c")}
    f = BucketFiller(8, together)
    t4 = torch.zeros(1, dtype=torch.int32)  # 4 bytes each
    got = [f.add(n, t4) for n in ("x", "a", "b", "c", "y")]
    # x | a b c (a's group was open when b overflowed x+a, so the cut goes before a) | y
    closed = [[n for n, _ in b] for b in got if b is not None]
    assert closed == [["x"], ["a", "b", "c"]]
    assert [n for n, _ in f.finish()] == ["y"]


def test_an_expert_pair_is_a_group_even_where_the_layer_is_incomplete():
    """A layer missing one expert tensor is sent through `load_weights`, expert by expert: the other
    experts' gate/up pairs still travel whole, so a bad export is named for what is missing."""
    shapes = {
        f"model.layers.1.mlp.experts.{e}.{k}_proj.weight": (4, 8) if k != "down" else (8, 4)
        for e in range(2)
        for k in ("gate", "up", "down")
    }
    del shapes["model.layers.1.mlp.experts.1.up_proj.weight"]
    groups = load_groups(shapes)
    pair = ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight")
    assert groups == dict.fromkeys(pair, pair)
    tensors = [(n, torch.zeros(s)) for n, s in shapes.items()]
    assert not _split_groups(list(bucketize(tensors, 64)), groups)
