"""The family mode of tools/bench_logprobs.py and tools/bench_step.py (tools/bench_families.py): parameter counts
from safetensors headers, the size check, rotated rounds, per-token ratios, the prefill/decode split."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tools.bench_families import (
    BASELINE,
    FAMILIES,
    check_param_spread,
    param_count,
    per_token_rows,
    rotated_rounds,
)
from tools.bench_logprobs import family_batch
from tools.bench_step import family_prompts, generation_split


def test_param_count_reads_every_tensor_of_every_file(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, tmp_path / "model-1.safetensors")
    save_file({"c": torch.zeros(2, 2, 2)}, tmp_path / "model-2.safetensors", metadata={"format": "pt"})
    assert param_count(tmp_path) == 12 + 5 + 8
    with pytest.raises(FileNotFoundError, match="safetensors"):
        param_count(tmp_path / "missing")


def test_param_spread_names_the_family_out_of_bounds():
    check_param_spread({BASELINE: 1000, "deepseek_v3": 1090, "glm4_moe": 910})
    with pytest.raises(ValueError, match=r"glm4_moe 880 \(-12.0%\)") as e:
        check_param_spread({BASELINE: 1000, "deepseek_v3": 1090, "glm4_moe": 880})
    assert "deepseek_v3" not in str(e.value)
    assert BASELINE in FAMILIES and {"deepseek_v3", "glm4_moe"} <= set(FAMILIES)


def test_rotated_rounds_drop_the_warm_up_and_rotate_the_order():
    calls: list[str] = []

    def run_one(name: str) -> dict[str, float]:
        calls.append(name)
        return {"prefill": float(len(calls)), "generate": 10.0 * len(calls)}

    times = rotated_rounds(["a", "b", "c"], 2, run_one)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # round 0 (calls 1-3) is dropped; each name keeps one figure per measured round, in round order
    assert times["a"] == {"prefill": [6.0, 8.0], "generate": [60.0, 80.0]}
    assert times["b"]["prefill"] == [4.0, 9.0] and times["c"]["prefill"] == [5.0, 7.0]
    with pytest.raises(ValueError, match="rounds=0"):
        rotated_rounds(["a"], 0, run_one)


def test_per_token_ratios_against_the_baseline():
    rows = per_token_rows(
        {BASELINE: 2.0, "deepseek_v3": 6.0, "glm4_moe": 1.5},
        {BASELINE: 1000, "deepseek_v3": 2000, "glm4_moe": 500},
    )
    by = {r["family"]: r for r in rows}
    assert by[BASELINE]["ratio"] == 1.0 and by[BASELINE]["us_per_token"] == pytest.approx(2000.0)
    assert by["deepseek_v3"]["ratio"] == pytest.approx(1.5) and by["deepseek_v3"]["within_goal"]
    assert by["glm4_moe"]["ratio"] == pytest.approx(1.5)
    slow = per_token_rows({BASELINE: 1.0, "deepseek_v3": 1.51}, {BASELINE: 10, "deepseek_v3": 10})
    assert not slow[1]["within_goal"]


def test_generation_split_subtracts_the_first_token():
    assert generation_split(2.0, 5.0, prompts=4, prompt_len=100, new_tokens=31) == (2.0, 400, 3.0, 120)
    with pytest.raises(ValueError, match="new_tokens=1"):
        generation_split(1.0, 1.0, 4, 100, 1)


def test_inputs_are_the_same_for_every_family_and_inside_the_vocab():
    assert family_prompts(3, 7, vocab=50) == family_prompts(3, 7, vocab=50)
    assert all(len(p) == 7 and all(0 <= t < 50 for t in p) for p in family_prompts(3, 7, vocab=50))
    b = family_batch(2, 9, vocab=50)
    assert b["input_ids"].shape == (2, 9) and b["seq_lens"].tolist() == [9, 9]
    assert int(b["input_ids"].max()) < 50 and torch.equal(
        b["input_ids"], family_batch(2, 9, vocab=50)["input_ids"]
    )
