"""Workers of test_replay_memory.py (no tests here): per-rank replay memory along the trainer's own path.

Each case builds the data plane's `RowPlan` for a global batch of equal-length rows, runs the old pass in
the plan's micro-batches and one R2 training step per mini-batch with RSPO weights (sharded replay, as
`GRPOTrainer` does), and reports this rank's `peak_table_bytes`, `store_bytes` and the step's metrics.
Rank r writes rank{r}.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megagrpo.algo.aggregation import loss_normaliser
from megagrpo.algo.losses import policy_loss
from megagrpo.learner import train_step as ts
from megagrpo.learner.learner import Learner, LearnerConfig
from megagrpo.learner.mesh import MeshConfig
from megagrpo.learner.row_plan import RowPlan
from megagrpo.moe.replay import StepReplay
from tests.dist._common import TINY_MOE, make_batch, write_json

T = 16
MICRO_BATCH_SIZE = 2
MESHES = {"dp": MeshConfig(), "tp2_sp": MeshConfig(tp=2, sequence_parallel=True)}


def _global_batch(B: int) -> dict[str, torch.Tensor]:
    b = make_batch(B=B, T=T, seed=11)
    b["seq_lens"] = torch.full((B,), T)  # equal rows: every micro-batch has the same token count
    prompt = 3
    b["loss_mask"] = torch.arange(T).unsqueeze(0).expand(B, T) >= prompt
    b["input_ids"] = b["input_ids"].clamp_min(1)
    return b


def run_case(mesh: MeshConfig, B: int) -> dict[str, Any]:
    learner = Learner(TINY_MOE, LearnerConfig(mesh=mesh, routing_replay=True, seed=5))
    glob = _global_batch(B)
    dp = max(learner.mesh.dp_ranks) + 1
    plan = RowPlan.build(glob["seq_lens"], dp=dp, num_mini_batches=2, micro_batch_size=MICRO_BATCH_SIZE)
    d = learner.mesh.dp_rank
    batch = {k: v[plan.local_rows(d)] for k, v in glob.items()}
    rep = StepReplay.for_step("R2", learner, batch, router_shift=True, sharded=True)
    old = learner.forward(
        batch, hooks=rep.old_pass_hooks(), local_rows=True, micro_batch_rows=plan.micro_batch_rows(d)
    )["logprobs"]
    metrics = rep.old_pass_metrics()
    batch["old_logp"] = old
    for sl, n_micro in zip(plan.mini_batch_slices(d), plan.micro_batches, strict=True):
        rows = torch.arange(sl.start, sl.stop)
        mb = {k: v[rows] for k, v in batch.items()}
        norm = float(loss_normaliser(mb["loss_mask"], "token-mean")) * dp

        def loss_fn(logp, ent, data, norm=norm):
            return policy_loss(
                logp, data["old_logp"], data["advantages"], data["loss_mask"], variant="grpo",
                clip_low=0.2, clip_high=0.28, agg="token-mean", normaliser=norm,
                token_weights=rep.token_weights(data),
            )  # fmt: skip

        hooks = rep.train_hooks(rows, num_micro_batches=n_micro)
        opts = learner.run_options(num_micro_batches=n_micro, local_rows=True)
        ts.forward_backward(learner.model, mb, loss_fn, opts, hooks=hooks)  # train_step without the update
    metrics.update(rep.step_metrics())
    out = {"peak": rep.peak_table_bytes, "store": rep.store_bytes, "local_rows": len(plan.local_rows(d))}
    out["metrics"] = metrics
    learner.close()
    return out


def main(rank: int, world: int, outdir: Path, cases: list[list] | None = None) -> None:
    res = {}
    for mesh, B in cases or []:
        res[f"{mesh}_b{B}"] = run_case(MESHES[mesh], B)
    write_json(outdir / f"rank{rank}.json", res)
