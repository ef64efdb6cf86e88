import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megagrpo.tiny_model import ARCHS, make_tiny_model


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_with_transformers(tiny_model, arch):
    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "what is 12 + 34?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 1024)
    assert torch.isfinite(logits).all()
    if arch in ("qwen3_moe", "mixtral"):
        assert model.config.num_experts_per_tok == 2


def test_digits_are_single_tokens(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    assert [t for t in tok.tokenize("9071") if t.strip("Ġ")] == ["9", "0", "7", "1"]


def test_same_seed_same_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "llama", seed=3)
    b = make_tiny_model(tmp_path / "b", "llama", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_bad_arch_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--arch 'gpt2' is not supported"):
        make_tiny_model(tmp_path / "x", "gpt2")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_are_written_as_the_released_checkpoints_ship_them(tiny_model, arch):
    """`mtp_layers`: `num_nextn_predict_layers` in config.json and, after the main layers, a whole MoE
    decoder layer plus the MTP head's own tensors (the names SGLang's NextN loaders read)."""
    import json

    from safetensors.torch import load_file

    from megagrpo.bridge.hf_io import HFCheckpoint

    path = tiny_model(arch, mtp_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 2
    sd = load_file(str(path / "model.safetensors"))
    mtp = {n[len("model.layers.2.") :]: t for n, t in sd.items() if n.startswith("model.layers.2.")}
    for own in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert f"{own}.weight" in mtp, own
    assert mtp["eh_proj.weight"].shape == (64, 128)
    assert "mlp.experts.7.down_proj.weight" in mtp and "mlp.shared_experts.up_proj.weight" in mtp
    assert "self_attn.o_proj.weight" in mtp and "mlp.gate.e_score_correction_bias" in mtp
    ckpt = HFCheckpoint(path)  # the bridge reads it: the main model's map, the MTP layer carried aside
    assert ckpt.arch.mtp_layers == 1 and sorted(ckpt.mtp_names()) == sorted(
        f"model.layers.2.{n}" for n in mtp
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert len(model.model.layers) == 2  # transformers builds the main model only, as the learner does


def test_mtp_layers_need_a_deepseek_v3_shaped_arch(tmp_path):
    with pytest.raises(SystemExit, match="--mtp-layers needs"):
        make_tiny_model(tmp_path / "x", "qwen3_moe", mtp_layers=1)
