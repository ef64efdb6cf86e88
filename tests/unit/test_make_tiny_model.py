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
