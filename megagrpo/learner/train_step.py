"""One optimizer step: forward+backward over micro-batches under megatron's schedule, then the optimizer.

The loss callback (`forward.LossFn`) sees each micro-batch's `logp [b, T]`, `entropy [b, T]` and its
slice of the batch, and returns that micro-batch's loss already divided by the GLOBAL normaliser
(`megagrpo.algo.aggregation.loss_normaliser`, computed once on the whole batch). Micro-batch losses
are therefore summed, never averaged: megatron's schedule runs with `calculate_per_token_loss=True`
(no division by the micro-batch count) and DDP sums gradients over data-parallel ranks, so the
result does not depend on the DP size, the micro-batch count or the PP schedule.

Metrics returned by `forward_backward` are reduced over micro-batches and DP ranks with the reductions
registered in `megagrpo.algo.metrics.REDUCTIONS` (sums for the globally normalised loss terms and
counts, count-weighted means, min/max), so they equal the full-batch numbers, and are identical on
every rank (the last pipeline stage broadcasts them). `loss_fn` may only return registered names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megagrpo.algo.metrics import all_reduce_metrics, merge_metrics
from megagrpo.learner.forward import ForwardHooks, LossFn, RunOptions, run_schedule
from megagrpo.learner.model import model_config


def _finalize(force_all_reduce_default: bool):
    from megatron.core.distributed import finalize_model_grads

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        # num_tokens is ignored on purpose: losses are already globally normalised.
        finalize_model_grads(
            model,
            None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce or force_all_reduce_default,
        )

    return finalize


def prepare(model: list[Any], optimizer: Any | None = None) -> None:
    """Point the shared TransformerConfig at this model's grad finalisation and no-sync contexts."""
    config = model_config(model)
    config.finalize_model_grads_func = _finalize(False)
    config.no_sync_func = [c.no_sync for c in model] if len(model) > 1 else model[0].no_sync
    if optimizer is not None:
        config.grad_scale_func = optimizer.scale_loss


def reduce_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """Merge the micro-batch metrics (megagrpo.algo.metrics reductions), then over DP ranks, then hand
    the last pipeline stage's result to every stage."""
    from megatron.core import parallel_state

    merged: dict[str, float] = {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        parts = [r["metrics"] for r in records]
        reduced = merge_metrics(parts) if parts and parts[0] else {}
        if reduced and parallel_state.get_data_parallel_world_size() > 1:
            reduced = all_reduce_metrics(reduced, group=parallel_state.get_data_parallel_group())
        merged = {k: float(v) for k, v in reduced.items()}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        box = [merged]
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=last, group=parallel_state.get_pipeline_model_parallel_group())
        merged = box[0]
    return merged


def forward_backward(
    model: list[Any],
    batch: dict[str, torch.Tensor],
    loss_fn: LossFn,
    opts: RunOptions,
    *,
    force_all_reduce: bool = False,
    hooks: ForwardHooks | None = None,
) -> dict[str, float]:
    """Zero the grad buffers, run forward+backward over this rank's micro-batches, finalise the grads
    (DP reduction, SP norm and embedding all-reduces). Returns reduced metrics (see module doc)."""
    prepare(model)
    for chunk in model:
        chunk.zero_grad_buffer()
    _, records = run_schedule(
        model,
        batch,
        opts,
        loss_fn=loss_fn,
        forward_only=False,
        force_all_reduce=force_all_reduce,
        hooks=hooks,
    )
    return reduce_metrics(records)


def optimizer_step(optimizer: Any, scheduler: Any | None) -> dict[str, float]:
    """Clip, step, advance the LR schedule. Returns `loss/grad_norm`, `loss/lr`, `loss/update_skipped`."""
    lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else 0.0  # the LR this step uses
    ok, grad_norm, _ = optimizer.step()
    if ok and scheduler is not None:
        scheduler.step(increment=1)
    optimizer.zero_grad()
    return {
        "loss/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "loss/lr": float(lr),
        "loss/update_skipped": 0.0 if ok else 1.0,
    }


def train_step(
    model: list[Any],
    optimizer: Any,
    scheduler: Any | None,
    batch: dict[str, torch.Tensor],
    loss_fn: LossFn,
    opts: RunOptions,
    *,
    hooks: ForwardHooks | None = None,
) -> dict[str, float]:
    """`forward_backward` then `optimizer_step`; the merged metrics."""
    prepare(model, optimizer)
    metrics = forward_backward(model, batch, loss_fn, opts, hooks=hooks)
    metrics.update(optimizer_step(optimizer, scheduler))
    return metrics
