"""The pure parts of tools/bench_disagg_sync.py: the parameter count of a Qwen3-MoE config against
transformers' own model, the per-rank traffic arithmetic, the line fit, the breakdown of a sync and the
engine timers' file format; the clocked transport that `sync_remote` is given."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tools.bench_disagg_sync import (
    _TimedTransport,
    breakdown,
    broadcast_traffic,
    fit_line,
    qwen3_moe_params,
    read_engine_seconds,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tie_word_embeddings": True},
        {"mlp_only_layers": [1], "attention_bias": True},
        {"decoder_sparse_step": 2},
    ],
)
def test_parameter_count_matches_transformers(extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    hf.update(extra)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **hf), dtype=torch.float32)
    # the checkpoint's tensors: a tied head is one tensor, as save_pretrained writes it
    expected = sum(p.numel() for p in model.parameters())
    assert qwen3_moe_params(hf) == expected


def test_qwen3_30b_a3b_is_61_gb_in_bf16_and_takes_1_2_s_at_400_gbit():
    hf = json.loads((REPO / "configs/models/Qwen3-30B-A3B/config.json").read_text())
    params = qwen3_moe_params(hf)
    assert 30.4e9 < params < 30.6e9  # "30.5B parameters" in the model card
    t = broadcast_traffic(2 * params, engines=2, engine_tp=4, link_gbit_s=400)
    assert t["owner_sends_bytes"] == t["engine_rank_receives_bytes"] == 2 * params
    assert t["rollout_node_receives_bytes"] == 4 * params and t["engine_ranks"] == 8
    assert t["seconds_at_line_rate"] == pytest.approx(2 * params / 50e9)
    assert 1.2 < t["seconds_at_line_rate"] < 1.25


def test_fit_line_recovers_a_line_and_refuses_one_point():
    fixed, per = fit_line([1, 5, 27], [0.3 + 0.01 * b for b in (1, 5, 27)])
    assert fixed == pytest.approx(0.3) and per == pytest.approx(0.01)
    with pytest.raises(ValueError):
        fit_line([4, 4], [1.0, 2.0])


def test_breakdown_adds_up_to_the_sync():
    parts = breakdown(1.0, 0.7, {"receive": 0.3, "load": 0.2, "begin": 0.01, "end": 0.02})
    assert parts["owner_s"] == pytest.approx(0.3)
    assert parts["engine_begin_end_s"] == pytest.approx(0.03)
    assert parts["http_other_s"] == pytest.approx(0.7 - 0.53)
    assert sum(parts.values()) == pytest.approx(1.0)


def test_engine_timers_are_summed_per_kind_and_cleared(tmp_path):
    (tmp_path / "11.txt").write_text("receive 0.25\nload 0.5\n")
    (tmp_path / "12.txt").write_text("receive 0.125\n")
    assert read_engine_seconds(tmp_path) == {"receive": 0.375, "load": 0.5}
    assert read_engine_seconds(tmp_path) == {}


def test_an_overlapped_sync_breaks_down_with_negative_http_and_still_adds_up():
    # the engine's receive and load ran while the owner copied the next bucket: more engine time than waits
    parts = breakdown(1.0, 0.4, {"receive": 0.3, "load": 0.2})
    assert parts["http_other_s"] == pytest.approx(-0.1)
    assert sum(parts.values()) == pytest.approx(1.0)


def test_the_timed_transport_clocks_the_transport_calls_only_and_shares_the_shapes():
    calls = []
    inner = SimpleNamespace(
        remote="r",
        name="engine 0",
        shapes=None,
        begin=lambda: calls.append("begin"),
        send=lambda flat, last: time.sleep(0.05) or calls.append(("send", flat, last)),
        flatten=lambda bucket, cast, fresh=False: time.sleep(0.05) or ("flat", bucket, cast, fresh),
        dropped=lambda: calls.append("dropped"),
        end=lambda: calls.append("end"),
    )
    t = _TimedTransport(inner)
    assert t.shapes is None
    t.shapes = {"w": (2,)}  # what sync_remote does once: the inner transport keeps it for the next rep
    assert inner.shapes == {"w": (2,)} and _TimedTransport(inner).shapes == {"w": (2,)}
    t.begin()
    flat = t.flatten(["b"], "f32", fresh=True)
    assert flat == ("flat", ["b"], "f32", True)
    assert t.seconds < 0.04  # the flattening is the owner's own work, not the transport's
    t.send(flat, True)
    t.dropped()
    t.end()
    assert 0.05 <= t.seconds < 1.0
    assert calls == ["begin", ("send", flat, True), "dropped", "end"]
