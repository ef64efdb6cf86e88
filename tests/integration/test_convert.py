"""Issue 5 conversion tools against Hugging Face transformers, on one process.

One subprocess (tests/dist/_harness.py, 1 rank) converts every tiny model HF -> Megatron with
tools/convert_hf_to_megatron.py, runs the megatron model on a fixed batch, and converts back with
tools/convert_megatron_to_hf.py; this pytest process (which never applies the CPU patches) computes the
transformers reference logits, checks the round trip tensor by tensor, loads the exported directory with
`AutoModelForCausalLM`, and checks the bad-input errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megagrpo.compat import APPLIED
from megagrpo.errors import MegagrpoError
from tests.dist._common import without_q_latent
from tests.dist._harness import launch

if not APPLIED:
    from transformers import AutoModelForCausalLM  # noqa: F401  (before any CPU patch, see tests/dist)

MODELS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen3_moe": dict(arch="qwen3_moe", experts=8, topk=2),
    "mixtral": dict(arch="mixtral", experts=8, topk=2),
    # issue 37: MLA with YaRN, group-limited sigmoid router with a correction bias, shared expert, dense
    # first layer; deepseek_v3 also ships a multi-token-prediction layer (`_with_mtp_layer`)
    "deepseek_v3": dict(arch="deepseek_v3", experts=8, topk=2),
    "deepseek_v3_no_q_latent": dict(arch="deepseek_v3", experts=8, topk=2),  # `without_q_latent`
    "glm4_moe": dict(arch="glm4_moe", experts=8, topk=2),
    # issue 44: sinks, sliding windows, biases, stacked HF experts (`ParamMap.stacked`)
    "gpt_oss": dict(arch="gpt_oss", experts=8, topk=2, layers=4),
}
# gpt-oss as released: a bf16 body and MXFP4 experts (`_as_released_mxfp4`), converted (read dequantised)
# and exported back both as bf16 and with --mxfp4
MXFP4 = "gpt_oss_mxfp4"
WITH_MTP = "deepseek_v3"
# as DeepSeek-V3, Kimi-K2 and GLM-4.5 ship: a bf16 body and the routers' correction bias in fp32
# (`_with_released_dtypes`), converted without --dtype and with --dtype bfloat16
MIXED = "deepseek_v3_mixed_dtypes"
SHARD_BYTES = 200_000  # small, so the exported model is sharded with an index


def worker(rank: int, world: int, outdir: Path, *, models: dict, refs: str) -> None:
    from megagrpo.config.model import ModelArch
    from megagrpo.convert.hf_to_megatron import build_model, convert, init_single_process
    from megagrpo.convert.megatron_to_hf import export, load_model
    from megagrpo.learner.mesh import MeshConfig
    from tests.dist.test_bridge_dist import _forward_logits

    init_single_process()
    reference = torch.load(refs)
    results = {}
    for name, hf_dir in models.items():
        if name in (MIXED, MXFP4):
            continue
        summary = convert(hf_dir, outdir / f"ckpt_{name}", progress=False)
        arch = ModelArch.from_dict(summary["arch"])
        (model,) = load_model(outdir / f"ckpt_{name}", arch, MeshConfig(), torch.float32)
        logits = _forward_logits(model, reference["ids"], arch.vocab_size)
        export(outdir / f"ckpt_{name}", outdir / f"hf_{name}", max_shard_bytes=SHARD_BYTES)
        results[name] = {"logits_err": (logits - reference[name]).abs().max().item()}
    # interop with the learner's checkpoints: its loader reads a converted checkpoint, and a checkpoint the
    # learner saved exports back to the original HF tensors
    from megagrpo.learner.checkpoint import load_checkpoint, save_checkpoint

    arch = ModelArch.from_dict(
        convert(models["qwen3_moe"], outdir / "ckpt_learner_src", progress=False)["arch"]
    )
    (model,) = build_model(arch)
    load_checkpoint(outdir / "ckpt_learner_src", [model], arch=arch, load_rng=False)
    logits = _forward_logits(model, reference["ids"], arch.vocab_size)
    results["learner_load_logits_err"] = (logits - reference["qwen3_moe"]).abs().max().item()
    step = save_checkpoint(outdir / "learner" / "step_00000001", [model], step=1, arch=arch)
    export(step, outdir / "hf_from_learner")
    # multi-token-prediction tensors: a checkpoint without them (a learner's) exports none and says so in
    # config.json, unless --mtp-from names the HF directory that has them
    bare = outdir / "ckpt_mtp_bare"
    shutil.copytree(outdir / f"ckpt_{WITH_MTP}", bare, ignore=shutil.ignore_patterns("mtp-*"))
    export(bare, outdir / "hf_mtp_bare")
    export(bare, outdir / "hf_mtp_from", mtp_from=models[WITH_MTP], max_shard_bytes=SHARD_BYTES)
    # mixed dtypes: the body's dtype by default, the fp32 bias kept fp32 with or without --dtype bfloat16
    for tag, dt in (("default", None), ("bf16", "bfloat16")):
        results[f"mixed_{tag}"] = convert(
            models[MIXED], outdir / f"ckpt_mixed_{tag}", dtype=dt, progress=False
        )["dtype"]
        export(outdir / f"ckpt_mixed_{tag}", outdir / f"hf_mixed_{tag}")
    convert(models[MXFP4], outdir / f"ckpt_{MXFP4}", progress=False)
    export(outdir / f"ckpt_{MXFP4}", outdir / f"hf_{MXFP4}")
    export(outdir / f"ckpt_{MXFP4}", outdir / f"hf_{MXFP4}_out", mxfp4=True)
    # --dtype: a bf16 checkpoint, exported back as bf16
    convert(models["qwen3_moe"], outdir / "ckpt_bf16", dtype="bfloat16", progress=False)
    export(outdir / "ckpt_bf16", outdir / "hf_bf16")
    (outdir / "results.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.dist.test_bridge_dist import fixed_batch

    out = tmp_path_factory.mktemp("convert")
    dirs = {name: str(tiny_model(**spec)) for name, spec in MODELS.items()}
    dirs[WITH_MTP] = str(_with_mtp_layer(Path(dirs[WITH_MTP]), out / f"src_{WITH_MTP}"))
    name = "deepseek_v3_no_q_latent"
    dirs[name] = str(without_q_latent(Path(dirs[name]), out / f"src_{name}"))
    refs: dict[str, torch.Tensor] = {"ids": fixed_batch()}
    for name, d in dirs.items():  # the mixed-dtype model (no reference logits) is added after
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            refs[name] = hf(refs["ids"]).logits
    torch.save(refs, out / "refs.pt")
    dirs[MIXED] = str(_with_released_dtypes(Path(tiny_model(**MODELS["deepseek_v3"])), out / f"src_{MIXED}"))
    dirs[MXFP4] = str(_as_released_mxfp4(Path(tiny_model(**MODELS["gpt_oss"])), out / f"src_{MXFP4}"))
    launch(
        "tests.integration.test_convert:worker", 1, out, timeout=900, models=dirs, refs=str(out / "refs.pt")
    )
    return out, dirs, refs, json.loads((out / "results.json").read_text())


def _with_mtp_layer(src: Path, dst: Path) -> Path:
    """A copy of tiny model `src` that ships one multi-token-prediction layer as DeepSeek-V3 does
    (`model.layers.{L}.*`: a decoder layer, enorm, hnorm, eh_proj, shared_head.norm; config
    num_nextn_predict_layers 1), its values random, so that only a carried copy equals them."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    sd = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(37)
    last = f"model.layers.{L - 1}."
    mtp = {f"model.layers.{L}." + k[len(last) :]: v.clone() for k, v in sd.items() if k.startswith(last)}
    mtp.update(
        {f"model.layers.{L}.{n}.weight": torch.empty(H) for n in ("enorm", "hnorm", "shared_head.norm")}
    )
    mtp[f"model.layers.{L}.eh_proj.weight"] = torch.empty(H, 2 * H)
    for t in mtp.values():
        t.copy_(torch.randn(t.shape, generator=g))
    save_file({**sd, **{k: v.contiguous() for k, v in mtp.items()}}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=2))
    return dst


def _with_released_dtypes(src: Path, dst: Path) -> Path:
    """A copy of tiny model `src` in a released checkpoint's dtypes: every tensor bf16 but the routers'
    `e_score_correction_bias`, fp32 with 8 distinct values per layer that bf16 rounds to 3 (1 + 0.002 k:
    bf16's step above 1 is 2^-7)."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(43)
    for k, t in sd.items():
        if k.endswith("e_score_correction_bias"):
            sd[k] = 1.0 + 0.002 * torch.randperm(t.numel(), generator=g).float()
        else:
            sd[k] = t.to(torch.bfloat16)
    save_file(sd, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}, indent=2))
    return dst


def _as_released_mxfp4(src: Path, dst: Path) -> Path:
    """A copy of the tiny gpt-oss as OpenAI released gpt-oss: a bf16 body, the stacked expert weights as
    MXFP4 `_blocks` / `_scales` (its random weights quantised) and `quantization_config` mxfp4."""
    from megagrpo.bridge.mxfp4 import QUANTIZATION_CONFIG, quantize_mxfp4

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    out = {}
    for k, t in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = quantize_mxfp4(t)
        else:
            out[k] = t.to(torch.bfloat16)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(torch_dtype="bfloat16", quantization_config=QUANTIZATION_CONFIG)
    cfg.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_logits_match_transformers(converted, name):
    _, _, _, results = converted
    assert results[name]["logits_err"] <= 1e-4, results[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_bit_identical(converted, name):
    out, dirs, _, _ = converted
    ckpt = out / f"ckpt_{name}"
    assert {"metadata.json", ".metadata", "config.json", "tokenizer.json", "megagrpo_checkpoint.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    ref = load_file(str(Path(dirs[name]) / "model.safetensors"))
    got = _load_dir(out / f"hf_{name}")
    assert set(got) == set(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    index = json.loads((out / f"hf_{name}" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ref)


def test_mtp_layers_are_carried_unchanged(converted):
    out, dirs, _, _ = converted
    src = load_file(str(Path(dirs[WITH_MTP]) / "model.safetensors"))
    mtp = {k for k in src if k.startswith("model.layers.2.")}
    assert len(mtp) > 20  # a whole decoder layer, with its experts, and the MTP head's own tensors
    assert sorted(p.name for p in (out / f"ckpt_{WITH_MTP}").glob("mtp-*")) == ["mtp-00001.safetensors"]
    for name in (f"hf_{WITH_MTP}", "hf_mtp_from"):
        got = _load_dir(out / name)
        assert mtp <= set(got) and all(torch.equal(got[k], src[k]) for k in mtp), name
        assert json.loads((out / name / "config.json").read_text())["num_nextn_predict_layers"] == 1
    bare = _load_dir(out / "hf_mtp_bare")
    assert not mtp & set(bare) and set(bare) == set(src) - mtp
    assert json.loads((out / "hf_mtp_bare" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_released_mxfp4_converts_and_exports_back_exactly(converted):
    """gpt-oss's MXFP4 experts read dequantised (exact) convert to megatron and export back bit for bit:
    with --mxfp4 as the same blocks and scales, without it as their bf16 values, which is what transformers'
    own dequantisation gives; the bf16 export's config carries no quantization_config."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    out, dirs, _, _ = converted
    src = load_file(str(Path(dirs[MXFP4]) / "model.safetensors"))
    same = _load_dir(out / f"hf_{MXFP4}_out")
    assert set(same) == set(src) and all(torch.equal(same[k], src[k]) for k in src)
    cfg = json.loads((out / f"hf_{MXFP4}_out" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    plain = _load_dir(out / f"hf_{MXFP4}")
    for k, t in src.items():
        if k.endswith("_blocks"):
            name = k.removesuffix("_blocks")
            want = _convert_moe_packed_tensors(t, src[name + "_scales"], dtype=torch.bfloat16)
            assert plain[name].dtype == torch.bfloat16 and torch.equal(plain[name], want), name
        elif not k.endswith("_scales"):
            assert torch.equal(plain[k], t), k
    assert "quantization_config" not in json.loads((out / f"hf_{MXFP4}" / "config.json").read_text())


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_exported_directory_loads_in_transformers(converted, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, refs, _ = converted
    d = out / f"hf_{name}"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(model(refs["ids"]).logits, refs[name])
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == model.config.eos_token_id


def test_learner_checkpoint_interop(converted):
    out, dirs, _, results = converted
    assert results["learner_load_logits_err"] <= 1e-4
    ref = load_file(str(Path(dirs["qwen3_moe"]) / "model.safetensors"))
    got = _load_dir(out / "hf_from_learner")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_dtype_option(converted):
    out, dirs, _, _ = converted
    assert json.loads((out / "ckpt_bf16" / "megagrpo_checkpoint.json").read_text())["dtype"] == "bfloat16"
    ref = load_file(str(Path(dirs["qwen3_moe"]) / "model.safetensors"))
    got = _load_dir(out / "hf_bf16")
    assert set(got) == set(ref)
    for k, t in ref.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], t.to(torch.bfloat16)), k
    assert json.loads((out / "hf_bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("tag", ["default", "bf16"])
def test_released_mixed_dtypes_keep_the_fp32_bias(converted, tag):
    """A bf16 body with an fp32 correction bias converts (the body's dtype unless --dtype says otherwise),
    the bias stays fp32 in the megatron checkpoint and in the export, all 8 distinct values, so every
    expert choice is the source's (bf16 rounding would leave 3 values and change choices)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megagrpo.moe.group_topk import group_limited_topk

    out, dirs, _, results = converted
    assert results[f"mixed_{tag}"] == "bfloat16"
    md = FileSystemReader(str(out / f"ckpt_mixed_{tag}")).read_metadata().state_dict_metadata
    stored = {k: str(v.properties.dtype) for k, v in md.items() if k.endswith("router.expert_bias")}
    assert stored and set(stored.values()) == {"torch.float32"}, stored
    src, got = load_file(str(Path(dirs[MIXED]) / "model.safetensors")), _load_dir(out / f"hf_mixed_{tag}")
    assert set(got) == set(src)
    biases = [k for k in src if k.endswith("e_score_correction_bias")]
    assert biases
    for k, t in src.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    cfg = json.loads((Path(dirs[MIXED]) / "config.json").read_text())
    scores = (
        torch.rand(4096, cfg["n_routed_experts"], generator=torch.Generator().manual_seed(0)) * 0.02 + 0.5
    )

    def choices(bias: torch.Tensor) -> torch.Tensor:
        idx = group_limited_topk(
            scores + bias, cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
        )[1]
        return idx.sort(-1).values

    for k in biases:
        assert got[k].unique().numel() == 8 and torch.equal(choices(got[k]), choices(src[k]))
        rounded = src[k].to(torch.bfloat16).float()
        assert (
            rounded.unique().numel() <= 3
        )  # what the old --dtype bfloat16 wrote, which the test tells apart
        assert (choices(rounded) != choices(src[k])).any(-1).float().mean() > 0.01


# -- bad input: each fails naming the file/key and leaves no output directory --------------------------


def _no_output(parent: Path) -> None:
    assert [p.name for p in parent.iterdir() if p.name.startswith(("out", ".out"))] == []


def test_hf_to_megatron_missing_shard(tiny_model, tmp_path):
    from megagrpo.convert.hf_to_megatron import main

    src = shutil.copytree(tiny_model("qwen3"), tmp_path / "m")
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(MegagrpoError, match="model-00002-of-00002.safetensors"):
        from megagrpo.convert.hf_to_megatron import convert

        convert(src, tmp_path / "out", progress=False)
    assert main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    _no_output(tmp_path)


def test_hf_to_megatron_bad_shape_and_model_type(tiny_model, tmp_path):
    from megagrpo.convert.hf_to_megatron import convert

    src = shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 32}))
    with pytest.raises(MegagrpoError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight"):
        convert(src, tmp_path / "out", progress=False)
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3"}))
    with pytest.raises(MegagrpoError, match="model_type='phi3'"):
        convert(src, tmp_path / "out", progress=False)
    _no_output(tmp_path)


def test_megatron_to_hf_refuses_foreign_directory(tiny_model, tmp_path):
    from megagrpo.convert.megatron_to_hf import export, main

    with pytest.raises(MegagrpoError, match="not a megagrpo checkpoint"):
        export(tiny_model("qwen3"), tmp_path / "out")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "metadata.json").write_text("{}")
    with pytest.raises(MegagrpoError, match="fake"):
        export(fake, tmp_path / "out")
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    _no_output(tmp_path)
