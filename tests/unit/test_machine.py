"""tools/machine.py: what a benchmark's header and JSON say about the machine it ran on."""

from __future__ import annotations

import json

import torch

from tools.machine import _cpu_model, describe, headline

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2

processor\t: 1
model name\t: another CPU
"""


def test_cpu_model_from_cpuinfo(tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    assert _cpu_model(str(tmp_path / "cpuinfo")) == "AMD EPYC (family 25 model 17)"
    (tmp_path / "arm").write_text("processor\t: 0\nModel\t\t: Raspberry Pi 4 Model B\n\n")
    assert _cpu_model(str(tmp_path / "arm")) == "Raspberry Pi 4 Model B"
    assert _cpu_model(str(tmp_path / "absent"))  # falls back to `platform`, never empty


def test_describe_start_and_end():
    start = describe()
    assert start["cores"] >= 1 and start["torch"] == torch.__version__
    assert start["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "load_1m_end" not in start
    end = describe(start)
    assert {k: end[k] for k in start} == start and "load_1m_end" in end
    json.dumps(end)  # goes into the benches' JSON figures as it is
    line = headline(end)
    assert line.startswith(f"machine: {start['cpu']}, {start['cores']} cores, load ")
    assert f"-> {end['load_1m_end']}" in line and start["cpu_capability"] in line
