"""The process mesh: who am I (rank/world from any launcher), and megatron-core's TP×CP×EP×DP×PP groups.

`DistEnv.from_environ()` is THE one code path that reads launcher variables (torchrun, srun, mpirun).
`init_mesh()` starts torch.distributed (gloo on CPU, nccl on GPU), builds megatron-core's
`parallel_state` groups in its default rank order "tp-cp-ep-dp-pp" (DP inferred from the world size)
and seeds megatron's RNG tracker. `destroy_mesh()` undoes both so a process can build another mesh
(the distributed tests run many meshes in one launch).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megagrpo.config.mesh_rules import check_layout, mesh_sizes, stage_layer_counts
from megagrpo.errors import MegagrpoError
from megagrpo.net import free_port


@dataclass(frozen=True)
class MeshConfig:
    tp: int = 1  # tensor parallel (attention, dense MLP, vocab)
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    cp: int = 1  # context parallel
    sequence_parallel: bool = False  # shard norm/dropout activations over TP; required when tp>1 and ep>1
    vpp: int | None = None  # virtual pipeline chunks per stage (interleaved 1F1B); None = 1
    first_stage_layers: int | None = None  # decoder layers of the first stage; None = an even share
    last_stage_layers: int | None = None  # decoder layers of the last stage; None = an even share

    def validate(self) -> None:
        """The layout rules of `megagrpo.config.mesh_rules` (the schema applies the same ones), plus one
        that depends on the device."""
        check_layout(
            tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp,
            sequence_parallel=self.sequence_parallel, vpp=self.vpp,
            first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
        )  # fmt: skip
        if self.vpp is not None and self.vpp > 1 and not torch.cuda.is_available():
            # Seen here: megatron's interleaved 1F1B with variable sequence lengths stalls in a gloo p2p
            # send during the training pass (forward-only works). Not supported on CPU meshes.
            raise MegagrpoError(
                f"mesh.vpp={self.vpp}: the interleaved pipeline schedule is GPU-only here; set vpp to null"
            )

    def stage_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage (`config.mesh_rules.stage_layer_counts`)."""
        return stage_layer_counts(
            num_layers, self.pp, self.first_stage_layers, self.last_stage_layers, self.vpp
        )

    def data_parallel_size(self, world_size: int) -> int:
        """DP inferred as world / (tp*cp*pp); raises MegagrpoError naming the sizes if it does not divide."""
        self.validate()
        return mesh_sizes(world_size, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp).dp


# Set by the entry of a disaggregated launch (`trainer.entry`): the learner's world is the launch's first
# ranks, the rest run engines (`config.mesh_rules.rank_roles`), so a learner's process group spans those.
LEARNERS_ENV = "MEGAGRPO_LEARNERS"


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "srun" | "mpirun" | "mpi4py" | "single"
    node_rank: int = 0  # index of this process's node (torchrun GROUP_RANK, SLURM_NODEID, MPI node)
    nodes: int = 1  # nodes the launch spans (torchrun GROUP_WORLD_SIZE, SLURM_STEP_NUM_NODES, MPI)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Rank/world/local rank from torchrun, srun or mpirun variables (in that order of precedence).

        torchrun (and any launcher that exports RANK/WORLD_SIZE) wins because under Slurm or MPI a
        torchrun child still sees the outer SLURM_*/OMPI_* variables of its parent step. No variables at
        all means one process on 127.0.0.1. `MEGAGRPO_BOOTSTRAP=mpi4py` asks for MPI itself (any MPI, e.g.
        under `srun --mpi=pmix`): ranks from COMM_WORLD, rank 0's host and a free port broadcast to all.
        """
        env = dict(os.environ if environ is None else environ)
        node, nodes = 0, 1
        launcher = _launcher(env)
        if launcher == "mpi4py":
            rank, world, local, node, nodes = _mpi4py_bootstrap(env)  # also fills MASTER_ADDR/PORT in `env`
        elif launcher == "torchrun":
            rank, world = _int(env, "RANK"), _world(env, launcher)
            local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
            node = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else 0
            nodes = _int(env, "GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in env else 1
        elif launcher == "mpirun":
            rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _world(env, launcher)
            local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
            if "OMPI_COMM_WORLD_LOCAL_SIZE" in env:  # by-slot mapping (mpirun's default) fills nodes in order
                per_node = max(1, _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))
                node, nodes = rank // per_node, -(-world // per_node)
        elif launcher == "srun":
            rank, world = _int(env, "SLURM_PROCID"), _world(env, launcher)
            local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
            node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
            key = next((k for k in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES") if k in env), None)
            nodes = _int(env, key) if key else 1
        else:
            rank, world, local = 0, 1, 0
        if LEARNERS_ENV in env:  # a disaggregated launch: the engine ranks follow the learner's
            world = _int(env, LEARNERS_ENV)
        if not 0 <= rank < world:
            raise MegagrpoError(f"{launcher}: rank {rank} is outside world size {world}; check the launcher")
        addr = env.get("MASTER_ADDR") or _slurm_first_host(env) or ("127.0.0.1" if world == 1 else "")
        if not addr:
            raise MegagrpoError(
                f"{launcher} started {world} processes but MASTER_ADDR is not set; export MASTER_ADDR "
                "(and MASTER_PORT) to the address of rank 0"
            )
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        elif world == 1:
            port = free_port(
                "127.0.0.1"
            )  # a lone process needs no agreed port; a fixed one collides with other jobs
        else:
            port = 29500
        return cls(rank, world, local, addr, port, launcher, node, nodes)


def _launcher(env: Mapping[str, str]) -> str:
    """Which launcher started this process, by the precedence `DistEnv.from_environ` documents."""
    bootstrap = env.get(BOOTSTRAP_ENV, "auto")
    if bootstrap not in ("auto", "mpi4py"):
        raise MegagrpoError(
            f"{BOOTSTRAP_ENV}={bootstrap!r}: expected 'auto' (launcher variables) or 'mpi4py'"
        )
    if bootstrap == "mpi4py":
        return "mpi4py"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "mpirun"
    if "SLURM_PROCID" in env:
        return "srun"
    return "single"


def _world(env: Mapping[str, str], launcher: str) -> int:
    if launcher == "torchrun":
        return _int(env, "WORLD_SIZE")
    if launcher == "mpirun":
        return _int(env, "OMPI_COMM_WORLD_SIZE")
    if launcher == "srun":
        return _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
    return 1


def world_size_from_environ(environ: Mapping[str, str] | None = None) -> int | None:
    """The world size the launcher variables announce, without starting anything; None under the mpi4py
    bootstrap (MPI knows it only once initialised). Lets the CLI check the mesh before any process group."""
    env = os.environ if environ is None else environ
    launcher = _launcher(env)
    return None if launcher == "mpi4py" else _world(env, launcher)


BOOTSTRAP_ENV = "MEGAGRPO_BOOTSTRAP"


def _mpi4py_bootstrap(env: dict[str, str]) -> tuple[int, int, int, int, int]:
    """(rank, world, local rank, node index, node count) from mpi4py's COMM_WORLD; sets MASTER_ADDR/PORT in `env`
    from rank 0 (its host name and a free port) unless they are set already."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MegagrpoError(
            f"{BOOTSTRAP_ENV}=mpi4py but mpi4py cannot be imported ({e}); `pip install mpi4py` (the 'mpi' "
            f"extra) or unset {BOOTSTRAP_ENV} to use the launcher's variables"
        ) from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local = local_comm.Get_rank()
    # node index = rank of this node's first process among all nodes' first processes
    leaders = comm.allgather(rank if local == 0 else None)
    firsts = sorted(r for r in leaders if r is not None)
    node = firsts.index(local_comm.bcast(rank if local == 0 else None))
    local_comm.Free()
    addr, port = None, None
    if rank == 0:
        import socket

        addr = env.get("MASTER_ADDR") or socket.gethostname()
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:
            port = free_port()
    addr, port = comm.bcast((addr, port), root=0)
    env["MASTER_ADDR"], env["MASTER_PORT"] = addr, str(port)
    return rank, world, local, node, len(firsts)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError as e:
        raise MegagrpoError(f"environment variable {key}={env[key]!r} is not an integer") from e


def _slurm_first_host(env: Mapping[str, str]) -> str | None:
    """First host of SLURM_STEP_NODELIST/SLURM_NODELIST ("node[03-05,07]" -> "node03")."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if m is None:
        return None
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


# What SGLang's Engine sets (where unset) in the process that creates it, before its communicators exist.
# Set on every rank before init_process_group, so that the learner's NCCL communicators on the engine-owning
# ranks and on the others are built with the same settings (slurm/lib.sh exports the same values).
NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def set_nccl_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Give every rank SGLang's NCCL settings (`NCCL_DEFAULTS`), keeping any value the user exported."""
    environ = os.environ if environ is None else environ
    for key, value in NCCL_DEFAULTS.items():
        environ.setdefault(key, value)


@dataclass(frozen=True)
class Mesh:
    """`replica`: the ranks that train on the same rows (one DP rank's TP x CP x PP peers), as a process
    group (None when this rank is alone in it); its leader (`leader_of`) is its lowest global rank.
    `stage`: the replica's ranks of this rank's pipeline stage (its TP x CP peers), which also share the
    stage's MoE route layers; the stage leader receives the rows from the engines (`trainer.rows`) and
    hands them on within the stage. Without pipeline parallelism the stage is the replica."""

    config: MeshConfig
    env: DistEnv
    dp: int
    device: torch.device
    replica: dist.ProcessGroup | None = None
    dp_ranks: tuple[int, ...] = (0,)  # the DP rank of every global rank
    stage: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)  # the pipeline stage of every global rank

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks[self.env.rank]

    def leader_of(self, rank: int) -> int:
        """The lowest global rank of `rank`'s replica."""
        return self.dp_ranks.index(self.dp_ranks[rank])

    @property
    def replica_leader(self) -> int:
        return self.leader_of(self.env.rank)

    def stage_leaders(self) -> dict[tuple[int, int], int]:
        """(DP rank, pipeline stage) -> the lowest global rank of that stage; O(world)."""
        out: dict[tuple[int, int], int] = {}
        for r, key in enumerate(zip(self.dp_ranks, self.pp_ranks, strict=True)):
            out.setdefault(key, r)
        return out

    def stage_leader_of(self, rank: int) -> int:
        """The lowest global rank of `rank`'s stage (same DP rank and pipeline stage)."""
        return self.stage_leaders()[(self.dp_ranks[rank], self.pp_ranks[rank])]

    @property
    def stage_leader(self) -> int:
        return self.stage_leader_of(self.env.rank)

    def data_parallel_group(self):
        """megatron's DP group (ranks holding different rows), or None with one DP rank."""
        if self.dp == 1:
            return None
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()


def _rank_groups(keys: list[tuple[int, ...]], mine: tuple[int, ...]) -> dist.ProcessGroup | None:
    """One process group per distinct key over the ranks with that key (every rank creates every group,
    in the same order, as `new_group` requires); this rank's group, None when it is alone in it."""
    group: dist.ProcessGroup | None = None
    for key in sorted(set(keys)):
        ranks = [r for r in range(len(keys)) if keys[r] == key]
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if key == mine:
            group = g
    return group


def _replica_groups(dp_rank: int, pp_rank: int):
    """Every rank's DP rank and pipeline stage (one small object gather at start-up: megatron's rank order
    stays its own business), this rank's replica group (same DP rank) and stage group (same DP rank and
    stage; the replica itself without PP)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (int(dp_rank), int(pp_rank)))
    dp_ranks = tuple(d for d, _ in every)
    pp_ranks = tuple(p for _, p in every)
    replica = _rank_groups([(d,) for d in dp_ranks], (dp_rank,))
    if max(pp_ranks) == 0:
        return replica, dp_ranks, replica, pp_ranks
    stage = _rank_groups([tuple(k) for k in every], (dp_rank, pp_rank))
    return replica, dp_ranks, stage, pp_ranks


def init_mesh(
    mesh_cfg: MeshConfig, env: DistEnv | None = None, *, seed: int = 0, timeout_s: int = 600
) -> Mesh:
    """Start torch.distributed (if not yet) and megatron parallel_state for `mesh_cfg`; seed the RNGs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    env = env or DistEnv.from_environ()
    dp = mesh_cfg.data_parallel_size(env.world_size)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    set_nccl_defaults()
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    elif dist.get_world_size() != env.world_size:
        raise MegagrpoError(
            f"torch.distributed already runs with world size {dist.get_world_size()}, the environment says "
            f"{env.world_size}; launch with a consistent world size"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mesh_cfg.tp,
        pipeline_model_parallel_size=mesh_cfg.pp,
        virtual_pipeline_model_parallel_size=mesh_cfg.vpp if mesh_cfg.vpp and mesh_cfg.vpp > 1 else None,
        context_parallel_size=mesh_cfg.cp,
        expert_model_parallel_size=mesh_cfg.ep,
        expert_tensor_parallel_size=mesh_cfg.etp,
        distributed_timeout_minutes=max(1, timeout_s // 60),
        # Also on GPUs: megatron-core's optimizer asks for the gloo DP groups when it is built (without them
        # no optimizer can be made; seen on an H100), and the memory-efficient checkpoint gather of the
        # DistributedOptimizer state runs over them into the host memory of DP rank 0 only.
        create_gloo_process_groups=True,
    )
    # Same seed on every rank: megatron's tracker derives the TP/EP-specific streams from it, and the
    # default (data-parallel) stream must agree across model-parallel peers.
    torch.manual_seed(seed)
    mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    replica, dp_ranks, stage, pp_ranks = _replica_groups(
        parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    )
    return Mesh(
        mesh_cfg,
        env,
        dp,
        torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"),
        replica=replica,
        dp_ranks=dp_ranks,
        stage=stage,
        pp_ranks=pp_ranks,
    )


def destroy_mesh(*, process_group: bool = False) -> None:
    """Tear down megatron parallel_state (and torch.distributed when `process_group`)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()
