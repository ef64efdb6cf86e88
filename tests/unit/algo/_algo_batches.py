"""Batch builders shared by the algo tests, and the gloo worker they spawn.

Kept apart from the test modules so a spawned worker imports only torch and megagrpo.algo.
"""

from __future__ import annotations

import os

import torch

from megagrpo.algo.aggregation import loss_normaliser
from megagrpo.algo.importance import train_inference_weights
from megagrpo.algo.losses import policy_loss
from megagrpo.algo.metrics import all_reduce_metrics

F64 = torch.float64
CLIPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "gmpo": (0.4, 0.4)}


def make_batch(seed: int, b: int, t: int, empty_rows: bool = True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0 if empty_rows else 1, t + 1, (b,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    m = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(b, t, generator=g, dtype=F64) * 2 - 0.05
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=F64)  # off-policy enough to clip some tokens
    adv = torch.randn(b, generator=g, dtype=F64)
    ref = old + 0.1 * torch.randn(b, t, generator=g, dtype=F64)
    ent = torch.rand(b, t, generator=g, dtype=F64)
    iw = torch.rand(b, t, generator=g, dtype=F64) + 0.5
    return logp, old, adv, m, ref, ent, iw


def run_loss(variant, agg, logp, old, adv, m, ref, ent, iw, normaliser=None):
    lo, hi = CLIPS.get(variant, (0.2, 0.28))
    return policy_loss(
        logp, old, adv, m, variant=variant, clip_low=lo, clip_high=hi, agg=agg, agg_constant=37.0,
        importance_weights=iw, ref_logp=ref, kl_coef=0.05, entropy=ent, entropy_coef=0.01, normaliser=normaliser,
    )  # fmt: skip


def all_reduce_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logp, old, adv, m, ref, ent, iw = make_batch(11, 6, 5)
        m[4:6] = False  # rank 1 holds only empty sequences: its min/max placeholders must not count
        norm = loss_normaliser(m, "seq-mean-token-mean")  # global, computed once
        sl = slice(0, 4) if rank == 0 else slice(4, 6)
        _, met = run_loss(
            "grpo", "seq-mean-token-mean", logp[sl], old[sl], adv[sl], m[sl], ref[sl], ent[sl], iw[sl], norm
        )
        _, imet = train_inference_weights(
            logp[sl], old[sl], m[sl], level="token", mode="icepop", cap_high=1.3, cap_low=0.8
        )
        out = all_reduce_metrics(met | imet)
        queue.put((rank, {k: float(v) for k, v in out.items()}))
    finally:
        dist.destroy_process_group()
