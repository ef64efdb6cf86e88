"""Kimi-K2 as published (`model_type: kimi_k2`, its own configuration and tiktoken tokenizer modules):
accepted as deepseek_v3, refused before anything starts unless model.trust_remote_code allows its Python,
that option reaching every tokenizer load and SGLang, and an export that looks like (and loads as) the
original. The model is a tiny deepseek_v3 dressed as Kimi-K2 (tests/fixtures/kimi.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from megagrpo.bridge.hf_config import arch_from_hf, exported_config
from megagrpo.bridge.hf_io import HFCheckpoint, copy_side_files
from megagrpo.config import config_from_dict
from megagrpo.errors import MegagrpoError
from tests.fixtures.kimi import CONFIG_AUTO_MAP, REMOTE_FILES, TOKENIZER_AUTO_MAP, kimi_shaped


@pytest.fixture
def kimi(tiny_model, tmp_path) -> Path:
    return kimi_shaped(tiny_model("deepseek_v3", layers=2), tmp_path / "Kimi-K2")


def test_export_round_trip_keeps_kimi_k2_and_carries_its_code(kimi, tmp_path):
    # what `convert hf-to-megatron` keeps beside the checkpoint, then what the export (`convert
    # megatron-to-hf`, the trainer's `save_hf`) writes from there: the same two calls they make
    arch = arch_from_hf(kimi)
    assert arch.family == "deepseek_v3"
    ckpt, out = tmp_path / "megatron", tmp_path / "export"
    ckpt.mkdir()
    out.mkdir()
    (ckpt / "config.json").write_text((kimi / "config.json").read_text())
    copy_side_files(kimi, ckpt)
    copied = copy_side_files(ckpt, out)
    cfg = exported_config(arch, ckpt, dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy2(kimi / "model.safetensors", out / "model.safetensors")

    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["auto_map"] == CONFIG_AUTO_MAP
    assert {"tiktoken.model", "tokenizer_config.json", *REMOTE_FILES} <= set(copied)
    for name in ("tiktoken.model", *REMOTE_FILES):  # modeling_deepseek.py is named but not shipped
        assert (out / name).read_bytes() == (kimi / name).read_bytes(), name
    assert not (out / "modeling_deepseek.py").exists()
    assert json.loads((out / "tokenizer_config.json").read_text())["auto_map"] == TOKENIZER_AUTO_MAP
    assert HFCheckpoint(out).arch == arch  # the tensors still match the config

    # it loads wherever the original did: with the checkpoint's own classes
    from transformers import AutoConfig, AutoTokenizer

    assert type(AutoConfig.from_pretrained(out, trust_remote_code=True)).__module__.endswith(
        "configuration_deepseek"
    )
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok.remote_mark == "kimi"  # from kimi_tiktoken.py, imported by tokenization_kimi.py
    assert (
        tok("hello").input_ids
        == AutoTokenizer.from_pretrained(kimi, trust_remote_code=True)("hello").input_ids
    )


def test_export_of_a_plain_deepseek_v3_is_unchanged(tiny_model):
    d = tiny_model("deepseek_v3", layers=2)
    cfg = exported_config(arch_from_hf(d), d)
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]


# -- preflight ------------------------------------------------------------------------------------------


def write_config(tmp_path: Path, model: Path, **model_fields) -> Path:
    tree = {"model": {"hf_path": str(model), **model_fields}, "checkpoint": {"dir": str(tmp_path / "c")}}
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


def test_preflight_refuses_the_checkpoints_code_without_trust_remote_code(
    kimi, tmp_path, capsys, monkeypatch
):
    from megagrpo.cli import main

    started: list[str] = []
    monkeypatch.setattr("megagrpo.trainer.entry.run", lambda mode, cfg, **kw: started.append(mode) or 0)
    assert main(["train", str(write_config(tmp_path, kimi))]) == 2 and not started
    err = capsys.readouterr().err
    assert f"model.hf_path={str(kimi)!r}" in err
    assert f"{kimi / 'config.json'} (auto_map configuration_deepseek.DeepseekV3Config)" in err
    assert f"{kimi / 'tokenizer_config.json'} (auto_map tokenization_kimi.TikTokenTokenizer)" in err
    assert "model.trust_remote_code=true" in err and "Traceback" not in err


def test_preflight_passes_with_trust_remote_code_or_without_remote_code(kimi, tiny_model):
    from megagrpo.trainer.preflight import check_remote_code, remote_code_needed

    check_remote_code(config_from_dict({"model": {"hf_path": str(kimi), "trust_remote_code": True}}), "train")
    assert remote_code_needed(tiny_model("deepseek_v3", layers=2)) == []
    # transformers knows deepseek_v3: an auto_map beside it is not needed, only the tokenizer's is
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2_sed", "auto_map": {}}))
    with pytest.raises(MegagrpoError, match="unknown to transformers and the file has no auto_map"):
        remote_code_needed(kimi)
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert remote_code_needed(kimi) == [
        f"{kimi / 'tokenizer_config.json'} (auto_map tokenization_kimi.TikTokenTokenizer)"
    ]


# -- the option reaches every load ----------------------------------------------------------------------


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_the_tokenizer_loads_and_sglang(kimi, trust):
    from megagrpo.rollout.engines.engine import RolloutEngine
    from megagrpo.rollout.engines.remote import RemoteEngine
    from megagrpo.trainer.components import load_tokenizer, rollout_config

    cfg = config_from_dict({"model": {"hf_path": str(kimi), "trust_remote_code": trust}})
    rc = rollout_config(cfg, str(kimi))
    engine = RolloutEngine(rc)
    for on_cpu in (True, False):  # the in-process engine's kwargs, which the remote server's ServerArgs reuse
        engine.on_cpu = on_cpu
        assert engine.engine_kwargs()["trust_remote_code"] is trust

    class Answering(RemoteEngine):  # the server's answers to what start() asks
        def get(self, path):
            return {"/server_info": {}, "/v1/models": {"data": [{"max_model_len": 64}]}}[path]

    remote = Answering(rc, index=0, url="http://h:1", where="here", timeout_s=1)
    if not trust:
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            load_tokenizer(cfg, str(kimi))
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            remote.start()
        return
    assert load_tokenizer(cfg, str(kimi)).remote_mark == "kimi"
    remote.start()
    try:
        assert remote.tokenizer.remote_mark == "kimi"
    finally:
        remote.shutdown()


def test_the_remote_servers_arguments_carry_it(kimi):
    from megagrpo.rollout.engines.server import server_args
    from megagrpo.trainer.components import rollout_config

    cfg = config_from_dict({"model": {"hf_path": str(kimi), "trust_remote_code": True}})
    sa = server_args(rollout_config(cfg, str(kimi)), host="127.0.0.1", port=1, key="k")
    assert sa.trust_remote_code is True
