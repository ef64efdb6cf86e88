"""Parameter maps and transforms: exact round trips, megatron's layouts, shard-aware names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megagrpo.bridge.export import iter_hf_buckets
from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.bridge.maps import Placement, hf_names, hf_shapes, megatron_name, param_maps
from megagrpo.bridge.transforms import to_hf, to_megatron, tp_shard, tp_unshard
from megagrpo.errors import MegagrpoError

CASES = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tie=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "mixtral": dict(arch="mixtral"),
    "deepseek_v3": dict(arch="deepseek_v3", layers=3),
    "deepseek_v3_q_full": dict(arch="deepseek_v3", layers=3, q_lora=None),  # Moonlight's q_proj
    "glm4_moe": dict(arch="glm4_moe", layers=3),
    "gpt_oss": dict(arch="gpt_oss", experts=4),
}


def _sources(pm, hf):
    """`pm`'s HF tensors; a stacked expert map (gpt-oss) takes its expert's slice."""
    return [hf[n][pm.expert] if pm.stacked else hf[n] for n in pm.hf]


def _put(out, pm, tensors, arch):
    """Store `to_hf`'s tensors under their HF names; stacked experts' slices go to their row."""
    for name, t in zip(pm.hf, tensors, strict=True):
        if pm.stacked:
            out.setdefault(name, t.new_zeros((arch.num_experts, *t.shape)))[pm.expert] = t
        else:
            out[name] = t


def _model(tiny_model, case):
    spec = dict(CASES[case])
    if "q_lora" in spec:  # re-save the tiny DeepSeek-V3 with a full q projection (q_lora_rank: null)
        import json

        from transformers import AutoConfig, AutoModelForCausalLM

        spec.pop("q_lora")
        d = tiny_model(**spec)
        out = d.parent / f"{d.name}_q_full"
        if not out.exists():
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(q_lora_rank=None)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
            model.save_pretrained(out)
        return arch_from_hf(out), load_file(str(out / "model.safetensors"))
    d = tiny_model(**spec)
    return arch_from_hf(d), load_file(str(d / "model.safetensors"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_bit_identical(tiny_model, case, tp):
    arch, hf = _model(tiny_model, case)
    assert set(hf_names(arch)) == set(hf)
    out = {}
    for pm in param_maps(arch):
        full = to_megatron(pm, _sources(pm, hf), arch, padded_vocab=1152)
        shards = [tp_shard(pm, full, r, tp) for r in range(tp)]
        if pm.tp_axis is not None and tp > 1:
            assert all(s.shape[pm.tp_axis] * tp == full.shape[pm.tp_axis] for s in shards)
        _put(out, pm, to_hf(pm, tp_unshard(pm, shards), arch), arch)
    assert set(out) == set(hf)
    for name, t in hf.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_qkv_layout_is_megatrons_group_interleave(tiny_model):
    """linear_qkv rows: per KV group g, its q heads, then k_g, then v_g (SelfAttention's [ng, (np/ng+2)*hn])."""
    arch, _ = _model(tiny_model, "qwen3")
    hd, heads, groups = arch.head_dim, arch.num_attention_heads, arch.num_kv_heads
    q = torch.arange(heads * hd, dtype=torch.float32).repeat_interleave(2).reshape(heads * hd, 2)
    k = 1000 + torch.arange(groups * hd, dtype=torch.float32).repeat_interleave(2).reshape(groups * hd, 2)
    v = 2000 + torch.arange(groups * hd, dtype=torch.float32).repeat_interleave(2).reshape(groups * hd, 2)
    pm = next(p for p in param_maps(arch) if p.mcore.endswith("0.self_attention.linear_qkv.weight"))
    pm = type(pm)(pm.mcore, pm.hf, pm.kind, pm.tp_axis, ((heads * hd, 2), (groups * hd, 2), (groups * hd, 2)))
    fused = to_megatron(pm, [q, k, v], arch, 0)
    per = heads // groups
    expect = []
    for g in range(groups):
        expect += [q[(g * per + h) * hd : (g * per + h + 1) * hd] for h in range(per)]
        expect += [k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]]
    assert torch.equal(fused, torch.cat(expect))
    # TP rank r holds whole groups: rank 1 of 2 starts with group 1's first q head
    assert torch.equal(tp_shard(pm, fused, 1, 2)[:hd], q[per * hd : (per + 1) * hd])


def test_gate_up_tp_shard_is_gate_r_then_up_r():
    arch = arch_from_hf(
        dict(
            model_type="llama",
            hidden_size=8,
            num_attention_heads=2,
            num_hidden_layers=1,
            intermediate_size=4,
            vocab_size=16,
            max_position_embeddings=8,
        )
    )
    pm = next(p for p in param_maps(arch) if p.kind == "gate_up")
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    full = to_megatron(pm, [gate, up], arch, 128)
    assert torch.equal(tp_shard(pm, full, 1, 2), torch.cat([gate[2:], up[2:]]))


def test_vocab_padding_is_zero_and_cut_back(tiny_model):
    arch, hf = _model(tiny_model, "llama")
    pm = param_maps(arch)[0]
    full = to_megatron(pm, [hf[pm.hf[0]]], arch, padded_vocab=1280)
    assert full.shape == (1280, 64) and not full[1024:].any()
    assert torch.equal(to_hf(pm, full, arch)[0], hf[pm.hf[0]])
    with pytest.raises(MegagrpoError, match="padded vocab"):
        to_megatron(pm, [hf[pm.hf[0]]], arch, padded_vocab=512)


def test_shape_disagreeing_with_config_names_key(tiny_model):
    arch, hf = _model(tiny_model, "qwen3")
    pm = next(p for p in param_maps(arch) if p.kind == "qkv")
    bad = [hf[pm.hf[0]][:-1], hf[pm.hf[1]], hf[pm.hf[2]]]
    with pytest.raises(MegagrpoError, match="q_proj.weight"):
        to_megatron(pm, bad, arch, 1024)


def test_tied_has_no_output_layer(tiny_model):
    arch, hf = _model(tiny_model, "llama_tied")
    assert "lm_head.weight" not in hf
    assert all(pm.mcore != "output_layer.weight" for pm in param_maps(arch))


def test_names_for_ranks(tiny_model):
    arch, _ = _model(tiny_model, "qwen3_moe")
    maps = {pm.mcore: pm for pm in param_maps(arch)}
    e5 = maps["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert megatron_name(e5, arch, Placement(ep_rank=0, ep_size=2)) is None
    assert megatron_name(e5, arch, Placement(ep_rank=1, ep_size=2)) == (
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    )
    grouped = Placement(layer_offset=1, ep_rank=1, ep_size=2, grouped_experts=True)
    assert megatron_name(e5, arch, grouped) == "decoder.layers.0.mlp.experts.linear_fc1.weight1"
    te = Placement(te_norms=True)
    norm0 = maps["decoder.layers.0.input_layernorm.weight"]
    mlp_norm = maps["decoder.layers.0.pre_mlp_layernorm.weight"]
    assert megatron_name(norm0, arch, te) == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    # MoE layers keep a separate pre-MLP norm under the TE spec (only dense fc1 fuses it)
    assert megatron_name(mlp_norm, arch, te) == "decoder.layers.0.pre_mlp_layernorm.weight"
    dense, _ = _model(tiny_model, "qwen3")
    dmaps = {pm.mcore: pm for pm in param_maps(dense)}
    assert megatron_name(dmaps["decoder.layers.0.pre_mlp_layernorm.weight"], dense, te) == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )
    assert maps["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)


def test_mla_and_router_bias_rows(tiny_model):
    arch, hf = _model(tiny_model, "deepseek_v3")
    maps = {pm.mcore: pm for pm in param_maps(arch)}
    attn = "decoder.layers.1.self_attention."
    assert maps[attn + "linear_q_down_proj.weight"].hf == ("model.layers.1.self_attn.q_a_proj.weight",)
    assert maps[attn + "q_layernorm.weight"].hf == ("model.layers.1.self_attn.q_a_layernorm.weight",)
    assert maps[attn + "linear_kv_down_proj.weight"].hf == (
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
    )
    assert (
        maps[attn + "linear_kv_up_proj.weight"].tp_axis == 0
        and maps[attn + "linear_proj.weight"].tp_axis == 1
    )
    bias = maps["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.hf == ("model.layers.1.mlp.gate.e_score_correction_bias",) and bias.tp_axis is None
    assert hf[bias.hf[0]].abs().min() > 0  # the tiny model's correction bias is not zero
    shared = maps["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert shared.kind == "gate_up" and shared.hf[0] == "model.layers.1.mlp.shared_experts.gate_proj.weight"
    assert "decoder.layers.0.mlp.linear_fc1.weight" in maps  # the dense first layer
    assert "decoder.layers.0.mlp.router.weight" not in maps
    q_full, _ = _model(tiny_model, "deepseek_v3_q_full")
    names = {pm.mcore for pm in param_maps(q_full)}
    assert attn + "linear_q_proj.weight" in names and attn + "linear_q_down_proj.weight" not in names


def test_export_keeps_the_correction_bias_fp32(tiny_model):
    arch, hf = _model(tiny_model, "glm4_moe")
    params = {pm.mcore: to_megatron(pm, [hf[n] for n in pm.hf], arch, 1152) for pm in param_maps(arch)}
    got = {
        n: t for b in iter_hf_buckets(params, arch, bucket_bytes=1 << 30, dtype=torch.bfloat16) for n, t in b
    }
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert got[name].dtype == torch.float32 and torch.equal(got[name], hf[name])
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["llama_tied", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss"])
@pytest.mark.parametrize("bucket_bytes", [1, 5000, 1 << 30])
def test_single_process_export_buckets(tiny_model, case, bucket_bytes):
    arch, hf = _model(tiny_model, case)
    params = {pm.mcore: to_megatron(pm, _sources(pm, hf), arch, 1152) for pm in param_maps(arch)}
    got = {}
    buckets = list(iter_hf_buckets(params, arch, bucket_bytes=bucket_bytes))
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= bucket_bytes or len(b) == 1
        got.update(b)
    assert set(got) == set(hf) and all(torch.equal(got[n], hf[n]) for n in hf)
    if bucket_bytes == 1:
        assert len(buckets) == len(hf)


def test_export_refuses_unknown_parameter(tiny_model):
    arch, hf = _model(tiny_model, "qwen3")
    params = {pm.mcore: to_megatron(pm, [hf[n] for n in pm.hf], arch, 1024) for pm in param_maps(arch)}
    params["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] = torch.zeros(2, 2)
    with pytest.raises(MegagrpoError, match="shared_experts"):
        list(iter_hf_buckets(params, arch, bucket_bytes=1 << 20))


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_local_shards_of_a_tp2_ep2_pp2_mesh_reassemble(tiny_model, case):
    """Every rank's shards, gathered back (TP, then EP, then PP), give exactly the HF state dict."""
    from megagrpo.bridge.load import iter_local_shards

    arch, hf = _model(tiny_model, case)
    n_local = arch.num_experts // 2
    params: dict[tuple, torch.Tensor] = {}
    for pp in range(2):
        for ep in range(2):
            for tp in range(2):
                place = Placement(layer_offset=pp, ep_rank=ep, ep_size=2)
                for name, shard in iter_local_shards(
                    hf.__getitem__,
                    arch,
                    padded_vocab=1152,
                    place=place,
                    tp_rank=tp,
                    tp_size=2,
                    etp_rank=tp,
                    etp_size=2,
                    layers={pp},
                    first_stage=pp == 0,
                    last_stage=pp == 1,
                ):
                    params[(pp, ep, tp, name)] = shard
    out = {}
    for pm in param_maps(arch):
        pp = 0 if pm.mcore.startswith("embedding.") else (1 if pm.layer is None else pm.layer)
        ep_rank = pm.expert // n_local if pm.is_expert else 0
        place = Placement(layer_offset=pp, ep_rank=ep_rank, ep_size=2)
        name = megatron_name(pm, arch, place)
        shards = [params[(pp, place.ep_rank, tp, name)] for tp in range(2)]
        if pm.tp_axis is None:
            assert torch.equal(shards[0], shards[1])
        _put(out, pm, to_hf(pm, tp_unshard(pm, shards), arch), arch)
    assert set(out) == set(hf) and all(torch.equal(out[n], hf[n]) for n in hf)
    # layer 1's last expert lives on EP rank 1 as its last local expert, named with the stage-local layer 0
    last = f"decoder.layers.0.mlp.experts.local_experts.{n_local - 1}.linear_fc1.weight"
    assert (1, 1, 0, last) in params


@pytest.mark.parametrize("case", list(CASES))
def test_announced_shapes_are_the_checkpoint_s(tiny_model, case):
    """What the trainer announces before a streamed weight sync is exactly the engine's checkpoint."""
    from megagrpo.sync.checks import check_announced

    arch, hf = _model(tiny_model, case)
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    assert hf_shapes(arch) == shapes
    check_announced(shapes, hf_shapes(arch))


def test_a_bad_announcement_is_refused_by_name():
    from megagrpo.sync.checks import check_announced

    shapes = {"a.weight": (4, 2), "b.weight": (3,)}
    for announced, words in (
        (
            {"a.weight": (4, 2), "b.weight": (3,), "c.weight": (1,)},
            "'c.weight' is not in the engine's checkpoint",
        ),
        ({"a.weight": (2, 4), "b.weight": (3,)}, r"'a.weight' has shape \(2, 4\)"),
        ({"a.weight": (4, 2)}, r"missing from the export: \['b.weight'\]"),
    ):
        with pytest.raises(MegagrpoError, match=words):
            check_announced(shapes, announced)
    check_announced(shapes, {"a.weight": (4, 2)}, partial=True)
