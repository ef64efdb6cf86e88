"""An engine start imports only the SGLang model module that serves the checkpoint (rollout/engines/startup.py)."""

from __future__ import annotations

import json
import os

import pytest

from megagrpo.rollout import RolloutConfig
from megagrpo.rollout.engines import startup
from megagrpo.rollout.engines.engine import RolloutEngine
from megagrpo.rollout.engines.startup import (
    DISABLED_ARCHS_ENV,
    only_the_served_model_imported,
    skipped_model_modules,
)

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


# -- issue 43: the config fields SGLang reads, and a scheduler's cause of death --------------------------


def transformers_saved_deepseek_v3(where):
    """A tiny DeepSeek-V3 config.json as transformers' own DeepseekV3Config writes it."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8,
    ).save_pretrained(where)  # fmt: skip
    return where


def test_the_router_fields_sglang_reads_are_filled_where_the_config_lacks_them(tmp_path):
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.rollout.engines.startup import sglang_config_fill

    d = transformers_saved_deepseek_v3(tmp_path / "v3")
    saved = json.loads((d / "config.json").read_text())
    assert not {"topk_method", "scoring_func", "moe_layer_freq"} & saved.keys()  # SGLang's AttributeError
    fill = sglang_config_fill(d)
    assert fill == {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    kw = RolloutEngine(RolloutConfig(str(d))).engine_kwargs()
    assert json.loads(kw["json_model_override_args"]) == fill
    # the learner reads the same model from either config: the values are what transformers computes with
    filled = tmp_path / "filled"
    filled.mkdir()
    (filled / "config.json").write_text(json.dumps({**saved, **fill}))
    assert arch_from_hf(d) == arch_from_hf(filled)
    # what the checkpoint sets is never overridden, and what the user passes wins
    assert sglang_config_fill(filled) == {}
    assert "json_model_override_args" not in RolloutEngine(RolloutConfig(str(filled))).engine_kwargs()
    user = RolloutConfig(str(d), extra_engine_args={"json_model_override_args": '{"moe_layer_freq": 2}'})
    assert json.loads(RolloutEngine(user).engine_kwargs()["json_model_override_args"]) == {
        **fill,
        "moe_layer_freq": 2,
    }
    # Kimi-K2's model_type is DeepSeek-V3's; a family whose SGLang model reads none of them gets nothing
    (filled / "config.json").write_text(json.dumps({**saved, "model_type": "kimi_k2"}))
    assert sglang_config_fill(filled) == fill
    (filled / "config.json").write_text(json.dumps({**saved, "model_type": "glm4_moe"}))
    assert sglang_config_fill(filled) == {}


def test_a_schedulers_cause_of_death_is_left_for_the_engines_error(tmp_path, monkeypatch):
    """`reporting_failure` keeps what SGLang's scheduler logs when it fails (it catches the exception) and
    what escapes it; `failure_cause` reads the exception and the frame that raised it."""
    import logging

    from megagrpo.rollout.engines.startup import (
        FAILURE_DIR_ENV,
        SCHEDULER_FAILED,
        failure_cause,
        reporting_failure,
    )

    def scheduler_that_fails():  # SGLang's run_scheduler_process: logs the traceback, then returns
        try:
            raise ValueError("Unsupported activation: relu")
        except ValueError:
            import traceback

            logging.getLogger("sglang.srt.managers.scheduler").error(
                SCHEDULER_FAILED + traceback.format_exc()
            )

    def entry_that_raises():
        raise RuntimeError("no port")

    logger = logging.getLogger("sglang.srt.managers.scheduler")
    handlers = list(logger.handlers)
    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path))
    try:
        assert failure_cause(tmp_path) is None
        reporting_failure(scheduler_that_fails)
        cause = failure_cause(tmp_path)
        assert cause.startswith("ValueError: Unsupported activation: relu (at File ")
        assert "test_engine_startup.py" in cause and "scheduler_that_fails" in cause
        for p in tmp_path.glob("*.failure"):
            p.unlink()
        with pytest.raises(RuntimeError):
            reporting_failure(entry_that_raises)
        assert failure_cause(tmp_path).startswith("RuntimeError: no port (at File ")
    finally:
        logger.handlers[:] = handlers
