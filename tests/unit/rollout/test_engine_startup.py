"""An engine start imports only the SGLang model module that serves the checkpoint (rollout/startup.py)."""

from __future__ import annotations

import json
import os

import pytest

from megagrpo.rollout import startup
from megagrpo.rollout.startup import DISABLED_ARCHS_ENV, only_the_served_model_imported, skipped_model_modules

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # an alias of deepseek_v3, served by the same module
}


def model_dir(tmp_path, model_type, archs):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": archs}))
    return d


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_module_but_the_familys_own_is_skipped(tmp_path, family):
    skipped = skipped_model_modules(model_dir(tmp_path, family, [FAMILIES[family]]))
    served = startup.MODEL_TYPE_ALIASES.get(family, family)
    module = startup.MODULE_OF_MODEL_TYPE.get(served, served)
    on_disk = {p.stem for p in startup._models_dir().glob("*.py") if p.stem != "__init__"}
    assert module not in skipped and "registry" not in skipped
    assert set(skipped) == on_disk - {module, "registry"}
    # the kept module really defines the class the checkpoint names (what SGLang's registry will look up)
    assert FAMILIES[family] in (startup._models_dir() / f"{module}.py").read_text()


@pytest.mark.parametrize(
    "model_type,archs",
    [
        ("qwen3_moe", ["SomethingElseForCausalLM"]),  # the module does not define the named class
        ("no_such_family", ["NoSuchForCausalLM"]),  # no module of that name
        ("llama", []),  # no architecture named
        ("llama", ["LlamaForCausalLM", "Other"]),  # more than one: SGLang's own choice applies
    ],
)
def test_anything_unrecognised_falls_back_to_sglangs_full_scan(tmp_path, model_type, archs):
    assert skipped_model_modules(model_dir(tmp_path, model_type, archs)) == []


def test_the_setting_lasts_for_the_start_only_and_a_users_own_value_wins(tmp_path, monkeypatch):
    d = model_dir(tmp_path, "qwen3_moe", [FAMILIES["qwen3_moe"]])
    monkeypatch.delenv(DISABLED_ARCHS_ENV, raising=False)
    with only_the_served_model_imported(d):
        assert set(os.environ[DISABLED_ARCHS_ENV].split(",")) == set(skipped_model_modules(d))
    assert DISABLED_ARCHS_ENV not in os.environ
    monkeypatch.setenv(DISABLED_ARCHS_ENV, "grok")
    with only_the_served_model_imported(d):
        assert os.environ[DISABLED_ARCHS_ENV] == "grok"
    assert os.environ[DISABLED_ARCHS_ENV] == "grok"
