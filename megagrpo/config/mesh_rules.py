"""The learner-mesh rules, written once.

Two kinds of rule: those of the layout alone (`layout_problems`: sizes, sequence parallelism, virtual
pipeline stages), and those against a world size (`mesh_sizes`: the dense and expert products must divide
it; DP is inferred). The schema applies the layout rules at validation, `megagrpo.config.check_mesh` adds
the world size and the batch before any process group or engine starts (train, sft and eval through the
CLI, and `megagrpo submit`), and `megagrpo.learner.mesh.MeshConfig` applies the same functions to meshes
built without a config (distributed tests, tools, `launch/mesh_check.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megagrpo.errors import MegagrpoError


def needs_sequence_parallel(tp: int, ep: int) -> bool:
    """megatron-core refuses expert parallelism combined with tensor parallelism without sequence parallelism."""
    return tp > 1 and ep > 1


def layout_problems(
    *,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    cp: int,
    sequence_parallel: bool,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[str, str]]:
    """Broken layout rules as (field under `mesh.`, message); empty when the layout is possible."""
    out: list[tuple[str, str]] = []
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp), ("cp", cp)):
        if v < 1:
            out.append((name, f"{v} must be >= 1"))
    if out:
        return out
    if sequence_parallel and tp == 1:
        out.append(("sequence_parallel", "true needs tp > 1; set mesh.sequence_parallel=false or tp >= 2"))
    if needs_sequence_parallel(tp, ep) and not sequence_parallel:
        out.append(
            (
                "sequence_parallel",
                f"false with tp={tp} and ep={ep}; megatron-core requires sequence parallelism when expert "
                "and tensor parallelism are combined: set mesh.sequence_parallel=true",
            )
        )
    if vpp is not None and (vpp < 1 or (vpp > 1 and pp == 1)):
        out.append(("vpp", f"{vpp} needs pp > 1 and vpp >= 1; set vpp to null"))
    for name, v in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers)):
        if v is not None and v < 1:
            out.append((name, f"{v}: a pipeline stage holds at least one layer; set it >= 1 or null"))
        elif v is not None and pp == 1:
            out.append((name, f"{v} needs pp > 1 (one stage holds every layer); set it to null"))
    if cp > 1:
        # megatron-core leaves the context-parallel split to the caller (each CP rank takes 2 of the 2*cp
        # chunks of every sequence, and logprobs and losses are reduced over CP); the learner does neither.
        out.append(
            (
                "cp",
                f"{cp}: context parallelism is not supported yet (the learner neither splits sequences "
                "over CP ranks nor reduces logprobs and losses over CP, so every CP rank would train on "
                "the whole batch); set mesh.cp=1 and use tp/pp/ep for long sequences",
            )
        )
    return out


def check_layout(**layout: int | bool | None) -> None:
    """`layout_problems` (the same keyword arguments) as one MegagrpoError naming every broken field."""
    problems = layout_problems(**layout)  # type: ignore[arg-type]
    if problems:
        raise MegagrpoError("; ".join(f"mesh.{f}: {m}" for f, m in problems))


def stage_layer_counts(
    num_layers: int,
    pp: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    vpp: int | None = None,
) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage, by megatron-core's rule (`get_num_layers_to_build` with
    `num_layers_in_first/last_pipeline_stage`): the first and last stages hold the counts set, the other
    stages split the rest evenly; unset, every stage is a middle stage. A model whose layer count divides by
    no pipeline size (DeepSeek-V3's 61) needs the ends set. MegagrpoError naming `mesh.*` when the counts
    cannot add up to `num_layers`; stage 0 holds layers [0, counts[0]), and so on in order."""
    chunks = vpp if vpp and vpp > 1 else 1
    ends = {"first_stage_layers": first_stage_layers, "last_stage_layers": last_stage_layers}
    for name, v in ends.items():
        if v is not None and (pp == 1 or v < 1):
            raise MegagrpoError(f"mesh.{name}: {v} needs pp > 1 and at least 1 layer; set it to null")
        if v is not None and v % chunks:
            raise MegagrpoError(
                f"mesh.{name}: {v} layers do not split into mesh.vpp={vpp} virtual chunks; make it a multiple "
                f"of {vpp}"
            )
    first = first_stage_layers or 0
    last = last_stage_layers or 0
    middle_stages = pp - sum(v is not None for v in ends.values())
    rest = num_layers - first - last
    layout = f"num_layers={num_layers}, mesh.pp={pp}, first_stage_layers={first_stage_layers}, " + (
        f"last_stage_layers={last_stage_layers}"
    )
    if rest < 0 or (middle_stages == 0 and rest > 0) or (middle_stages > 0 and rest < middle_stages):
        raise MegagrpoError(
            f"mesh: {layout}: the stage layer counts do not add up to the model's {num_layers} layers "
            f"({rest} left for {middle_stages} other stage(s), each needs at least one); change "
            "mesh.first_stage_layers / mesh.last_stage_layers (or mesh.pp)"
        )
    if middle_stages and rest % (middle_stages * chunks):
        hint = (
            "set mesh.first_stage_layers and/or mesh.last_stage_layers so that the rest divides"
            if not (first_stage_layers or last_stage_layers)
            else "change mesh.first_stage_layers / mesh.last_stage_layers"
        )
        raise MegagrpoError(
            f"mesh: {layout}: the {rest} layers of the other {middle_stages} stage(s) do not split evenly"
            f"{f' into {chunks} virtual chunks each' if chunks > 1 else ''}; {hint}"
        )
    per = rest // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    return tuple(counts)


def layers_of_stage(counts: Sequence[int], stage: int) -> range:
    """Global indices of the decoder layers of pipeline `stage`, given `stage_layer_counts`."""
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


@dataclass(frozen=True)
class WorldSplit:
    dp: int  # data-parallel size: world / (tp * pp * cp)
    expert_dp: int  # expert data-parallel size: world / (ep * etp * pp)


def mesh_sizes(world_size: int, *, tp: int, pp: int, ep: int, etp: int, cp: int) -> WorldSplit:
    """DP and expert DP of a layout on `world_size` ranks; MegagrpoError naming the sizes if they do not divide."""
    if world_size < 1:
        raise MegagrpoError(f"world size {world_size} must be >= 1")
    dense = tp * pp * cp
    if world_size % dense:
        raise MegagrpoError(
            f"mesh: tp*pp*cp = {tp}*{pp}*{cp} = {dense} does not divide the world size {world_size}; "
            f"choose mesh sizes whose product divides {world_size} (DP is inferred as the quotient), or "
            "change the number of processes"
        )
    expert = ep * etp * pp
    if world_size % expert:
        raise MegagrpoError(
            f"mesh: ep*etp*pp = {ep}*{etp}*{pp} = {expert} does not divide the world size {world_size}; "
            "choose expert sizes whose product divides it, or change the number of processes"
        )
    return WorldSplit(dp=world_size // dense, expert_dp=world_size // expert)


def colocated_world_unit(*, tp: int, pp: int, cp: int, ep: int, etp: int, engine_tp: int) -> int:
    """The GPUs a colocated launch's world must be a multiple of: the learner's dense product tp*pp*cp,
    its expert product ep*etp*pp, and engine_tp (each engine takes engine_tp whole ranks)."""
    return math.lcm(tp * pp * cp, ep * etp * pp, engine_tp)


def engine_count(world_size: int, engine_tp: int, num_engines: int | None, *, on_gpu: bool) -> int:
    """How many samplers a run starts: world / engine_tp on GPUs (one per colocation group of engine_tp
    ranks), `rollout.num_engines` (default 1) on the CPU. MegagrpoError naming the field otherwise."""
    if world_size % engine_tp:
        raise MegagrpoError(
            f"rollout.engine_tp: {engine_tp} does not divide the world size {world_size}; "
            "each colocated engine needs engine_tp whole ranks"
        )
    if on_gpu:
        n = world_size // engine_tp
        if num_engines is not None and num_engines != n:
            raise MegagrpoError(
                f"rollout.num_engines: {num_engines} on GPUs, where colocated engines are one per "
                f"engine_tp={engine_tp} GPUs, i.e. {n} on {world_size} GPUs; set it to null (or {n}), or "
                "change rollout.engine_tp"
            )
        return n
    n = 1 if num_engines is None else num_engines
    if n > world_size:
        raise MegagrpoError(
            f"rollout.num_engines: {n} CPU engines on {world_size} ranks; each engine is owned by one rank, "
            f"so use at most {world_size}"
        )
    return n


def engine_nodes(engine_tp: int, gpus_per_node: int) -> int:
    """Nodes one SGLang engine spans: 1 when its engine_tp GPUs fit on one node, else
    engine_tp / gpus_per_node whole nodes:
    SGLang's multi-node tensor (and expert) parallelism, one server process per node (`ServerArgs.nnodes`,
    `node_rank`, `dist_init_addr`). MegagrpoError naming rollout.engine_tp when it spans nodes but takes
    part of one."""
    if engine_tp <= gpus_per_node:
        return 1  # whether engines straddle nodes then is checked where the ranks are placed (submit)
    if engine_tp % gpus_per_node:
        raise MegagrpoError(
            f"rollout.engine_tp={engine_tp} spans nodes of {gpus_per_node} GPUs but is not a multiple of "
            f"{gpus_per_node}: an engine over several nodes takes whole nodes (SGLang's nnodes); use "
            f"{-(-engine_tp // gpus_per_node) * gpus_per_node}"
        )
    return engine_tp // gpus_per_node


@dataclass(frozen=True)
class EngineNode:
    """The part of one SGLang engine that a rank starts: SGLang node `node_rank` of `nnodes`
    (`ServerArgs.node_rank`, `nnodes`); node 0 serves HTTP, the others run their schedulers only."""

    engine: int
    node_rank: int
    nnodes: int


def engine_node_of(
    rank: int, first_engine_rank: int, engine_tp: int, gpus_per_node: int
) -> EngineNode | None:
    """Which engine node `rank` starts, when engines of engine_tp ranks follow one another from
    `first_engine_rank` (disaggregated: the ranks after the learner's) and ranks fill nodes in order: the
    first rank of an engine on each of its nodes starts that node's server; None for every other rank (its
    GPU is that server's) and for ranks before `first_engine_rank`."""
    if rank < first_engine_rank:
        return None
    engine, within = divmod(rank - first_engine_rank, engine_tp)
    nnodes = engine_nodes(engine_tp, gpus_per_node)
    per = engine_tp // nnodes  # ranks of the engine on each of its nodes
    if within % per:
        return None
    return EngineNode(engine=engine, node_rank=within // per, nnodes=nnodes)


@dataclass(frozen=True)
class Roles:
    """How a launch's ranks split between the learner and the samplers."""

    learners: int  # the learner's world: the first `learners` ranks
    engines: int  # SGLang engines
    engine_ranks: int  # ranks that run engines only (disaggregated); 0 when colocated

    def engine_of(self, rank: int, engine_tp: int) -> int | None:
        """The engine an engine rank serves (its first rank owns the server), None for a learner rank."""
        return None if rank < self.learners else (rank - self.learners) // engine_tp


def rank_roles(
    world_size: int, engine_tp: int, num_engines: int | None, *, disaggregated: bool, on_gpu: bool
) -> Roles:
    """Learner ranks, engines and engine-only ranks of a launch of `world_size` ranks.

    Colocated: every rank learns and `engine_count` engines share their devices. Disaggregated
    (`rollout.placement.kind`): the last `num_engines * engine_tp` ranks (default one engine) run SGLang
    servers only, one rank per GPU on GPUs (per CPU process on CPUs: an engine of TP t there runs t SGLang
    schedulers over gloo, `compat.sglang_cpu`), so an engine of TP t spans t ranks whose first runs the server.
    MegagrpoError naming the field when no rank would be left to learn."""
    if not disaggregated:
        return Roles(world_size, engine_count(world_size, engine_tp, num_engines, on_gpu=on_gpu), 0)
    n = 1 if num_engines is None else num_engines
    ranks = n * engine_tp
    if ranks >= world_size:
        raise MegagrpoError(
            f"rollout.placement.kind=disaggregated: {n} engine(s) of engine_tp={engine_tp} take {ranks} of "
            f"the {world_size} ranks, leaving none to learn; launch more processes (at least {ranks + 1}) or "
            "lower rollout.num_engines"
        )
    return Roles(world_size - ranks, n, ranks)


@dataclass(frozen=True)
class StageRoute:
    """A learner rank sends pipeline stage `stage` of the model to engine `engine` (disaggregated, PP > 1:
    `sync.stages`)."""

    engine: int
    stage: int


def stage_routes(num_engines: int, pipeline_groups: Sequence[Sequence[int]], rank: int) -> list[StageRoute]:
    """The routes of `rank`. Engine e is fed by one pipeline group, `pipeline_groups[e * G // num_engines]`
    (G groups, each the global ranks of one model replica's stages in stage order), every rank with its
    own stage: the engines are spread over the replicas, so no rank feeds two engines while G >= the
    engine count. Any replica will do (every one holds the same weights), so the engine's owner need not
    be among its senders."""
    groups = sorted((list(g) for g in pipeline_groups), key=lambda g: g[0])
    routes = []
    for e in range(num_engines):
        group = groups[e * len(groups) // num_engines]
        if rank in group:
            routes.append(StageRoute(engine=e, stage=group.index(rank)))
    return routes


def engines_fed(learners: int, pp: int, engines: int) -> int:
    """The most engines one learner rank sends weights to: 1 with PP 1 (each owner feeds its own engine);
    with PP > 1 the engines are spread over the learners / pp pipeline groups (`stage_routes`)."""
    if pp == 1:
        return 1
    return -(-engines // (learners // pp))
