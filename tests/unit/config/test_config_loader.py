"""YAML + dotted overrides, and the error messages of issue 9's bad-config list."""

from __future__ import annotations

import pytest

from megagrpo.config import apply_override, dump_config, load_config
from megagrpo.errors import MegagrpoError


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_yaml_and_overrides_parse_as_yaml_scalars(tmp_path):
    p = write(tmp_path, f"model: {{hf_path: {model_dir(tmp_path)}}}\noptimizer: {{lr: 1e-6}}\n")
    cfg = load_config(
        p,
        [
            "algo.clip_high=0.28",
            "algo.tis.enabled=true",
            "algo.tis.cap=auto",
            "rollout.stop=['</answer>', \"\\n\\n\"]",  # YAML double quotes process escapes
            "algo.clip_ratio_c=null",
            "rewards.functions=[{name: format, weight: 0.5}]",
            "rewards.functions.0.timeout_s=2",
            "sft.data.synthetic.task=countdown",
        ],
    )
    assert cfg.optimizer.lr == 1e-6  # YAML 1.1 alone would read "1e-6" as a string
    assert cfg.algo.clip_high == 0.28 and cfg.algo.tis.enabled and cfg.algo.tis.cap == "auto"
    assert cfg.rollout.stop == ["</answer>", "\n\n"] and cfg.algo.clip_ratio_c is None
    assert cfg.rewards.functions[0].name == "format" and cfg.rewards.functions[0].timeout_s == 2.0
    assert cfg.sft.data.synthetic.task == "countdown"


def test_dump_round_trips(tmp_path):
    p = write(tmp_path, "model: {hf_path: m}\nalgo: {variant: gspo}\n")
    cfg = load_config(p, check_paths=False)
    again = write(tmp_path, dump_config(cfg))
    assert load_config(again, check_paths=False) == cfg


# --- issue 9's bad configs: each message names the field, the bad value and what is allowed -----------


def error(tmp_path, text: str, overrides=(), **kw) -> str:
    with pytest.raises(MegagrpoError) as e:
        load_config(write(tmp_path, text), list(overrides), **kw)
    return str(e.value)


def test_unknown_key_suggests_close_matches(tmp_path):
    msg = error(tmp_path, "model: {hf_path: m}\nalgo: {clip_hihg: 0.3}\n", check_paths=False)
    assert "algo.clip_hihg: unknown key; did you mean 'clip_high'" in msg
    msg = error(tmp_path, "model: {hf_path: m}\nrolout: {group_size: 4}\n", check_paths=False)
    assert "rolout: unknown key; did you mean 'rollout'?" in msg
    msg = error(tmp_path, "model: {hf_path: m}\n", ["rollout.groupsize=4"], check_paths=False)
    assert "rollout.groupsize: unknown key; did you mean 'group_size'?" in msg


def test_wrong_type_names_value_and_expected_type(tmp_path):
    msg = error(tmp_path, "model: {hf_path: m}\nschedule: {steps: ten}\n", check_paths=False)
    assert "schedule.steps: 'ten' is not an integer" in msg
    msg = error(tmp_path, "model: {hf_path: m}\nrollout: {group_size: '8'}\n", check_paths=False)
    assert "rollout.group_size: '8' is not an integer" in msg  # strict: no silent str -> int
    msg = error(tmp_path, "model: {hf_path: m}\nalgo: {tis: {cap: big}}\n", check_paths=False)
    assert "algo.tis.cap: 'big' is not a number or 'auto'" in msg
    msg = error(tmp_path, "model: {hf_path: m}\nalgo: 3\n", check_paths=False)
    assert "algo: 3 is not a section" in msg


def test_impossible_mesh_is_caught_by_check_mesh(tmp_path):
    from megagrpo.config import check_mesh

    cfg = load_config(write(tmp_path, "model: {hf_path: m}\nmesh: {tp: 2, pp: 2}\n"), check_paths=False)
    with pytest.raises(
        MegagrpoError, match=r"mesh: tp\*pp\*cp = 2\*2\*1 = 4 does not divide the world size 6"
    ):
        check_mesh(cfg, 6)


def test_missing_model_path_is_named(tmp_path):
    msg = error(tmp_path, "model: {hf_path: /nonexistent/model}\n")
    assert msg.startswith("model.hf_path: '/nonexistent/model' does not exist")
    msg = error(tmp_path, "algo: {variant: gspo}\n", check_paths=False)
    assert "model.hf_path: required but missing" in msg
    no_cfg = tmp_path / "empty_model"
    no_cfg.mkdir()
    assert "has no config.json" in error(tmp_path, f"model: {{hf_path: {no_cfg}}}\n")


def test_sft_stage_checks_its_own_base_path(tmp_path):
    md = model_dir(tmp_path)
    text = f"model: {{hf_path: {tmp_path}/not_yet}}\nsft: {{base_path: {md}, steps: 5}}\n"
    assert load_config(write(tmp_path, text), stage="sft").sft.steps == 5
    assert "model.hf_path" in error(tmp_path, text, stage="train")
    msg = error(tmp_path, f"model: {{hf_path: {md}}}\ndata: {{train_path: /no/such.jsonl}}\n")
    assert "data.train_path: '/no/such.jsonl' does not exist" in msg


def test_group_size_below_two_and_unknown_variant(tmp_path):
    msg = error(tmp_path, "model: {hf_path: m}\nrollout: {group_size: 1}\n", check_paths=False)
    assert "rollout.group_size: 1 is below 2" in msg
    msg = error(tmp_path, "model: {hf_path: m}\n", ["algo.variant=ppo"], check_paths=False)
    assert "algo.variant: 'ppo' is not one of grpo, gspo" in msg


def test_several_errors_are_reported_together(tmp_path):
    msg = error(tmp_path, "model: {hf_path: m}\nalgo: {variant: ppo, agg: mean}\n", check_paths=False)
    assert "algo.variant:" in msg and "algo.agg: 'mean' is not one of token-mean" in msg


def test_yaml_problems(tmp_path):
    assert "c.yaml:3:1: invalid YAML" in error(tmp_path, "model: {hf_path: m}\nalgo: [unclosed\n")
    assert "duplicate key 'algo'" in error(tmp_path, "model: {hf_path: m}\nalgo: {}\nalgo: {}\n")
    assert "must be a mapping" in error(tmp_path, "- a\n- b\n")
    with pytest.raises(MegagrpoError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_malformed_overrides():
    with pytest.raises(MegagrpoError, match="expected dotted.key=value"):
        apply_override({}, "algo.clip_high")
    with pytest.raises(MegagrpoError, match="write algo.clip_ratio_c=null"):
        apply_override({}, "algo.clip_ratio_c=")
    with pytest.raises(MegagrpoError, match="not an index"):
        apply_override({"rewards": {"functions": [{}]}}, "rewards.functions.3.weight=1")
    with pytest.raises(MegagrpoError, match="not a section"):
        apply_override({"replay": "R3"}, "replay.mode=x")
