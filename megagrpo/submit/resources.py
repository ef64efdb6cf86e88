"""Does the job's shape (nodes x processes per node) fit the config's mesh, and the partition?

Both checks run before anything is submitted, so a wrong `--nodes`/`--gpus-per-node` costs a second
rather than a queue wait followed by a crash at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    m, world = cfg.mesh, shape.world_size
    dense, expert = m.tp * m.pp * m.cp, m.ep * m.etp * m.pp
    need = math.lcm(dense, expert, cfg.rollout.engine_tp)
    if world < need:
        raise MegagrpoError(
            f"{shape.describe()} is fewer than the mesh needs: at least {need} (mesh.tp*pp*cp = "
            f"{m.tp}*{m.pp}*{m.cp} = {dense}, mesh.ep*etp*pp = {m.ep}*{m.etp}*{m.pp} = {expert}, "
            f"rollout.engine_tp = {cfg.rollout.engine_tp}); request more, or shrink the mesh"
        )
    try:
        sizes = check_mesh(cfg, world, "eval" if stage == "check" else stage, on_gpu=shape.device == "gpu")
    except MegagrpoError as e:
        raise MegagrpoError(f"{shape.describe()}: {e}") from None
    if stage != "sft" and (
        cfg.rollout.engine_tp > shape.procs_per_node or shape.procs_per_node % cfg.rollout.engine_tp
    ):
        raise MegagrpoError(
            f"rollout.engine_tp = {cfg.rollout.engine_tp} must divide --gpus-per-node "
            f"{shape.procs_per_node}: each colocated SGLang engine lives on one node"
        )
    return sizes


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
