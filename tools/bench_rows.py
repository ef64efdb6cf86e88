#!/usr/bin/env python
"""Per-rank cost of the step's data plane: bytes of rows each rank receives (`trainer.rows`) and the
replay tables it allocates, for DP in {1, 2, 4} and global batches of {64, 256} rows, at a fixed
micro-batch size. One process: the rows of each DP rank are planned by the trainer's own `RowPlan` and
pickled exactly as `EngineGroups.send_rows` pickles them (`RouteSlices.slice`: text dropped, routes of
the rank's pipeline stage only), so the bytes are those a rank receives; the PP 2 column is the most any
rank of either stage (half the MoE layers each) receives. Replay bytes come from `moe.replay`: the tables one micro-batch allocates
(`micro_batch_table_bytes`, over the plan's packed micro-batches; `tests/dist/test_replay_memory.py`
measures them on the trainer's path) and the old pass's host store of the rank's routed tokens
(`store_bytes_per_route`).

    python tools/bench_rows.py [--tokens 384] [--layers 8] [--topk 2] [--experts 64] [--mini-batches 2]

Prints a Markdown table and one JSON line. Issue 14's bound: row bytes and the host store fall as 1/DP;
replay tables stay flat in DP and in the global batch; route bytes fall as 1/PP.
"""

from __future__ import annotations

import argparse
import json
import pickle

import torch

from megagrpo.learner.row_plan import RowPlan
from megagrpo.moe.replay import micro_batch_table_bytes, store_bytes_per_route
from megagrpo.rollout.completion import Completion
from megagrpo.trainer.rows import RouteSlices

try:
    from tools.machine import describe, headline
except ModuleNotFoundError:  # run as `python tools/bench_x.py`: tools/ itself is on sys.path
    from machine import describe, headline


def make_rows(B: int, tokens: int, layers: int, topk: int) -> list[Completion]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(B):
        P = 16 + i % 32
        n_out = int(torch.randint(tokens // 4, tokens - P, (1,), generator=gen))
        routes = torch.randint(0, 64, (P + n_out, layers, topk), generator=gen, dtype=torch.int32)
        out.append(
            Completion(
                i // 8, i % 8, torch.arange(P), torch.arange(n_out), torch.zeros(n_out), "stop", "", routes
            )
        )
    return out


def _pickled(slices: RouteSlices, rank: int, rows: list[Completion], local: list[int]) -> int:
    """Bytes of the rows `local` as `EngineGroups.send_rows` pickles them for `rank`."""
    items = [(i, slices.slice(rank, rows[i])) for i in local]
    return len(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=384, help="longest row (prompt + output)")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers")
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    args = ap.parse_args(argv)
    machine = describe()  # bytes, not times: the machine is recorded, not needed
    table = []
    L = args.layers
    moe = tuple(range(L))
    pp1 = RouteSlices(moe, L, (moe,))
    pp2 = RouteSlices(moe, L, (moe[: L // 2], moe[L // 2 :]))
    for B in (64, 256):
        rows = make_rows(B, args.tokens, args.layers, args.topk)
        lens = torch.tensor([c.num_tokens for c in rows])
        for dp in (1, 2, 4):
            plan = RowPlan.build(
                lens, dp=dp, num_mini_batches=args.mini_batches, micro_batch_size=args.micro_batch_size
            )
            most_bytes, most_pp2, most_replay, most_store = 0, 0, 0, 0
            for d in range(dp):
                local_rows = plan.local_rows(d)
                local = local_rows.tolist()
                most_bytes = max(most_bytes, _pickled(pp1, 0, rows, local))
                most_pp2 = max(most_pp2, *(_pickled(pp2, stage, rows, local) for stage in (0, 1)))
                local_lens = lens[local_rows]
                for part in plan.micro_batch_rows(d):
                    tokens = int(local_lens[part].sum())  # packed: the micro-batch's real tokens
                    bound = micro_batch_table_bytes(tokens, args.layers, args.topk, args.experts)
                    most_replay = max(most_replay, bound)
                store = int(local_lens.sum()) * args.layers * store_bytes_per_route(args.topk)
                most_store = max(most_store, store)
            table.append(
                dict(
                    batch=B,
                    dp=dp,
                    rows_bytes=most_bytes,
                    rows_bytes_pp2=most_pp2,
                    replay_table_bytes=most_replay,
                    store_bytes=most_store,
                )
            )
    base = {t["batch"]: t for t in table if t["dp"] == 1}
    machine = describe(machine)
    print(headline(machine))
    print(
        "| global batch | DP | rows bytes / rank (max) | vs DP 1 | at PP 2 | vs PP 1 "
        "| replay tables / micro-batch (max) | vs DP 1 | replay host store / rank | vs DP 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        b = base[t["batch"]]
        print(
            f"| {t['batch']} | {t['dp']} | {t['rows_bytes']:,} | {t['rows_bytes'] / b['rows_bytes']:.2f} | "
            f"{t['rows_bytes_pp2']:,} | {t['rows_bytes_pp2'] / t['rows_bytes']:.2f} | "
            f"{t['replay_table_bytes']:,} | {t['replay_table_bytes'] / b['replay_table_bytes']:.2f} | "
            f"{t['store_bytes']:,} | {t['store_bytes'] / b['store_bytes']:.2f} |"
        )
    print(json.dumps({"rows": table, "machine": machine}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
