"""The memory plan of a megagrpo job from its config: one per-GPU plan when colocated (`plan/memory.py`),
a learner pool and an engine pool when disaggregated (`plan/pools.py`), each with the host side of its nodes
(`plan/host.py`). It sits above both, so that
`memory.py` never imports `pools.py`, which builds on its arithmetic."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.plan.engines import engine_span
from megagrpo.plan.host import host_plan
from megagrpo.plan.memory import MemoryPlan, plan_workload, workload_from_config
from megagrpo.plan.pools import DisaggregatedPlan, plan_disaggregated


def plan_memory(
    cfg: Any,
    arch: ModelArch,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_mem_gib: float = 80.0,
    host_mem_gib: float | None = None,
) -> MemoryPlan | DisaggregatedPlan:
    """The memory plan of megagrpo config `cfg` for `arch` on nodes x gpus_per_node GPUs: one per-GPU
    plan when colocated, a learner pool and an engine pool (`plan/pools.py`) when disaggregated; both with
    the host side of each node (`plan/host.py`), judged against `host_mem_gib` when given."""
    if nodes < 1 or gpus_per_node < 1:
        raise MegagrpoError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be >= 1")
    if cfg.rollout.placement.disaggregated:
        plan = plan_disaggregated(
            cfg, arch, nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib
        )
        host = host_plan(
            cfg, gpus_per_node=gpus_per_node, engines=plan.engine.engines, disaggregated=True,
            host_mem_gib=host_mem_gib,
        )  # fmt: skip
        span = engine_span(
            arch,
            plan.learner.workload,
            gpus_per_node=gpus_per_node,
            gpu_mem_gib=gpu_mem_gib,
            disaggregated=True,
        )
        return replace(plan, host=host, engine_span=span)
    w = workload_from_config(cfg, nodes * gpus_per_node)
    plan = plan_workload(arch, w, gpu_mem_gib=gpu_mem_gib)
    host = host_plan(
        cfg, gpus_per_node=gpus_per_node, engines=max(1, nodes * gpus_per_node // w.engine_tp),
        disaggregated=False, host_mem_gib=host_mem_gib,
    )  # fmt: skip
    span = engine_span(arch, w, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib, disaggregated=False)
    return replace(
        plan,
        host=host,
        engine_span=span,
        reasons=plan.reasons + host.reasons + span.reasons,
        fits=plan.fits and host.fits and span.fits,
    )
