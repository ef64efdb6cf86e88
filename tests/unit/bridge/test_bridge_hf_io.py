"""HF checkpoint reading/writing: validation up front, errors that name the file/key, atomic output."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megagrpo.bridge.hf_io import HFCheckpoint, atomic_output_dir, write_hf_checkpoint
from megagrpo.bridge.maps import hf_names
from megagrpo.errors import MegagrpoError


def _sharded_copy(src, dst):
    """The tiny model re-saved as two shards with an index (the layout of real hub checkpoints)."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for f, ns in files.items():
        save_file({n: sd[n] for n in ns}, str(dst / f))
        weight_map.update({n: f for n in ns})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst, files


def test_sharded_checkpoint_reads(tiny_model, tmp_path):
    d, _ = _sharded_copy(tiny_model("qwen3_moe"), tmp_path / "m")
    ck = HFCheckpoint(d)
    ref = load_file(str(tiny_model("qwen3_moe") / "model.safetensors"))
    for name in ("model.layers.1.mlp.experts.7.down_proj.weight", "lm_head.weight"):
        assert torch.equal(ck.get(name), ref[name])


def test_missing_shard_file_named(tiny_model, tmp_path):
    d, files = _sharded_copy(tiny_model("qwen3"), tmp_path / "m")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MegagrpoError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(d)


def test_shape_disagreeing_with_config_named(tiny_model, tmp_path):
    d = shutil.copytree(tiny_model("mixtral"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MegagrpoError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight"):
        HFCheckpoint(d)


def test_missing_and_extra_tensors_named(tiny_model, tmp_path):
    d = shutil.copytree(tiny_model("qwen2"), tmp_path / "m")
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("model.layers.1.self_attn.k_proj.bias")
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(MegagrpoError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        HFCheckpoint(d)
    sd = load_file(str(tiny_model("qwen2") / "model.safetensors"))
    sd["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(MegagrpoError, match="mystery"):
        HFCheckpoint(d)


def test_unsupported_model_type_named(tiny_model, tmp_path):
    d = shutil.copytree(tiny_model("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gemma3_text"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MegagrpoError, match="model_type='gemma3_text'"):
        HFCheckpoint(d)


def test_atomic_output_dir_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), atomic_output_dir(out) as tmp:
        (tmp / "half.safetensors").write_bytes(b"x")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    (out / "keep").mkdir(parents=True)
    with pytest.raises(MegagrpoError, match="not empty"), atomic_output_dir(out):
        pass
    assert (out / "keep").is_dir()


def test_write_hf_checkpoint_shards_and_index(tiny_model, tmp_path):
    from megagrpo.bridge.hf_config import arch_from_hf

    src = tiny_model("qwen3")
    sd = load_file(str(src / "model.safetensors"))
    names = sorted(sd)
    buckets = [[(n, sd[n]) for n in names[i : i + 7]] for i in range(0, len(names), 7)]
    with atomic_output_dir(tmp_path / "out") as tmp:
        wm = write_hf_checkpoint(tmp, iter(buckets), expected_names=hf_names(arch_from_hf(src)))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == wm and len(set(wm.values())) == len(buckets)
    got = {}
    for f in set(wm.values()):
        got.update(load_file(str(tmp_path / "out" / f)))
    assert set(got) == set(sd) and all(torch.equal(got[n], sd[n]) for n in sd)


def _truncate(path, keep=0.9):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


TRUNCATED = r"not a complete safetensors file .*truncated or corrupt: re-download the model, or re-run"


def test_truncated_safetensors_named_with_the_fix_everywhere(tiny_model, tmp_path, capsys):
    """Learner load and conversion (HFCheckpoint), weight sync's shape read and the probe all say it."""
    from megagrpo.cli import main as cli_main
    from megagrpo.probe import hf_weights
    from megagrpo.sync import checkpoint_shapes

    d = shutil.copytree(tiny_model("qwen3"), tmp_path / "m")
    f = d / "model.safetensors"
    _truncate(f)
    for read in (HFCheckpoint, checkpoint_shapes, hf_weights):
        with pytest.raises(MegagrpoError, match=f"{re.escape(str(f))}: {TRUNCATED}"):
            read(d)
    f.write_bytes(f.read_bytes()[:5])  # not even a header length
    with pytest.raises(MegagrpoError, match=f"{re.escape(str(f))}: {TRUNCATED}"):
        HFCheckpoint(d)
    assert cli_main(["convert", "hf-to-megatron", str(d), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{f}: not a complete safetensors file" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_truncated_shard_named(tiny_model, tmp_path):
    from megagrpo.sync import checkpoint_shapes

    d, _ = _sharded_copy(tiny_model("qwen3_moe"), tmp_path / "m")
    shard = d / "model-00002-of-00002.safetensors"
    _truncate(shard)
    for read in (HFCheckpoint, checkpoint_shapes):
        with pytest.raises(MegagrpoError, match=f"{re.escape(str(shard))}: {TRUNCATED}"):
            read(d)


def _with_mtp(tiny_model, d):
    """The tiny deepseek_v3 model with a few tensors of one multi-token-prediction layer (of two dtypes)."""
    d = shutil.copytree(tiny_model("deepseek_v3"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    sd = load_file(str(d / "model.safetensors"))
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    mtp = {
        f"model.layers.{L}.eh_proj.weight": torch.randn(H, 2 * H, dtype=torch.bfloat16),
        f"model.layers.{L}.enorm.weight": torch.randn(H),
        f"model.layers.{L}.mlp.gate.e_score_correction_bias": torch.randn(cfg["n_routed_experts"]),
    }
    save_file({**sd, **mtp}, str(d / "model.safetensors"))
    return d, cfg, mtp


def test_export_takes_mtp_tensors_only_from_the_same_model(tiny_model, tmp_path):
    from megagrpo.convert.megatron_to_hf import _mtp_source

    d, _, mtp = _with_mtp(tiny_model, tmp_path / "m")
    arch = HFCheckpoint(d).arch
    names, buckets = _mtp_source(tmp_path, arch, d, shard_bytes=1 << 20)
    assert sorted(names) == sorted(mtp) == sorted(n for b in buckets for n, _ in b)
    assert _mtp_source(tmp_path, arch, None, 1 << 20)[0] == []  # nothing stored beside this "checkpoint"
    other = dataclasses.replace(arch, num_layers=arch.num_layers + 1)
    with pytest.raises(MegagrpoError, match=r"--mtp-from .*num_nextn_predict_layers=1"):
        _mtp_source(tmp_path, other, d, 1 << 20)


def test_mtp_tensors_are_copied_bit_for_bit_in_shards(tiny_model, tmp_path):
    # issue 37: a checkpoint with num_nextn_predict_layers carries `model.layers.{L}.*` beside the main
    # model; the converter stores them unchanged (`write_mtp`) for the export to write back (`mtp_buckets`)
    from megagrpo.bridge.hf_io import mtp_buckets

    d, cfg, mtp = _with_mtp(tiny_model, tmp_path / "m")
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    ck = HFCheckpoint(d)  # the MTP tensors are neither missing nor "extra"
    assert sorted(ck.mtp_names()) == sorted(mtp)
    out = tmp_path / "out"
    out.mkdir()
    assert sorted(ck.write_mtp(out, shard_bytes=H * H)) == sorted(mtp)
    assert len(list(out.glob("mtp-*.safetensors"))) == 2  # eh_proj alone fills a shard
    names, buckets = mtp_buckets(out)
    got = dict(t for b in buckets for t in b)
    assert sorted(names) == sorted(got) == sorted(mtp)
    for k, t in mtp.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    # without num_nextn_predict_layers the same tensors are foreign to the model
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MegagrpoError, match=f"model.layers.{L}"):
        HFCheckpoint(d)
