"""Does the job's shape (nodes x processes per node) fit the config's mesh, and the partition?

Both checks run before anything is submitted, so a wrong `--nodes`/`--gpus-per-node` costs a second
rather than a queue wait followed by a crash at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagrpo.config.mesh_rules import engine_node_of, engine_nodes
from megagrpo.config.schema import Config, MeshSizes, check_mesh
from megagrpo.errors import MegagrpoError
from megagrpo.submit.slurm import PartitionInfo


@dataclass(frozen=True)
class JobShape:
    nodes: int
    procs_per_node: int  # GPUs per node (gpu mode) or CPU processes per node (cpu mode)
    device: str  # "gpu" | "cpu"
    cpus_per_proc: int = 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def describe(self) -> str:
        unit = "GPUs" if self.device == "gpu" else "processes"
        return f"--nodes {self.nodes} x --gpus-per-node {self.procs_per_node} = {self.world_size} {unit}"


def check_mesh_fits(cfg: Config, shape: JobShape, stage: str = "train") -> MeshSizes:
    """The mesh against nodes x processes per node: too few, or the rules of `check_mesh` (too many, not
    dividing), plus the one rule of a job's shape: an engine lives on one node."""
    if shape.nodes < 1 or shape.procs_per_node < 1:
        raise MegagrpoError(f"--nodes and --gpus-per-node must be >= 1 (got {shape.describe()})")
    m, r, world = cfg.mesh, cfg.rollout, shape.world_size
    dense, expert = m.tp * m.pp * m.cp, m.ep * m.etp * m.pp
    disaggregated = stage != "sft" and r.placement.disaggregated
    if disaggregated:
        engine_ranks = (r.num_engines or 1) * r.engine_tp
        need = math.lcm(dense, expert) + engine_ranks
        engines = (
            f"; and the engines: rollout.num_engines * engine_tp = {r.num_engines or 1}*{r.engine_tp} = "
            f"{engine_ranks} ranks of their own (rollout.placement.kind=disaggregated)"
        )
    else:
        need, engines = math.lcm(dense, expert, r.engine_tp), f", rollout.engine_tp = {r.engine_tp}"
    if world < need:
        raise MegagrpoError(
            f"{shape.describe()} is fewer than the mesh needs: at least {need} (mesh.tp*pp*cp = "
            f"{m.tp}*{m.pp}*{m.cp} = {dense}, mesh.ep*etp*pp = {m.ep}*{m.etp}*{m.pp} = {expert}"
            f"{engines}); request more, or shrink the mesh"
        )
    try:
        sizes = check_mesh(cfg, world, "eval" if stage == "check" else stage, on_gpu=shape.device == "gpu")
    except MegagrpoError as e:
        raise MegagrpoError(f"{shape.describe()}: {e}") from None
    if disaggregated:
        check_engines_within_nodes(sizes, r.engine_tp, shape)
    elif stage != "sft" and cfg.rollout.engine_tp > shape.procs_per_node:
        raise MegagrpoError(
            f"rollout.engine_tp = {cfg.rollout.engine_tp} is more than the {shape.procs_per_node} GPUs of a "
            "node: an engine over several nodes runs in the disaggregated placement only (set "
            "rollout.placement.kind=disaggregated): there its weights reach every node's schedulers over "
            "SGLang's update_weights_from_distributed, while the colocated handoff passes CUDA IPC handles, "
            "which do not leave a node"
        )
    elif stage != "sft" and shape.procs_per_node % cfg.rollout.engine_tp:
        raise MegagrpoError(
            f"rollout.engine_tp = {cfg.rollout.engine_tp} must divide --gpus-per-node "
            f"{shape.procs_per_node}: each colocated SGLang engine lives on one node"
        )
    return sizes


def check_engines_within_nodes(sizes: MeshSizes, engine_tp: int, shape: JobShape) -> None:
    """Disaggregated: every engine's engine_tp ranks on one node, or (engine_tp more than a node's GPUs)
    on whole nodes of their own (`config.mesh_rules.engine_nodes`: SGLang's multi-node engine). The engines
    take the ranks after the learner's `sizes.learners` (`config.mesh_rules.rank_roles`), and ranks fill
    nodes in order, so the learner's share of its last node must leave whole engines there. MegagrpoError
    naming the engine and the fields to change otherwise."""
    per_node = shape.procs_per_node
    span = engine_nodes(engine_tp, per_node)
    for e in range(sizes.num_engines):
        first = sizes.learners + e * engine_tp
        last = first + engine_tp - 1
        if span > 1:
            # whole nodes by construction: the world and every engine (span x per_node ranks) are whole
            # nodes, so the learner's ranks before them are too
            continue
        if first // per_node == last // per_node:
            continue
        # With engine_tp dividing the node, learners = world - num_engines * engine_tp is a multiple of
        # engine_tp on its last node too, so no engine can cross; only an engine_tp that does not divide does.
        raise MegagrpoError(
            f"{shape.describe()}: rollout.engine_tp={engine_tp}: engine {e} of the disaggregated "
            f"placement would take ranks {first}-{last}, across nodes {first // per_node} and "
            f"{last // per_node}; an engine's ranks must share one node (its first rank starts the SGLang "
            f"server on engine_tp GPUs of its node). The learner takes ranks 0-{sizes.learners - 1}, so "
            f"node {sizes.learners // per_node} has {per_node - sizes.learners % per_node} GPUs left for "
            f"engines: set rollout.engine_tp to a divisor of --gpus-per-node {per_node} (the learner's "
            "share of a node then leaves whole engines), or change --gpus-per-node"
        )


def role_layout(sizes: MeshSizes, engine_tp: int, shape: JobShape) -> list[str]:
    """Per node, which GPUs (processes on the CPU) learn and which serve rollouts, by rank index."""
    unit = ("GPU", "GPUs") if shape.device == "gpu" else ("process", "processes")
    per_node, out = shape.procs_per_node, []
    for node in range(shape.nodes):
        lo, hi = node * per_node, (node + 1) * per_node
        parts = []
        if lo < sizes.learners:
            end = min(hi, sizes.learners)
            parts.append(f"learner {_span(unit, 0, end - lo)} ({_span(('rank', 'ranks'), lo, end)})")
        if hi > sizes.learners:
            start = max(lo, sizes.learners)
            span = engine_nodes(engine_tp, per_node)
            if span > 1:  # this node is one SGLang node of a multi-node engine, started by its first rank
                node_of = engine_node_of(start, sizes.learners, engine_tp, per_node)
                engines = (
                    f"engine {node_of.engine} of engine_tp {engine_tp}, its SGLang node_rank "
                    f"{node_of.node_rank} of nnodes {node_of.nnodes}, started by rank {start}"
                    if node_of is not None
                    else f"engines of engine_tp {engine_tp}"
                )
            else:
                engines = (
                    _span(
                        ("engine", "engines"),
                        (start - sizes.learners) // engine_tp,
                        (hi - 1 - sizes.learners) // engine_tp + 1,
                    )
                    + f" of engine_tp {engine_tp}"
                )
            parts.append(
                f"rollout {_span(unit, start - lo, per_node)} ({_span(('rank', 'ranks'), start, hi)}: "
                f"{engines})"
            )
        out.append(f"node {node}: " + ", ".join(parts))
    return out


def _span(noun: tuple[str, str], lo: int, hi: int) -> str:
    """The half-open range [lo, hi) of a (singular, plural) noun: 'GPU 3', 'GPUs 0-7'."""
    return f"{noun[0]} {lo}" if hi - lo == 1 else f"{noun[1]} {lo}-{hi - 1}"


def mesh_warnings(cfg: Config, shape: JobShape) -> list[str]:
    """Legal but slow layouts worth a word before a multi-node job starts."""
    out = []
    if shape.nodes > 1 and shape.procs_per_node % (cfg.mesh.tp * cfg.mesh.cp):
        out.append(
            f"mesh.tp*cp = {cfg.mesh.tp * cfg.mesh.cp} does not divide --gpus-per-node {shape.procs_per_node}: "
            "tensor/context-parallel groups will span nodes (slow over the network)"
        )
    return out


def check_partition_fits(shape: JobShape, part: PartitionInfo) -> None:
    """The partition has the nodes, and each node the GPUs (gpu mode) or CPUs (cpu mode), requested."""
    if shape.nodes > part.nodes:
        raise MegagrpoError(
            f"--nodes {shape.nodes}: partition {part.name!r} has only {part.nodes} node(s); request fewer "
            "nodes or pick another --partition"
        )
    if shape.device == "gpu":
        if part.gpus_per_node == 0:
            raise MegagrpoError(
                f"partition {part.name!r} has no GPUs (no gpu gres in sinfo); pick a GPU partition, or pass "
                "--device cpu to run CPU processes with gloo"
            )
        if shape.procs_per_node > part.gpus_per_node:
            raise MegagrpoError(
                f"--gpus-per-node {shape.procs_per_node}: nodes of partition {part.name!r} have "
                f"{part.gpus_per_node} GPUs; request at most {part.gpus_per_node}"
            )
    cpus = shape.procs_per_node * shape.cpus_per_proc
    if part.cpus_per_node and cpus > part.cpus_per_node:
        raise MegagrpoError(
            f"{shape.procs_per_node} processes x --cpus-per-proc {shape.cpus_per_proc} = {cpus} CPUs per node, "
            f"but nodes of partition {part.name!r} have {part.cpus_per_node}; lower --cpus-per-proc or "
            "--gpus-per-node"
        )
