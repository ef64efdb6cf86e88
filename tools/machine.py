"""The machine a benchmark ran on, for its header and its JSON figures.

Timings from `tools/bench_*.py` mean little without the CPU they came from and how busy it was: the same
sync measured 2.9x a copy on one 2-core machine and 3.4-3.9x on another. Every bench prints `describe()`
in its header and stores it in its JSON output under "machine".

    from tools.machine import describe, headline   # `python tools/bench_x.py`: `from machine import ...`
    m = describe()            # at the start: CPU, cores, torch, the 1-minute load average
    ...
    m = describe(m)           # at the end: the same, plus the load average now
    print(headline(m))
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import Any


def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), with its x86 family and model numbers (a hypervisor
    may show only a vendor line such as "AMD EPYC"; family 25 model 17 then still says Zen 4), else what
    `platform` knows."""
    info: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = info.get("model name") or info.get("Model") or info.get("cpu model")
    if not name:
        return platform.processor() or platform.machine() or "unknown"
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    return name


def _load_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on this platform
        return None


def describe(start: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """{cpu, cores, load_1m_start, [load_1m_end], torch, cpu_capability, python, platform}.

    cores: the cores this process may run on (its affinity), not the machine's total. load_1m_*: the
    1-minute load average (runnable processes, as `uptime` shows it); with `start` (an earlier result),
    everything is taken from it and the load average now is added as load_1m_end.
    """
    if start is not None:
        return {**start, "load_1m_end": _load_1m()}
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": cores,
        "load_1m_start": _load_1m(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def headline(machine: Mapping[str, Any]) -> str:
    """One header line: `machine: AMD EPYC, 2 cores, load 3.1 -> 2.9 (1 min), torch 2.8.0 (AVX512)`."""
    load = f"{machine.get('load_1m_start')}"
    if "load_1m_end" in machine:
        load += f" -> {machine['load_1m_end']}"
    return (
        f"machine: {machine['cpu']}, {machine['cores']} cores, load {load} (1 min), "
        f"torch {machine['torch']} ({machine['cpu_capability']})"
    )
