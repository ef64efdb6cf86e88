"""The memory plan of a megagrpo job from its config: one per-GPU plan when colocated (`plan/memory.py`),
a learner pool and an engine pool when disaggregated (`plan/pools.py`). It sits above both, so that
`memory.py` never imports `pools.py`, which builds on its arithmetic."""

from __future__ import annotations

from typing import Any

from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.plan.memory import MemoryPlan, plan_workload, workload_from_config
from megagrpo.plan.pools import DisaggregatedPlan, plan_disaggregated


def plan_memory(
    cfg: Any, arch: ModelArch, *, nodes: int, gpus_per_node: int, gpu_mem_gib: float = 80.0
) -> MemoryPlan | DisaggregatedPlan:
    """The memory plan of megagrpo config `cfg` for `arch` on nodes x gpus_per_node GPUs: one per-GPU
    plan when colocated, a learner pool and an engine pool (`plan/pools.py`) when disaggregated."""
    if nodes < 1 or gpus_per_node < 1:
        raise MegagrpoError(f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be >= 1")
    if cfg.rollout.placement.disaggregated:
        return plan_disaggregated(
            cfg, arch, nodes=nodes, gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem_gib
        )
    return plan_workload(arch, workload_from_config(cfg, nodes * gpus_per_node), gpu_mem_gib=gpu_mem_gib)
