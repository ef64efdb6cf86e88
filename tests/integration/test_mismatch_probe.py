"""The mismatch probe's input checks (layouts, injections, prompt files) and its script's error path.

Its end-to-end run on the tiny Qwen3-MoE (its own SGLang engine sampling clean and with an fp8 round
trip of the sampler's weights, the learner on layouts 1, tp2 and ep2, the table and the dlogp plot) is in
tests/integration/test_install.py, run there from the installed wheel outside the clone: the former
test_cli_writes_table_and_plot, test_learner_layouts_agree_to_fp32_tolerance and
test_fp8_sampler_is_further_from_every_layout of this file, sharing one probe run with test_install's own
probe check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.probe import load_prompts, main, parse_injections, parse_layout, parse_layouts

REPO = Path(__file__).resolve().parents[2]


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


def test_script_reports_bad_input_without_traceback(tmp_path):
    """tools/mismatch_probe.py, the script a user runs, is `megagrpo.probe.main` with its exit status."""
    res = subprocess.run(
        [sys.executable, "tools/mismatch_probe.py", str(tmp_path), "--layouts", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2 and "no config.json" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
