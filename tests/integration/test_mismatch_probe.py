"""tools/mismatch_probe.py on the tiny Qwen3-MoE: real SGLang sampling (session engine), the learner on
layouts 1, tp2 and ep2 (one torchrun each), the table (md + json) and the Δlogp plot."""

from __future__ import annotations

import json

import pytest

from megagrpo.errors import MegagrpoError
from tools.mismatch_probe import load_prompts, main, parse_injections, parse_layout, parse_layouts, run_probe

PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202], [44, 45, 46, 47, 48, 49, 50, 51]]


@pytest.fixture(scope="module")
def probe(sglang_engine, sglang_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "out"
    res = run_probe(sglang_engine, sglang_model_dir, PROMPTS, parse_layouts("1,tp2,ep2"), out, group_size=2)
    print((out / "mismatch_table.md").read_text())  # the table, with pytest -s
    return out, res


@pytest.mark.slow
def test_probe_writes_table_and_plot(probe):
    out, res = probe
    on_disk = json.loads((out / "mismatch_table.json").read_text())
    assert on_disk["injections"].keys() == {"none"}
    pairs = on_disk["injections"]["none"]["pairs"]
    names = ["sampler", "1", "tp2", "ep2"]
    assert [(p["a"], p["b"]) for p in pairs] == [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    md = (out / "mismatch_table.md").read_text()
    assert "| sampler | tp2 |" in md and "| tp2 | ep2 |" in md and "routing_share" in md
    png = (out / "dlogp.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (out / "rollouts" / "none.pt").is_file()


@pytest.mark.slow
def test_learner_layouts_agree_to_fp32_tolerance(probe):
    _, res = probe
    r = res["injections"]["none"]
    assert r["n_tokens"] == len(PROMPTS) * 2 * 16
    for p in r["pairs"]:
        if p["a"] == "sampler":
            assert p["abs_dlogp_max"] < 1e-3, p  # CPU SGLang fp32 vs megatron fp32: kernels only
            continue
        assert p["abs_dlogp_max"] < 1e-4, p
        assert p["kl_sampler_learner_k3"] < 1e-9 and p["kl_learner_sampler_k3"] < 1e-9, p
        assert abs(p["ess_ratio"] - 1.0) < 1e-6


def test_bad_layouts_and_injections():
    assert (
        parse_layout("tp2ep2").nproc == 2
        and parse_layout("tp2pp2ep2").nproc == 4
        and parse_layout("pp2ep2").nproc == 4
    )
    assert parse_layout("ep4").mesh_kwargs()["ep"] == 4 and parse_layout("1").nproc == 1
    for bad in ("tp", "x2", "tp2tp2", "tp0", "2"):
        with pytest.raises(MegagrpoError, match="layout|twice|>= 1"):
            parse_layout(bad)
    for bad in ("", "1,1"):
        with pytest.raises(MegagrpoError, match="--layouts"):
            parse_layouts(bad)
    with pytest.raises(MegagrpoError, match="--inject"):
        parse_injections("fp4")


def test_bad_prompts(tmp_path):
    assert len(load_prompts("3", vocab_size=1024)) == 3
    with pytest.raises(MegagrpoError, match="at least one"):
        load_prompts("0", vocab_size=1024)
    with pytest.raises(MegagrpoError, match="not a number and not a file"):
        load_prompts(str(tmp_path / "missing.jsonl"), vocab_size=1024)
    f = tmp_path / "p.jsonl"
    f.write_text('[1, 2, 3]\n{"prompt": "hi"}\n{"oops": 1}\n')
    with pytest.raises(MegagrpoError, match=r"p.jsonl:3"):
        load_prompts(str(f), vocab_size=1024)
    f.write_text("\n")
    with pytest.raises(MegagrpoError, match="no prompt"):
        load_prompts(str(f), vocab_size=1024)


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    assert main([str(tmp_path), "--layouts", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
