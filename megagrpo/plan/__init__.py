"""Planning a job before it runs: the per-GPU memory plan (`megagrpo plan`, checked by `megagrpo submit`)."""

from megagrpo.plan.job import plan_memory
from megagrpo.plan.memory import (
    MemoryPlan,
    PlanMesh,
    StateBytes,
    Workload,
    activation_bytes,
    learner_state_bytes,
    plan_workload,
    workload_from_config,
)
from megagrpo.plan.pools import DisaggregatedPlan, EnginePool, LearnerPool, plan_disaggregated

__all__ = [
    "DisaggregatedPlan",
    "EnginePool",
    "LearnerPool",
    "MemoryPlan",
    "PlanMesh",
    "StateBytes",
    "Workload",
    "activation_bytes",
    "learner_state_bytes",
    "plan_disaggregated",
    "plan_memory",
    "plan_workload",
    "workload_from_config",
]
