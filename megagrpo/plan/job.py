"""The memory plan of a megagrpo job from its config: one per-GPU plan when colocated (`plan/memory.py`),
a learner pool and an engine pool when disaggregated (`plan/pools.py`), each with the host side of its nodes
(`plan/host.py`). It sits above both, so that
`memory.py` never imports `pools.py`, which builds on its arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from megagrpo.config.mesh_rules import colocated_world_unit
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.plan.engines import engine_span
from megagrpo.plan.host import host_plan
from megagrpo.plan.memory import MemoryPlan, plan_workload, workload_from_config
from megagrpo.plan.pools import DisaggregatedPlan, plan_disaggregated


@dataclass(frozen=True)
class Layout:
    """What a launch's world must be: `engine_ranks` GPUs of engines of their own (disaggregated; 0 when
    colocated) plus a positive multiple of `unit` GPUs (`why` names the sizes that make it)."""

    unit: int
    engine_ranks: int
    why: str

    def fits(self, world: int) -> bool:
        return world > self.engine_ranks and (world - self.engine_ranks) % self.unit == 0

    def nodes_from(self, nodes: int, gpus_per_node: int) -> int:
        """The fewest nodes >= `nodes` the layout fits on (one exists within `unit` more nodes)."""
        n = max(1, nodes)
        while not self.fits(n * gpus_per_node):
            n += 1
        return n


def layout_of(cfg: Any) -> Layout:
    """Colocated: the world is a multiple of the learner's dense product tp*pp*cp, its expert product
    ep*etp*pp and rollout.engine_tp (each engine takes engine_tp whole ranks). Disaggregated: the last
    rollout.num_engines x engine_tp ranks run engines, and the learner ranks before them are a multiple of
    the dense and expert products (`config.mesh_rules.rank_roles`)."""
    m, r = cfg.mesh, cfg.rollout
    dense, expert = m.tp * m.pp * m.cp, m.ep * m.etp * m.pp
    why = f"mesh.tp*pp*cp = {dense}, mesh.ep*etp*pp = {expert}"
    if r.placement.disaggregated:
        engines = (r.num_engines or 1) * r.engine_tp
        why += f"; and rollout.num_engines x engine_tp = {engines} engine ranks of their own"
        return Layout(math.lcm(dense, expert), engines, why)
    unit = colocated_world_unit(tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, etp=m.etp, engine_tp=r.engine_tp)
    return Layout(unit, 0, f"{why}, rollout.engine_tp = {r.engine_tp}")


def min_nodes(cfg: Any, gpus_per_node: int) -> int:
    """The fewest nodes of `gpus_per_node` GPUs a config's mesh and engines can be laid out on."""
    return layout_of(cfg).nodes_from(1, gpus_per_node)


def check_node_count(cfg: Any, nodes: int, gpus_per_node: int) -> None:
    """Refuse a node count the config cannot be laid out on, naming --nodes and the fewest that can: a
    model that needs 256 GPUs of expert parallelism (DeepSeek-V3's EP256) is refused on 16 nodes with
    "at least 32", rather than with a divisibility rule the user has to solve."""
    layout = layout_of(cfg)
    if layout.fits(nodes * gpus_per_node) or nodes * gpus_per_node <= layout.engine_ranks:
        return  # fits; or engines take every rank, which `rank_roles` refuses naming the placement
    least = min_nodes(cfg, gpus_per_node)
    if nodes < least:
        raise MegagrpoError(
            f"--nodes {nodes}: this config needs at least {least} nodes of {gpus_per_node} GPUs "
            f"({layout.why}); pass --nodes {least} or more, or shrink the mesh"
        )
    near = layout.nodes_from(nodes, gpus_per_node)
    raise MegagrpoError(
        f"--nodes {nodes}: {nodes} x {gpus_per_node} GPUs cannot be laid out ({layout.why}: the learner "
        f"ranks must be a multiple of {layout.unit}); the nearest node count above that can: --nodes {near}"
    )


FEWEST_NODES_TRIED = 32  # node counts the plan tries above a failing one: the search stays under a second


def _fewest_nodes(cfg: Any, arch: ModelArch, nodes: int, gpus_per_node: int, gpu_mem_gib: float) -> str:
    """The reason line naming the fewest nodes above `nodes` on which the colocated plan fits: more nodes
    mean more data parallelism, which shards Adam's state and the fp32 master copy (and nothing else);
    node counts the layout allows are tried, `FEWEST_NODES_TRIED` of them at most."""
    layout = layout_of(cfg)
    tried = [n for n in range(nodes + 1, nodes + 64 * layout.unit + 1) if layout.fits(n * gpus_per_node)]
    for n in tried[:FEWEST_NODES_TRIED]:
        w = workload_from_config(cfg, n * gpus_per_node)
        if plan_workload(arch, w, gpu_mem_gib=gpu_mem_gib).fits:
            return (
                f"--nodes {nodes}: the fewest nodes of {gpus_per_node} x {gpu_mem_gib:g} GiB GPUs this config "
                f"fits on are {n} (more data parallelism shards the optimizer state); pass --nodes {n} or more"
            )
    last = tried[:FEWEST_NODES_TRIED][-1]
    return (
        f"--nodes {nodes}: more nodes do not make it fit (up to {last} tried): the mesh's model parallelism "
        "leaves too much on each GPU; raise mesh.tp/pp/ep/etp or rollout.engine_tp"
    )


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
    check_node_count(cfg, nodes, gpus_per_node)
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
    if not plan.fits:
        plan = replace(
            plan, reasons=(*plan.reasons, _fewest_nodes(cfg, arch, nodes, gpus_per_node, gpu_mem_gib))
        )
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
