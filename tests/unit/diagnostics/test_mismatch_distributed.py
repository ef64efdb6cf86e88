"""Global metrics over DP ranks equal the single-process metrics of the concatenated batch (the quantiles
bit for bit: they come from histograms summed over DP).

One launch of 2 gloo processes covers mismatch_metrics and the MoE router statistics; one rank holds
only an all-masked sequence, so empty local shards are exercised too.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from megagrpo.moe.stats import expert_counts, router_shift, topk_agreement

WORLD = 2
SEQ_SPLIT = [(0, 5), (5, 6)]  # rank 1 gets the all-masked sequence only
TOK_SPLIT = [(0, 7), (7, 10)]


def _data():
    g = torch.Generator().manual_seed(7)
    s = -torch.rand(6, 20, generator=g, dtype=torch.float64) * 4
    ll = s + 0.2 * torch.randn(6, 20, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 20, generator=g) > 0.25
    mask[5] = False
    new = torch.randn(10, 3, 8, generator=g, dtype=torch.float64)
    old = new + 0.3 * torch.randn(10, 3, 8, generator=g, dtype=torch.float64)
    tmask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    return s, ll, mask, new, old, tmask


def _all_stats(s, ll, mask, new, old, tmask, reducer=None):
    from megagrpo.algo.importance import importance_masks
    from megagrpo.diagnostics.mismatch import mismatch_metrics

    out = {}
    for level in ("token", "geometric"):
        imp = importance_masks(ll, s, mask, level=level, mode="mask", cap_high=1.1, cap_low=0.9)
        res = mismatch_metrics(s, ll, mask, importance=imp, extra_token_quantiles=(0.9,), reducer=reducer)
        out.update({f"{level}:{k}": v for k, v in res.metrics.items()})
    routes_old, routes_new = old.topk(2, -1).indices, new.topk(2, -1).indices
    ag = topk_agreement(routes_old, routes_new, tmask, n_experts=8, reducer=reducer)
    out.update(ag.metrics("old_current"))
    out.update(router_shift(new, old, routes_old, tmask, gamma_min=0.9, reducer=reducer).metrics())
    out["counts"] = expert_counts(routes_old, tmask, n_experts=8, reducer=reducer).flatten().tolist()
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from megagrpo.diagnostics.reduce import DistReducer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        s, ll, mask, new, old, tmask = _data()
        a, b = SEQ_SPLIT[rank]
        ta, tb = TOK_SPLIT[rank]
        stats = _all_stats(
            s[a:b],
            ll[a:b],
            mask[a:b],
            new[ta:tb],
            old[ta:tb],
            tmask[ta:tb],
            reducer=DistReducer(),
        )
        torch.save(stats, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_distributed_equals_single_process(tmp_path):
    ctx = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail("distributed workers did not finish within 120 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    ref = _all_stats(*_data())
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == ref.keys()
        for k, v in ref.items():
            if "ratio_p" in k or "ratio_q" in k or k == "moe/router_shift_gamma_p1":
                assert got[k] == v, (rank, k)  # histogram quantiles: counts add exactly over DP
            else:
                assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), (rank, k)
