#!/usr/bin/env python
"""Benchmark HF -> Megatron conversion against a plain `safetensors.torch.load_file` of the same file.

    python tools/bench_convert.py [--hidden 512 --layers 8 --experts 64] [--workdir /tmp]

Generates a random Qwen3-MoE (default: 64 experts, ~1.6 GB fp32) with tools/make_tiny_model.py, then in
fresh subprocesses (so memory peaks are not mixed) measures
- load_file: `load_file(model.safetensors)` as it is (safetensors maps the file lazily, nothing is read);
- load_file_read: the same, then every tensor read once (the real cost of loading the file);
- copy_file: a plain copy of the file + fsync (the real cost of writing that many bytes);
- convert: `tools/convert_hf_to_megatron.convert` to a torch_dist checkpoint.
For each: wall seconds, peak RSS, and peak anonymous RSS (private memory; file pages mapped by
safetensors count in RSS but are evictable page cache) above the level after imports, sampled every 5 ms.
Prints one JSON line with the time ratio convert / load_file and the peaks; everything is deleted after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakSampler:
    """Samples VmRSS and RssAnon of this process every `period` seconds in a thread."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        self.peak_rss = max(self.peak_rss, _status_kib("VmRSS"))
        self.peak_anon = max(self.peak_anon, _status_kib("RssAnon"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period)

    def __enter__(self) -> PeakSampler:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def child(mode: str, model_dir: str, out_dir: str) -> dict:
    import torch  # noqa: F401
    from safetensors.torch import load_file

    from megagrpo.convert.hf_to_megatron import convert, init_single_process

    if mode == "convert":
        init_single_process()  # imports megatron and starts the one-process group before measuring
    base_rss, base_anon = _status_kib("VmRSS"), _status_kib("RssAnon")
    t0 = time.perf_counter()
    with PeakSampler() as s:
        if mode == "copy_file":
            shutil.copyfile(Path(model_dir) / "model.safetensors", Path(out_dir + ".copy"))
            with open(out_dir + ".copy", "rb+") as f:
                os.fsync(f.fileno())
            nbytes = largest = Path(out_dir + ".copy").stat().st_size
            Path(out_dir + ".copy").unlink()
        elif mode in ("load_file", "load_file_read"):
            sd = load_file(str(Path(model_dir) / "model.safetensors"))
            if mode == "load_file_read":
                # load_file maps the file lazily; reading every byte is the real cost of loading it
                for t in sd.values():
                    t.sum()
            nbytes = sum(t.numel() * t.element_size() for t in sd.values())
            largest = max(t.numel() * t.element_size() for t in sd.values())
            s.sample()  # the state dict is fully alive here
            del sd
        else:
            summary = convert(model_dir, out_dir, progress=False)
            nbytes, largest = summary["bytes"], 0
    seconds = time.perf_counter() - t0
    return {
        "mode": mode,
        "seconds": seconds,
        "bytes": nbytes,
        "largest_tensor_bytes": largest,
        "peak_rss_mib": s.peak_rss / 1024,
        "peak_rss_above_start_mib": (s.peak_rss - base_rss) / 1024,
        "peak_anon_above_start_mib": (s.peak_anon - base_anon) / 1024,
    }


def _run_child(mode: str, model_dir: Path, out_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(model_dir), str(out_dir)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def largest_param_group_mib(model_dir: Path) -> float:
    """Bytes of the largest megatron parameter plus its HF inputs (the streaming converter's unit)."""
    from megagrpo.bridge.hf_io import HFCheckpoint

    ck = HFCheckpoint(model_dir)
    best = 0
    for pm in ck.maps:
        # the HF inputs plus the fused megatron tensor of the same size
        n = sum(ck.dtype(h).itemsize * _numel(ck.shape(h)) for h in pm.hf)
        best = max(best, 2 * n)
    return best / 2**20


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(child(argv[1], argv[2], argv[3])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--workdir", default=None)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the best time is kept")
    a = p.parse_args(argv)
    from megagrpo.tiny_model import make_tiny_model

    machine = describe()
    print(headline(machine), file=sys.stderr)  # stdout is the JSON report
    work = Path(tempfile.mkdtemp(prefix="bench_convert.", dir=a.workdir))
    try:
        model = make_tiny_model(
            work / "model", "qwen3_moe", hidden=a.hidden, layers=a.layers, experts=a.experts
        )
        modes = ("load_file", "load_file_read", "copy_file", "convert")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(a.repeats):
            for mode in modes:
                out = work / f"ckpt{i}"
                runs[mode].append(_run_child(mode, model, out))
                shutil.rmtree(out, ignore_errors=True)
        best = {m: min(r, key=lambda x: x["seconds"]) for m, r in runs.items()}
        peak = {m: max(x["peak_anon_above_start_mib"] for x in r) for m, r in runs.items()}
        report = {
            "model": dict(arch="qwen3_moe", hidden=a.hidden, layers=a.layers, experts=a.experts),
            "file_mib": (model / "model.safetensors").stat().st_size / 2**20,
            "largest_param_group_mib": largest_param_group_mib(model),
            "seconds": {m: r["seconds"] for m, r in best.items()},
            "time_ratio_convert_over_load_file_read": best["convert"]["seconds"]
            / best["load_file_read"]["seconds"],
            "time_ratio_convert_over_load_file_lazy": best["convert"]["seconds"]
            / best["load_file"]["seconds"],
            "time_ratio_convert_over_copy_file": best["convert"]["seconds"] / best["copy_file"]["seconds"],
            "peak_anon_above_start_mib": peak,
            "peak_rss_above_start_mib": {
                m: max(x["peak_rss_above_start_mib"] for x in r) for m, r in runs.items()
            },
            "peak_rss_mib": {m: max(x["peak_rss_mib"] for x in r) for m, r in runs.items()},
            "runs": runs,
            "machine": describe(machine),
        }
        print(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
