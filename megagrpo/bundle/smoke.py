"""What loads from an installed bundle, and megagrpo's engine path run from it.

    python -m megagrpo.bundle.smoke imports MODULE ...     # each module: loaded, or the error it raised
    python -m megagrpo.bundle.smoke engine [--out DIR]     # a tiny Qwen3-MoE through RolloutEngine

`engine` is also the workload `megagrpo bundle trace engine` traces: start the engine on a tiny Qwen3-MoE
built here (on the CPU through the compat layer, or on CUDA), generate with token logprobs and routes,
release and resume its memory, generate again, shut down; and import SGLang's HTTP server, which a
disaggregated engine rank serves (`rollout.engines.server`), so that its imports are in the closure too. It prints one JSON line (`{"smoke": ...}`) and
exits non-zero if any part failed. Only the standard library is imported before the work starts, so a
node without the bundle still gets a report rather than a traceback: a part that raises ends the check with
one line on stderr naming the part and the error (`--verbose` adds the traceback), and the JSON line
says the same (`failed`, `error`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

SERVER = (
    "sglang.srt.entrypoints.http_server"  # what a disaggregated engine rank runs (`rollout.engines.server`)
)


def check_imports(modules: list[str]) -> dict[str, str]:
    """module -> "ok <version>" or the error it raised on import."""
    report = {}
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is the report, not a crash
            report[name] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        report[name] = f"ok {getattr(mod, '__version__', '')}".rstrip()
    return report


def run_engine(out: Path, report: dict | None = None) -> dict:
    """The engine check's report. `report["part"]` names the part running, so that whoever catches an
    error it raises can say which part failed."""
    report = {} if report is None else report
    report["part"] = "importing torch"
    import torch

    report["part"] = "importing megagrpo's engine path"
    from megagrpo.rollout import RolloutConfig, RolloutEngine, SamplingConfig
    from megagrpo.tiny_model import make_tiny_model

    cuda = torch.cuda.is_available()
    report.update(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    if not cuda:
        from megagrpo.compat import apply_cpu_compat

        report["part"] = "applying the CPU compatibility patches"
        apply_cpu_compat(megatron=False, sglang=True)
    report["part"] = "building the tiny model"
    # head_dim 128 (hidden / 4): SGLang's CUDA rotary path with a KV-cache write has no fallback for 16.
    model = make_tiny_model(out / "model", "qwen3_moe", hidden=512, layers=2, experts=8, topk=2, seed=0)
    cfg = RolloutConfig(str(model), dtype="bfloat16" if cuda else "float32", max_total_tokens=4096, seed=0)
    report["part"] = "starting the engine"
    t0 = time.perf_counter()
    engine = RolloutEngine(cfg).start()
    report["start_s"] = round(time.perf_counter() - t0, 1)
    try:
        report["part"] = "generating"
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        prompt = [[3, 4, 5, 6]]
        first = engine.generate(prompt, greedy, group_size=1)[0][0]
        report["tokens"] = first.output_ids.tolist()
        report["logprobs_finite"] = bool(torch.isfinite(torch.as_tensor(first.logprobs)).all())
        report["routes_shape"] = list(first.routes.shape) if first.routes is not None else None
        # The KV cache comes back empty and is refilled; released weights come back as garbage until the
        # next weight sync, so the same-tokens check releases the KV cache only.
        report["part"] = "releasing and resuming the KV cache"
        engine.release(["kv_cache"])
        engine.resume(["kv_cache"])
        report["part"] = "generating after the resume"
        again = engine.generate(prompt, greedy, group_size=1)[0][0]
        report["same_after_resume"] = again.output_ids.tolist() == report["tokens"]
        if cuda:
            report["part"] = "releasing the engine's memory"
            free0 = torch.cuda.mem_get_info()[0]
            engine.release()
            report["released_gib"] = round((torch.cuda.mem_get_info()[0] - free0) / 2**30, 3)
    finally:
        running, report["part"] = report["part"], "shutting the engine down"
        engine.shutdown()
        report["part"] = running  # a part that raised above is the one named
    del report["part"]
    report["server"] = check_imports([SERVER])[SERVER]
    failed = [
        what
        for what, ok in (
            ("generating: no tokens", report["tokens"]),
            ("generating: logprobs that are not finite", report["logprobs_finite"]),
            ("generating after the resume: other tokens than before", report["same_after_resume"]),
            (f"importing {SERVER}: {report['server']}", report["server"].startswith("ok")),
        )
        if not ok
    ]
    report["ok"] = not failed
    if failed:
        report["failed"] = "; ".join(failed)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megagrpo.bundle.smoke", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("imports", help="import each module and report")
    imp.add_argument("modules", nargs="+")
    eng = sub.add_parser("engine", help="run megagrpo's engine path on a tiny model")
    eng.add_argument("--out", help="where to build the tiny model (default: a temporary folder)")
    eng.add_argument("--verbose", action="store_true", help="print the traceback of a part that raises")
    args = p.parse_args(argv)
    if args.cmd == "imports":
        report = check_imports(args.modules)
        print(json.dumps({"smoke": "imports", "modules": report}, indent=1))
        return 0 if all(v.startswith("ok") for v in report.values()) else 1
    report: dict = {}
    hint = ""
    try:
        with tempfile.TemporaryDirectory(prefix="megagrpo-smoke-") as tmp:
            run_engine(Path(args.out or tmp), report)
    except Exception as e:  # noqa: BLE001 - whatever a part raises is the check's finding, said in one line
        part = report.pop("part", "the engine check")
        report.update(ok=False, failed=f"{part}: {type(e).__name__}: {_first_line(e)}")
        if args.verbose:
            traceback.print_exc()
        else:
            hint = " (--verbose prints the traceback)"
    print(json.dumps({"smoke": "engine", **report}))
    if report["ok"]:
        return 0
    print(f"smoke engine: FAILED {report['failed']}{hint}", file=sys.stderr)
    return 1


def _first_line(e: BaseException) -> str:
    """The first non-empty line of an error's message (SGLang's often carry a child's whole traceback)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "(no message)")


if __name__ == "__main__":
    sys.exit(main())
