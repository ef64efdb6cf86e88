"""gpt_oss (issue 44): config.json <-> ModelArch on the public configs and the tiny model, fields the learner
could not reproduce refused by name, the stacked-expert layout against transformers' own expert module, and
the released models' tensor sets built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megagrpo.bridge.export import iter_hf_buckets
from megagrpo.bridge.hf_config import arch_from_hf, hf_config_from_arch
from megagrpo.bridge.hf_io import HFCheckpoint
from megagrpo.bridge.maps import hf_shapes, param_maps
from megagrpo.bridge.transforms import to_megatron, tp_shard
from megagrpo.config.schema import SyncConfig
from megagrpo.errors import MegagrpoError

MODELS = Path(__file__).resolve().parents[3] / "configs" / "models"
RELEASED = {"gpt-oss-20b": (24, 32), "gpt-oss-120b": (36, 128)}
# OpenAI's gpt-oss model card, table 1: total parameters (MLP + attention + embedding and unembedding)
CARD_TOTAL = {"gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9}


def _cfg(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


@pytest.mark.parametrize("name", list(RELEASED))
def test_the_public_configs(name):
    layers, experts = RELEASED[name]
    arch = arch_from_hf(MODELS / name)
    assert (arch.family, arch.num_layers, arch.num_experts, arch.moe_topk) == ("gpt_oss", layers, experts, 4)
    assert (arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (2880, 64, 8, 64)
    assert arch.moe_ffn_hidden_size == 2880 and arch.vocab_size == 201088
    assert arch.layer_types == ("sliding_attention", "full_attention") * (layers // 2)
    assert arch.sliding_window == 128 and arch.sliding_layers() == list(range(0, layers, 2))
    assert arch.attention_sinks and arch.qkv_bias and arch.attn_out_bias
    assert arch.moe_router_bias and arch.moe_expert_bias and arch.moe_renormalize_topk
    assert not arch.moe_router_expert_bias  # gpt-oss's router bias enters the weights too
    assert (arch.swiglu_alpha, arch.swiglu_limit, arch.swiglu_up_offset) == (1.702, 7.0, 1.0)
    assert (arch.rope_type, arch.rope_theta, arch.rope_scaling_factor) == ("yarn", 150000.0, 32.0)
    assert arch.rope_original_max_position_embeddings == 4096 and not arch.rope_truncate
    assert (arch.rope_beta_fast, arch.rope_beta_slow, arch.norm_eps) == (32.0, 1.0, 1e-5)


@pytest.mark.parametrize("name", list(RELEASED))
def test_the_export_config_maps_back_and_transformers_reads_it_alike(name):
    from transformers import GptOssConfig

    cfg = _cfg(name)
    arch = arch_from_hf(cfg)
    out = hf_config_from_arch(arch, base=cfg)
    # the export writes bf16 experts: no quantization_config sends loaders looking for MXFP4 blocks
    assert arch_from_hf(out) == arch and "quantization_config" not in out
    ours = GptOssConfig(**{k: v for k, v in out.items() if k not in ("model_type", "architectures")})
    theirs = GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    for field in ("layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit", "num_local_experts"):
        assert getattr(ours, field) == getattr(theirs, field), field
    keys = ("rope_type", "factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings")
    assert {k: ours.rope_parameters[k] for k in keys} == {k: theirs.rope_parameters[k] for k in keys}


def test_absent_fields_mean_gpt_oss_config_defaults():
    """A config that leaves out what GptOssConfig defaults parses as transformers completes it."""
    from transformers import GptOssConfig

    small = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 2880, "vocab_size": 201088,
             "intermediate_size": 2880}  # fmt: skip
    full = GptOssConfig(num_hidden_layers=4, hidden_size=2880, vocab_size=201088, intermediate_size=2880)
    filled = {k: v for k, v in full.to_dict().items() if k not in ("architectures", "transformers_version")}
    assert arch_from_hf(small) == arch_from_hf({**filled, "model_type": "gpt_oss"})
    assert arch_from_hf(small).layer_types == tuple(full.layer_types)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["full_attention"] * 23 + ["chunked_attention"]}, "layer_types"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"swiglu_limit": 0.0}, "swiglu_limit"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.quant_method"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, "original_max_position_embeddings"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 32.0}}, "rope_scaling.rope_type"),
        ({"num_key_value_heads": 7}, "num_key_value_heads"),
    ],
)
def test_unreproducible_fields_are_named(change, field):
    with pytest.raises(MegagrpoError, match=field):
        arch_from_hf({**_cfg("gpt-oss-20b"), **change})


def test_fractional_yarn_stays_gpt_oss_s():
    """`truncate: false` is read for gpt-oss only; DeepSeek's MLA learner rounds the YaRN range."""
    deepseek = json.loads((MODELS / "DeepSeek-V3" / "config.json").read_text())
    deepseek["rope_scaling"] = {**deepseek["rope_scaling"], "truncate": False}
    with pytest.raises(MegagrpoError, match="rope_scaling.truncate"):
        arch_from_hf(deepseek)


def test_the_stacked_expert_layout_is_transformers(tiny_model):
    """megatron's fc1 = cat(gate, up) and fc2 from HF's interleaved [E, H, 2F] / [E, F, H] tensors give the
    expert output transformers' GptOssExperts computes (its own clamped SwiGLU on gate_up[..., ::2] / [1::2]),
    and a wrongly de-interleaved fc1 (the halves of gate_up) does not."""
    from transformers import AutoModelForCausalLM

    d = tiny_model("gpt_oss", experts=4)
    arch = arch_from_hf(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    hf = load_file(str(d / "model.safetensors"))
    maps = {pm.mcore: pm for pm in param_maps(arch)}
    x = 60.0 * torch.randn(16, arch.hidden_size, generator=torch.Generator().manual_seed(0))

    def mega(name, e):
        pm = maps[f"decoder.layers.0.mlp.experts.local_experts.{e}.{name}"]
        return to_megatron(pm, [hf[n][e] for n in pm.hf], arch, 1024)

    def clamped_swiglu(gate, up):  # the arch's description, as the learner computes it
        gate, up = gate.clamp(max=arch.swiglu_limit), up.clamp(-arch.swiglu_limit, arch.swiglu_limit)
        return gate * torch.sigmoid(arch.swiglu_alpha * gate) * (up + arch.swiglu_up_offset)

    for e in range(arch.num_experts):
        with torch.no_grad():
            gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            want = experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]
            fc1 = x @ mega("linear_fc1.weight", e).T + mega("linear_fc1.bias", e)
            gate, up = fc1.chunk(2, dim=-1)
            got = clamped_swiglu(gate, up) @ mega("linear_fc2.weight", e).T + mega("linear_fc2.bias", e)
            wrong_gate, wrong_up = gate_up.chunk(2, dim=-1)
        assert (gate_up.abs() > arch.swiglu_limit).any()  # the clamp is exercised
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(clamped_swiglu(wrong_gate, wrong_up), experts._apply_gate(gate_up))


def test_sinks_and_biases_rows(tiny_model):
    arch = arch_from_hf(tiny_model("gpt_oss", experts=4))
    maps = {pm.mcore: pm for pm in param_maps(arch)}
    sinks = maps["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert sinks.hf == ("model.layers.1.self_attn.sinks",) and sinks.tp_axis == 0  # heads split over TP
    full = torch.arange(4.0)
    assert [tp_shard(sinks, full, r, 2).tolist() for r in range(2)] == [[0.0, 1.0], [2.0, 3.0]]
    assert maps["decoder.layers.0.self_attention.linear_proj.bias"].tp_axis is None  # added after the reduce
    assert maps["decoder.layers.0.mlp.router.bias"].hf == ("model.layers.0.mlp.router.bias",)
    fc2_bias = maps["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.bias"]
    assert fc2_bias.stacked and fc2_bias.expert == 3 and fc2_bias.tp_axis is None


def test_the_checkpoint_reader_reads_one_expert_s_slice(tiny_model, tmp_path):
    d = tiny_model("gpt_oss", experts=4)
    ckpt = HFCheckpoint(d)
    hf = load_file(str(d / "model.safetensors"))
    for pm in param_maps(ckpt.arch):
        want = to_megatron(pm, [hf[n][pm.expert] if pm.stacked else hf[n] for n in pm.hf], ckpt.arch, 1024)
        assert torch.equal(ckpt.megatron_tensor(pm, 1024), want), pm.mcore
    # a stacked tensor with one expert too few is named against config.json
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((d / "config.json").read_text())
    name = "model.layers.1.mlp.experts.down_proj"
    save_file({**hf, name: hf[name][:3].contiguous()}, str(bad / "model.safetensors"))
    with pytest.raises(MegagrpoError, match=rf"{name}.*\(3, 64, 64\).*\(4, 64, 64\)"):
        HFCheckpoint(bad)


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_tensor_sets_on_the_meta_device(name):
    """The released models' HF tensors, built as megatron tensors on the meta device and exported at the
    default bucket size, are exactly the checkpoint's (stacked experts whole), and count the model card's
    parameters."""
    arch = arch_from_hf(MODELS / name)
    shapes = hf_shapes(arch)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (arch.num_experts, 2880, 5760)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (arch.num_experts, 2880, 2880)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert abs(total - CARD_TOTAL[name]) / CARD_TOTAL[name] < 1e-3, total

    def meta(pm):
        return [torch.empty(s, dtype=torch.bfloat16, device="meta") for s in pm.hf_shapes]

    params = {pm.mcore: to_megatron(pm, meta(pm), arch, arch.vocab_size) for pm in param_maps(arch)}
    got = {}
    for bucket in iter_hf_buckets(params, arch, bucket_bytes=SyncConfig().bucket_mb << 20):
        got.update((n, tuple(t.shape)) for n, t in bucket)
    assert got == shapes


def test_train_refuses_gpt_oss_by_name_before_start(tiny_model, tmp_path, capsys, monkeypatch):
    from megagrpo.cli import main

    started = []
    monkeypatch.setattr("megagrpo.trainer.entry.run", lambda *a, **k: started.append(a) or 0)
    model = tiny_model("gpt_oss", experts=4)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"model:\n  hf_path: {model}\ncheckpoint:\n  dir: {tmp_path / 'ckpt'}\n")
    assert main(["train", str(cfg)]) == 2 and not started
    err = capsys.readouterr().err
    assert f"model.hf_path={str(model)!r}: model family 'gpt_oss' cannot be trained yet" in err
    assert "SGLang engine side" in err


def test_the_dist_checkpoint_writer_takes_a_slice_s_own_data(tmp_path):
    """One expert's slice of a stacked HF tensor is a view at a storage offset; the writer's chunk views
    index storage from its start, so without a copy every expert's chunk held expert 0's bias."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from megagrpo.bridge.dist_ckpt import ChunkSpec, write_dist_checkpoint

    stacked = torch.arange(12.0).reshape(3, 4)
    chunks = [
        ChunkSpec("bias", (3, 4), (e, 0), (1, 4), torch.float32, f"e{e}", ((4,), (1,), 0)) for e in range(3)
    ]
    write_dist_checkpoint(tmp_path, chunks, [], lambda source: stacked[int(source[1:])])
    got = {"bias": torch.zeros(3, 4)}
    dcp.load(got, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(got["bias"], stacked)


def _mxfp4_checkpoint(src: Path, dst: Path, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`src` (the tiny gpt-oss) with its stacked expert weights shipped as MXFP4, as the release ships them:
    random `name_blocks` [E, rows, G, 16] / `name_scales` [E, rows, G] in place of `name`."""
    from safetensors.torch import save_file

    hf = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    quant = {}
    for name in [n for n in hf if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = hf.pop(name).shape  # [E, 32 G, rows] dequantised
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        hf[name + "_blocks"], hf[name + "_scales"] = blocks, scales
        quant[name] = (blocks, scales)
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(hf, str(dst / "model.safetensors"))
    return quant


def test_mxfp4_experts_dequantise_exactly_as_transformers_does(tiny_model, tmp_path):
    """E2M1 x 2^E8M0 read as bf16 equals transformers' own dequantisation (`_convert_moe_packed_tensors`)
    bit for bit, whole or one expert's slice, and converts to the megatron tensors of that bf16 tensor."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    from megagrpo.bridge.mxfp4 import dequantize_mxfp4

    quant = _mxfp4_checkpoint(tiny_model("gpt_oss", experts=4), tmp_path / "mxfp4")
    ckpt = HFCheckpoint(tmp_path / "mxfp4")
    assert ckpt.mxfp4 == set(quant)
    for name, (blocks, scales) in quant.items():
        want = _convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        got = ckpt.get(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
        assert torch.equal(dequantize_mxfp4(blocks[2], scales[2]), want[2])
        # exact: the bf16 values are the fp32 products E2M1 x 2^(s - 127)
        assert torch.equal(got.float(), dequantize_mxfp4(blocks, scales).float())
    maps = {pm.mcore: pm for pm in param_maps(ckpt.arch)}
    pm = maps["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    want = to_megatron(pm, [ckpt.get("model.layers.1.mlp.experts.gate_up_proj")[3]], ckpt.arch, 1024)
    assert torch.equal(ckpt.megatron_tensor(pm, 1024), want)
    assert ckpt.dtype("model.layers.1.mlp.experts.down_proj") == torch.bfloat16


def test_a_broken_mxfp4_pair_is_named(tiny_model, tmp_path):
    from safetensors.torch import save_file

    dst = tmp_path / "mxfp4"
    _mxfp4_checkpoint(tiny_model("gpt_oss", experts=4), dst)
    hf = load_file(str(dst / "model.safetensors"))
    del hf["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(hf, str(dst / "model.safetensors"))
    with pytest.raises(MegagrpoError, match="model.layers.0.mlp.experts.down_proj"):
        HFCheckpoint(dst)
    from megagrpo.bridge.mxfp4 import dequantize_mxfp4

    with pytest.raises(MegagrpoError, match="scales outside bf16's exact range"):
        dequantize_mxfp4(torch.zeros(1, 1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))


def test_mxfp4_quantisation_inverts_the_dequantisation_and_rounds_half_to_even():
    """quantize(dequantize(blocks, scales)) gives the same blocks and scales back (a block whose largest
    element is 4 or 6 has exactly one OCP scale); other values round to the nearest E2M1 number (half to
    even on the mantissa bit, saturating at 6) under scale 2^(floor(log2 amax) - 2), OCP MX v1.0 6.3."""
    from megagrpo.bridge.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    blocks[..., 0] |= 0x07  # each block's largest magnitude is 6: its scale is the OCP one
    scales = torch.randint(100, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    b2, s2 = quantize_mxfp4(dequantize_mxfp4(blocks, scales))
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    values = torch.randn(2, 64, 5, generator=g) * 3
    got = dequantize_mxfp4(*quantize_mxfp4(values)).float()
    v = values.transpose(-1, -2).reshape(2, 5, 2, 32)
    scale = 2.0 ** (torch.floor(torch.log2(v.abs().amax(-1, keepdim=True))) - 2)
    grid = torch.tensor(E2M1_VALUES[:8])
    dist = ((v.abs() / scale).unsqueeze(-1) - grid).abs()
    # ties to the even code (0, 1.0, 2.0, 4.0: even index), then the nearest
    best = (dist - 1e-6 * (torch.arange(8) % 2 == 0)).argmin(-1)
    want = (grid[best] * v.sign() * scale).reshape(2, 5, 64).transpose(-1, -2)
    assert torch.equal(got, want)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] + [6.0] * 24).reshape(32, 1)
    assert dequantize_mxfp4(*quantize_mxfp4(ties)).flatten()[:8].tolist() == [0, 1, 1, 2, 2, 4, 4, 6]


def test_mxfp4_export_is_refused_for_a_family_without_stacked_experts(tiny_model):
    from megagrpo.bridge.mxfp4 import mxfp4_names

    assert mxfp4_names(arch_from_hf(tiny_model("gpt_oss", experts=4)))[:2] == [
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ]
    with pytest.raises(MegagrpoError, match="'qwen3_moe' has no stacked expert weights"):
        mxfp4_names(arch_from_hf(tiny_model("qwen3_moe")))
