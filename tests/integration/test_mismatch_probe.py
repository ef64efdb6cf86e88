"""`python tools/mismatch_probe.py` end to end on the tiny Qwen3-MoE, as a user runs it: its own SGLang
engine (sampling clean and with an fp8 round trip of the sampler's weights), then the learner on layouts
1, tp2 and ep2 (one torchrun each), then the table (md + json) and the Δlogp plot."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.probe import load_prompts, main, parse_injections, parse_layout, parse_layouts

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202], [44, 45, 46, 47, 48, 49, 50, 51]]
LAYOUTS = ["1", "tp2", "ep2"]


def _session_procs(sid: int, grace_s: float = 15.0) -> list[int]:
    """Live processes of session `sid`, after up to `grace_s` for helpers (multiprocessing's resource
    tracker) that exit on their own once their parent is gone."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture(scope="module")
def probe(sglang_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    prompts, out, log = tmp / "prompts.jsonl", tmp / "out", tmp / "probe.log"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    cmd = [
        sys.executable, "tools/mismatch_probe.py", str(sglang_model_dir), "--prompts", str(prompts),
        "--group-size", "2", "--layouts", ",".join(LAYOUTS), "--inject", "none,fp8", "--out", str(out),
        "--no-progress",
    ]  # fmt: skip
    with open(log, "w") as sink:
        # own session: the engine's and torchrun's processes are findable (and killable) by session id
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=1500)
        finally:
            leftover = _session_procs(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    assert not leftover, f"the probe left processes behind: {leftover}"
    print(text[text.find("### inject") :])  # the table, with pytest -s
    return out, json.loads((out / "mismatch_table.json").read_text())


@pytest.mark.slow
def test_cli_writes_table_and_plot(probe):
    out, res = probe
    assert res["injections"].keys() == {"none", "fp8"}
    names = ["sampler", *LAYOUTS]
    for inject, r in res["injections"].items():
        assert r["n_tokens"] == len(PROMPTS) * 2 * 16
        assert [(p["a"], p["b"]) for p in r["pairs"]] == [
            (a, b) for i, a in enumerate(names) for b in names[i + 1 :]
        ], inject
        assert r["attribution"].keys() == set(LAYOUTS)
    md = (out / "mismatch_table.md").read_text()
    assert "### inject = fp8" in md and "| sampler | tp2 |" in md and "| tp2 | ep2 |" in md
    assert "routing_share" in md
    png = (out / "dlogp.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert (out / "rollouts" / "none.pt").is_file() and (out / "rollouts" / "fp8.pt").is_file()


@pytest.mark.slow
def test_learner_layouts_agree_to_fp32_tolerance(probe):
    _, res = probe
    for inject, r in res["injections"].items():
        for p in r["pairs"]:
            if p["a"] == "sampler":
                continue
            # the learner's weights are clean under every injection: layouts differ by fp32 reduction order
            assert p["abs_dlogp_max"] < 1e-4, (inject, p)
            assert p["kl_sampler_learner_k3"] < 1e-9 and p["kl_learner_sampler_k3"] < 1e-9, (inject, p)
            assert abs(p["ess_ratio"] - 1.0) < 1e-6, (inject, p)


@pytest.mark.slow
def test_fp8_sampler_is_further_from_every_layout(probe):
    _, res = probe
    clean = {p["b"]: p for p in res["injections"]["none"]["pairs"] if p["a"] == "sampler"}
    fp8 = {p["b"]: p for p in res["injections"]["fp8"]["pairs"] if p["a"] == "sampler"}
    for layout in LAYOUTS:
        assert clean[layout]["abs_dlogp_max"] < 1e-3, clean[layout]  # CPU SGLang fp32 vs megatron fp32
        assert fp8[layout]["kl_sampler_learner_k3"] > 100 * max(clean[layout]["kl_sampler_learner_k3"], 1e-12)


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
