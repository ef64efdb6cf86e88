#!/usr/bin/env python
"""Per-rank bytes of the batch statistics' collectives (issue 25, item 6), on gloo processes.

For each DP size and global batch (rows of `--tokens` tokens, 90% valid), every rank holds its rows and
measures what it receives:
- before: the quantile inputs gathered to every rank, as `mismatch_metrics` did before issue 25 (valid
  tokens' log-ratios, then the sequences' product and geometric log-ratios; `DistReducer.gather`, size
  exchange included);
- after: the same three value sets summarised by `megagrpo.algo.quantiles.summarize` (histograms summed
  over DP, extremes max-reduced); and the whole `mismatch_metrics` call (its sums and maxima too).

Item 8: the bytes of the routers' load-drift table (`LoadDriftTracker`, `[L, E]` fp64 as JSON) in a
checkpoint's `meta.json` (written as `learner.checkpoint` writes it) and received per rank, with one copy
per rank (before: all-gathered over WORLD) and with the single copy (after), for L MoE layers and E experts
(default Qwen3-30B-A3B's 48 x 128).

    python tools/bench_stats_bytes.py [--dp 2 4] [--rows 256 1024 4096] [--tokens 512]
                                      [--layers 48] [--experts 128] [--world 16 512]

Prints Markdown tables and one JSON line. Bound (DESIGN.md): fixed-size summaries, flat in B and DP;
the drift table once per checkpoint, flat in the world size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket

import torch

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline


class _CountingDist:
    """`torch.distributed` as `DistReducer` calls it, counting the bytes this rank receives: an
    all-reduce's result, or every part of an all-gather (the size exchange included)."""

    def __init__(self, dist) -> None:
        self._d = dist
        self.received = 0

    def __getattr__(self, name):
        return getattr(self._d, name)

    def all_reduce(self, t, **kw):
        self.received += t.numel() * t.element_size()
        return self._d.all_reduce(t, **kw)

    def all_gather(self, outs, t, **kw):
        self.received += sum(o.numel() * o.element_size() for o in outs)
        return self._d.all_gather(outs, t, **kw)


def _counting_reducer():
    from megagrpo.diagnostics.reduce import DistReducer

    red = DistReducer()
    red._dist = _CountingDist(red._dist)
    return red


def _batch(rows: int, tokens: int):
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 3
    ll = s + 0.05 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, tokens, generator=g) < 0.9
    return s, ll, mask


def _worker(rank: int, world: int, port: int, cases: list, tokens: int, out) -> None:
    import torch.distributed as dist

    from megagrpo.algo.quantiles import summarize
    from megagrpo.diagnostics.mismatch import mismatch_metrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = []
    for rows in cases:
        s, ll, mask = _batch(rows, tokens)
        mine = slice(rank * rows // world, (rank + 1) * rows // world)
        s, ll, mask = s[mine], ll[mine], mask[mine]
        delta = (ll - s)[mask]
        prod = torch.where(mask, ll - s, torch.zeros_like(s)).sum(1)
        geo = prod / mask.sum(1).clamp_min(1)
        before, after, call = _counting_reducer(), _counting_reducer(), _counting_reducer()
        for x in (delta, prod, geo):
            before.gather(x)
        summarize([delta, prod, geo], after)
        mismatch_metrics(s, ll, mask, reducer=call)
        res.append(
            {
                "rows": rows,
                **{k: r._dist.received for k, r in (("before", before), ("after", after), ("call", call))},
            }
        )
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(world: int, cases: list[int], tokens: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cases, tokens, out)) for r in range(world)]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join()
    return [{"dp": world, **r} for r in res]


def drift_table_bytes(layers: int, experts: int, worlds: list[int]) -> list[dict]:
    """meta.json bytes of the drift table with `world` copies (before) and one (after), and the pickled
    bytes each rank received from `all_gather_object` before (none now)."""
    import pickle

    from megagrpo.moe.stats import LoadDriftTracker, load_distribution

    g = torch.Generator().manual_seed(0)
    tracker = LoadDriftTracker()
    tracker.update(load_distribution(torch.randint(1, 1000, (layers, experts), generator=g).double()))
    state = {"drift": tracker.state_dict()}

    def meta_bytes(extra: dict) -> int:
        return len(json.dumps({"extra": extra}, indent=1, sort_keys=True).encode())

    after = meta_bytes({"router_state": state})
    return [
        {
            "world": w,
            "meta_before": meta_bytes({"router_taps": [state] * w}),
            "meta_after": after,
            "gathered_before": w * len(pickle.dumps(state)),
        }
        for w in worlds
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--world", type=int, nargs="+", default=[16, 512])
    args = ap.parse_args(argv)
    machine = describe()  # bytes, not times: the machine is recorded, not needed
    drift = drift_table_bytes(args.layers, args.experts, args.world)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = [r for dp in args.dp for r in measure(dp, args.rows, args.tokens)]
    machine = describe(machine)
    print(headline(machine))
    print(
        "| global batch (rows) | DP | before: gathered quantile inputs / rank | after: histograms / rank |"
        " whole `mismatch_metrics` call / rank |"
    )
    print("|---|---|---|---|---|")
    for r in res:
        print(f"| {r['rows']} | {r['dp']} | {r['before']:,} | {r['after']:,} | {r['call']:,} |")
    print()
    print("| world | meta.json drift bytes before | after | received per rank before (pickled) | after |")
    print("|---|---|---|---|---|")
    for d in drift:
        print(f"| {d['world']} | {d['meta_before']:,} | {d['meta_after']:,} | {d['gathered_before']:,} | 0 |")
    print(
        json.dumps({"tokens_per_row": args.tokens, "results": res, "drift_table": drift, "machine": machine})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
