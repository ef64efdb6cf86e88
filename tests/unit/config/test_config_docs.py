"""docs/config.md and configs/reference.yaml are generated from the schema and must be current."""

from __future__ import annotations

from pathlib import Path

from megagrpo.config import Config, load_config
from megagrpo.config import docs as gen

REPO = Path(__file__).resolve().parents[3]
DOC_PATH = REPO / "docs" / "config.md"
REFERENCE_PATH = REPO / "configs" / "reference.yaml"


def test_docs_are_up_to_date_with_the_schema():
    assert DOC_PATH.read_text() == gen.render_markdown(), "run: python tools/gen_config_docs.py"
    assert REFERENCE_PATH.read_text() == gen.render_reference_yaml(), "run: python tools/gen_config_docs.py"


def test_docs_list_every_field():
    doc = gen.render_markdown()
    for path, _, section, _ in gen._fields(Config):
        top_section = "." not in path and section is not None  # a heading, not a row
        assert (f"## `{path}`" if top_section else f"| `{path}` |") in doc, path


def test_reference_config_is_the_defaults():
    ref = load_config(REFERENCE_PATH, check_paths=False)
    assert ref == Config.model_validate({"model": {"hf_path": gen.PLACEHOLDER_MODEL}})


def test_shipped_configs_validate():
    shipped = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "reference")
    for name in shipped:
        cfg = load_config(REPO / "configs" / f"{name}.yaml", check_paths=False)
        assert cfg.model.hf_path
    agentic = load_config(REPO / "configs" / "agentic_python_qwen3_moe.yaml", check_paths=False)
    mt = agentic.rollout.multi_turn
    assert mt.enabled and mt.environment == "python" and agentic.replay == "R3"
    assert agentic.rollout.response_tokens == mt.max_tokens  # the row, the plan and the KV size use it
    demo = load_config(REPO / "configs" / "demo_qwen3_moe.yaml", check_paths=False)
    assert demo.algo.variant == "gspo" and demo.replay == "R3" and demo.algo.tis.cap == "auto"
    sft, rl = demo.sft.data.synthetic, demo.data.synthetic  # RL on harder problems than SFT taught
    assert sft.min_digits <= rl.min_digits and sft.max_digits <= rl.max_digits
    assert (sft.min_digits, sft.max_digits) != (rl.min_digits, rl.max_digits)
