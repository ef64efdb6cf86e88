#!/usr/bin/env python
"""Disaggregated weight sync against a plain broadcast of the same bytes over the same gloo group (issue 27).

Starts ONE disaggregated engine server for a tiny Qwen3-MoE with --experts experts (128 by default; hidden
256, 2 layers, 205 MB in fp32, as `tools/bench_sync.py`) in a subprocess, exactly as an engine rank runs it
(`megagrpo.rollout.engines.server.serve`: SGLang's HTTP server, its URL in a TCP store this process hosts), connects
a `RemoteEngine` and a `BroadcastTransport` (this process is the owner: group rank 0 of a 2-rank gloo
group), and times, --reps times each (median reported, timed side by side so both see the same load):

* `sync`: `sync_remote` of the checkpoint's own tensors (fresh clones per rep, as an export yields), at each
  --bucket-mb (512 MiB is `sync.bucket_mb`'s default; the smaller sizes give the per-bucket cost that a real
  model pays at 512 MiB: Qwen3-30B-A3B is 114 buckets of 512 MiB in bf16);
* `bcast`, the baseline: the same number of bytes as ONE uint8 tensor, sent by the transport's own `send`
  (one `/update_weights_from_distributed` announcement and one `dist.broadcast` on the same group), which
  the engine's scheduler receives into a fresh buffer with SGLang's own receive. SGLang always loads what it
  receives; this tool's scheduler (and only its) skips the load for that one tensor, so the baseline is the
  wire and its one round trip, nothing else. The engine's weights are checked untouched after it.

Why this baseline: "a plain torch.distributed.broadcast of the same bytes over the same group, the engine
receiving" can only be built with the engine's scheduler as the receiver (it holds the group), and the one
HTTP announcement is what makes it join. Loading the bytes into the model is part of a sync, not of the
transfer, so the baseline leaves it out and the breakdown of each sync shows it: the owner's own work
(`owner_s`: the checkpoint's shapes, the checks, cast and flattening; the sync's time outside the
transport's calls, clocked by a wrapper), the engine's receive (`engine_receive_s`, its broadcast calls),
its load (`engine_load_s`, SGLang's `load_weights`) and its `begin/end_weight_update`
(`engine_begin_end_s`), by timers this tool installs in its scheduler process (as `tools/bench_sync.py`
does), and the rest of the time inside the transport's calls (`http_other_s`: HTTP round trips, the
scheduler's dispatch, the prefix-cache flush). The transport's `send` returns once a bucket's broadcast
has started and waits for the bucket before it, so the engine receives and loads bucket N while the owner
checks and copies N + 1: the parts overlap, `owner_s` and the engine's timers can together exceed the
sync, and `http_other_s` (the owner's waits less the engine's timed work) is then that overlap net of
the HTTP time, negative when the overlap is larger. The baseline's time includes the wait for its one
bucket to be answered.
The sync is checked bit for bit afterwards (`sync.checksum`).

`--threads` sets torch's intra-op threads here and in the engine's processes (OMP_NUM_THREADS); default 1
(see tools/bench_sync.py: on a small shared CPU, 2+ OpenMP threads wait on descheduled threads).

    python tools/bench_disagg_sync.py [--experts 128] [--hidden 256] [--reps 5] [--bucket-mb 512 64 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline

REPO = Path(__file__).resolve().parents[1]
RAW_NAME = "megagrpo.bench.raw"  # the baseline's one tensor: received by the engine, never loaded
_TIMING_DIR_ENV = "MEGAGRPO_BENCH_DISAGG_TIMING_DIR"
ENGINE = 0
DTYPE = "float32"  # the CPU engine's dtype in the tests and in tools/bench_sync.py's figures


# ---------------------------------------------------------------- pure parts (tests/unit/test_bench_disagg_sync.py)


def qwen3_moe_params(hf: Mapping[str, Any]) -> int:
    """Parameters of a Qwen3-MoE HF checkpoint from its config.json: embeddings, the LM head (unless tied),
    per layer q/k/v/o projections (+ biases with attention_bias), the q/k RMS norms and the two layer norms,
    and either the router + experts (a sparse layer: `decoder_sparse_step`, `mlp_only_layers`) or a dense
    MLP; the final norm. Mirrors transformers' `Qwen3MoeForCausalLM`."""
    h, v, layers = hf["hidden_size"], hf["vocab_size"], hf["num_hidden_layers"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or h // heads
    experts, moe_i, dense_i = hf["num_experts"], hf["moe_intermediate_size"], hf["intermediate_size"]
    step, dense_layers = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    if hf.get("attention_bias"):
        attn += heads * d + 2 * kv * d + h
    total = v * h * (1 if hf.get("tie_word_embeddings") else 2) + h
    for i in range(layers):
        sparse = i not in dense_layers and experts > 0 and (i + 1) % step == 0
        mlp = experts * h + experts * 3 * h * moe_i if sparse else 3 * h * dense_i
        total += attn + 2 * d + 2 * h + mlp
    return total


def broadcast_traffic(
    model_bytes: int, *, engines: int, engine_tp: int, link_gbit_s: float
) -> dict[str, float]:
    """Bytes per rank of one disaggregated sync (`sync.broadcast`) and its time at a link speed: arithmetic,
    not a measurement. Each of the `engines` owners broadcasts the whole model (M bytes) to its engine's
    `engine_tp` ranks; a broadcast's root sends M once (ring or tree), each receiver receives M, and the
    rollout node's network takes M per engine. The owners send in parallel over links of their own, so the
    sync takes M / link at best."""
    link_bytes_s = link_gbit_s * 1e9 / 8
    return {
        "model_bytes": model_bytes,
        "owner_sends_bytes": model_bytes,
        "engine_rank_receives_bytes": model_bytes,
        "rollout_node_receives_bytes": engines * model_bytes,
        "engine_ranks": engines * engine_tp,
        "link_gbit_s": link_gbit_s,
        "seconds_at_line_rate": model_bytes / link_bytes_s,
    }


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs: sync seconds against buckets gives the fixed cost
    of a sync and the cost of one more bucket."""
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("fit_line needs at least two distinct x values")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def breakdown(sync_s: float, transport_s: float, engine: Mapping[str, float]) -> dict[str, float]:
    """Where one sync's seconds went. `transport_s`: the owner's time inside the transport's calls (begin,
    each bucket's send, end); `engine`: the engine's timers over the same sync. The owner's own work (the
    checkpoint's shapes, the checks, cast and flattening) is the sync's time outside the transport; inside
    it, what the engine's timers do not cover is HTTP, the scheduler's dispatch and the cache flush, less
    the engine's work that ran while the owner worked (`send` returns before the bucket has arrived), so
    `http_other_s` can be negative; the parts still add up to the sync."""
    engine_parts = {
        "engine_receive_s": engine.get("receive", 0.0),
        "engine_load_s": engine.get("load", 0.0),
        "engine_begin_end_s": engine.get("begin", 0.0) + engine.get("end", 0.0),
    }
    return {
        "owner_s": sync_s - transport_s,
        **engine_parts,
        "http_other_s": transport_s - sum(engine_parts.values()),
    }


def read_engine_seconds(timing_dir: Path) -> dict[str, float]:
    """Sums of the engine's timer lines (`<kind> <seconds>`) written since the last call, which clears them."""
    total: dict[str, float] = {}
    for path in sorted(timing_dir.glob("*.txt")):
        for line in path.read_text().splitlines():
            kind, seconds = line.split()
            total[kind] = total.get(kind, 0.0) + float(seconds)
        path.unlink()
    return total


# ---------------------------------------------------------------- the engine side (a subprocess)


def _timed_scheduler_entry(*args: Any, **kwargs: Any) -> Any:
    """Scheduler process target: time SGLang's receive, load and begin/end of a weight update, skip the
    load of the baseline's raw tensor, then run megagrpo's CPU scheduler entry."""
    from megagrpo.compat import sglang_cpu

    sglang_cpu.apply()
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    path = Path(os.environ[_TIMING_DIR_ENV]) / f"{os.getpid()}.txt"

    def timed(kind: str, fn: Any) -> Any:
        def run(self: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                with open(path, "a") as f:
                    f.write(f"{kind} {time.perf_counter() - t0}\n")

        return run

    load = timed("load", WeightUpdater.load_weights_from_distributed)

    def load_unless_raw(self: Any, named_tensors: Any) -> Any:
        if [n for n, _ in named_tensors] == [RAW_NAME]:
            return True, "bench baseline: received, not loaded"
        return load(self, named_tensors)

    WeightUpdater._receive_bucketed_weights_from_distributed = timed(
        "receive", WeightUpdater._receive_bucketed_weights_from_distributed
    )
    WeightUpdater.load_weights_from_distributed = load_unless_raw
    WeightUpdater.begin_weight_update = timed("begin", WeightUpdater.begin_weight_update)
    WeightUpdater.end_weight_update = timed("end", WeightUpdater.end_weight_update)
    return sglang_cpu.scheduler_process_entry(*args, **kwargs)


def _rollout_config(model_dir: str) -> Any:
    from megagrpo.rollout.config import RolloutConfig

    return RolloutConfig(model_path=model_dir, dtype=DTYPE, max_total_tokens=4096, seed=0)


def _serve(a: argparse.Namespace) -> int:
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from sglang.srt.entrypoints.engine import Engine

    from megagrpo.rollout.engines.server import serve

    Engine.run_scheduler_process_func = staticmethod(_timed_scheduler_entry)  # instrumentation only
    return serve(
        _rollout_config(a.serve),
        engine=ENGINE,
        first=True,
        addr="127.0.0.1",
        port=a.port,
        timeout_s=a.timeout,
    )


# ---------------------------------------------------------------- the owner side (this process)


class _TimedTransport:
    """`BroadcastTransport` with a clock on its calls: the owner's seconds inside begin, send and end. Its
    `flatten` is the owner's own work and is not clocked; `shapes` is the inner transport's, so that the
    checkpoint is read once, not once per rep."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.remote, self.name = inner, inner.remote, inner.name
        self.seconds = 0.0

    @property
    def shapes(self) -> Any:
        return self.inner.shapes

    @shapes.setter
    def shapes(self, value: Any) -> None:
        self.inner.shapes = value

    def flatten(self, bucket: Any, cast: Any, *, fresh: bool = False) -> Any:
        return self.inner.flatten(bucket, cast, fresh=fresh)

    def _timed(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def begin(self) -> None:
        self._timed(self.inner.begin)

    def send(self, flat: Any, last: bool) -> None:
        self._timed(self.inner.send, flat, last)

    def dropped(self) -> None:
        self.inner.dropped()

    def end(self) -> None:
        self._timed(self.inner.end)


def _bcast_seconds(transport: Any, raw: Any) -> float:
    """The baseline: the transport's own send of one raw bucket (one announcement, one broadcast) until the
    engine has answered, inside the update session SGLang requires (its begin and end are not timed)."""
    transport.begin()
    try:
        t0 = time.perf_counter()
        transport.send(raw, last=False)
        transport._wait_in_flight()  # send returns once the broadcast has started
        return time.perf_counter() - t0
    finally:
        transport.end()


def _start_server(
    model_dir: Path, a: argparse.Namespace, log: Path, timing_dir: Path
) -> tuple[Any, Any, Any]:
    import torch.distributed as dist

    from megagrpo.errors import MegagrpoError
    from megagrpo.rollout.engines import rendezvous

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=a.timeout)
    )
    store = dist.PrefixStore(rendezvous.PREFIX, master)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(a.threads),
        _TIMING_DIR_ENV: str(timing_dir),
    }
    cmd = [
        sys.executable,
        "-m",
        "tools.bench_disagg_sync",
        "--serve",
        str(model_dir),
        "--port",
        str(master.port),
    ]
    cmd += ["--timeout", str(a.timeout)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + a.timeout
    while True:  # short waits, so that a server that died before publishing is seen at once
        try:
            endpoint = rendezvous.wait_for(store, ENGINE, 1.0)
            break
        except MegagrpoError as e:
            if (
                proc.poll() is None
                and time.monotonic() < deadline
                and not rendezvous.failure_of(store, ENGINE)
            ):
                continue
            proc.kill()
            raise SystemExit(
                f"error: the engine server did not come up ({e}):\n{log.read_text()[-3000:]}"
            ) from e
    return proc, store, endpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 64, 8])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads here and in the engine")
    p.add_argument("--timeout", type=float, default=600.0, help="engine start and every wait on it")
    p.add_argument("--serve", metavar="MODEL_DIR", help=argparse.SUPPRESS)  # the engine's subprocess
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        return _serve(a)
    if a.reps < 3:
        p.error("--reps must be at least 3 (the median of the reps is reported)")
    torch.set_num_threads(a.threads)
    machine = describe()
    print(headline(machine), flush=True)

    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=False, sglang=True)
    from safetensors.torch import load_file
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megagrpo.rollout.engines import rendezvous
    from megagrpo.rollout.engines.remote import RemoteEngine
    from megagrpo.sync.broadcast import BroadcastTransport, sync_remote, verify_remote
    from megagrpo.sync.buckets import bucketize
    from megagrpo.tiny_model import make_tiny_model

    cast = getattr(torch, DTYPE)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "model", "qwen3_moe", hidden=a.hidden, layers=a.layers, experts=a.experts, topk=2
        )
        tensors = list(load_file(model_dir / "model.safetensors").items())
        sent_bytes = sum(t.numel() * cast.itemsize for _, t in tensors)  # what crosses the group
        timing_dir = Path(tmp) / "timing"
        timing_dir.mkdir()
        t0 = time.monotonic()
        proc, store, ep = _start_server(model_dir, a, Path(tmp) / "server.log", timing_dir)
        start_s = time.monotonic() - t0
        engine = RemoteEngine(
            _rollout_config(str(model_dir)), index=ENGINE, url=ep.url, where=ep.where, key=ep.key,
            timeout_s=a.timeout,
        ).start()  # fmt: skip
        transport = BroadcastTransport(engine, timeout_s=a.timeout)
        try:
            t0 = time.monotonic()
            transport.open()
            group_s = time.monotonic() - t0
            raw = FlattenedTensorBucket(
                named_tensors=[(RAW_NAME, torch.randint(0, 256, (sent_bytes,), dtype=torch.uint8))]
            )
            sync_remote(transport, bucketize(tensors))  # warm-up: first touches of the engine's buffers
            _bcast_seconds(transport, raw)
            read_engine_seconds(timing_dir)
            bcast: list[float] = []
            bcast_engine: list[float] = []
            per_mb: dict[int, dict[str, list[float]]] = {mb: {} for mb in a.bucket_mb}
            buckets: dict[int, int] = {}
            for _ in range(a.reps):
                for mb in a.bucket_mb:
                    fresh = [(n, t.clone()) for n, t in tensors]  # a new export every step
                    timed = _TimedTransport(transport)
                    stats = sync_remote(timed, bucketize(fresh, mb << 20))
                    del fresh
                    buckets[mb] = stats.buckets
                    parts = breakdown(stats.seconds, timed.seconds, read_engine_seconds(timing_dir))
                    for k, v in {"sync_s": stats.seconds, **parts}.items():
                        per_mb[mb].setdefault(k, []).append(v)
                bcast.append(_bcast_seconds(transport, raw))  # last: the check below sees its effect
                bcast_engine.append(read_engine_seconds(timing_dir).get("receive", 0.0))
            # the baseline's bytes were never loaded, and every sync arrived bit for bit
            untouched = verify_remote(engine, [tensors])
            checksum_ok = sync_remote(transport, bucketize(tensors), checksum=True).checksum_ok
        finally:
            transport.close()
            engine.shutdown()
            rendezvous.request_stop(store)
            code = proc.wait(timeout=120)
        bcast_s = statistics.median(bcast)
        rows = []
        for mb in a.bucket_mb:
            row = {"bucket_mb": mb, "buckets": buckets[mb]}
            row.update({k: round(statistics.median(v), 5) for k, v in per_mb[mb].items()})
            row["ratio_to_bcast"] = round(row["sync_s"] / bcast_s, 2)
            # against a transfer that also loads: the baseline plus this sync's own load
            row["ratio_to_bcast_and_load"] = round(row["sync_s"] / (bcast_s + row["engine_load_s"]), 2)
            row["http_other_per_bucket_s"] = round(row["http_other_s"] / row["buckets"], 5)
            rows.append(row)
            print(json.dumps(row), flush=True)
        summary: dict[str, Any] = {
            "experts": a.experts,
            "hidden": a.hidden,
            "layers": a.layers,
            "dtype": DTYPE,
            "bytes": sent_bytes,
            "tensors": len(tensors),
            "reps": a.reps,
            "bcast_s": round(bcast_s, 5),
            "bcast_engine_receive_s": round(statistics.median(bcast_engine), 5),
            "bcast_gbps": round(sent_bytes / bcast_s / 1e9, 3),
            "server_start_s": round(start_s, 1),
            "group_setup_s": round(group_s, 3),
            "untouched_by_baseline": untouched,
            "checksum_ok": checksum_ok,
            "server_exit": code,
        }
        if len({r["buckets"] for r in rows}) >= 2:
            fixed, per_bucket = fit_line([r["buckets"] for r in rows], [r["sync_s"] for r in rows])
            summary["sync_fixed_s"], summary["sync_per_bucket_s"] = round(fixed, 5), round(per_bucket, 5)
        print(json.dumps(summary))
    print(json.dumps({"machine": describe(machine)}))
    return 0 if (untouched and checksum_ok and code == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
