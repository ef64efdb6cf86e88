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
from safetensors.torch import load_file

from megagrpo.compat import APPLIED
from megagrpo.errors import MegagrpoError
from tests.dist._harness import launch

if not APPLIED:
    from transformers import AutoModelForCausalLM  # noqa: F401  (before any CPU patch, see tests/dist)

MODELS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen3_moe": dict(arch="qwen3_moe", experts=8, topk=2),
    "mixtral": dict(arch="mixtral", experts=8, topk=2),
}
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
    refs: dict[str, torch.Tensor] = {"ids": fixed_batch()}
    for name, d in dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            refs[name] = hf(refs["ids"]).logits
    torch.save(refs, out / "refs.pt")
    launch(
        "tests.integration.test_convert:worker", 1, out, timeout=900, models=dirs, refs=str(out / "refs.pt")
    )
    return out, dirs, refs, json.loads((out / "results.json").read_text())


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


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2"])
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
