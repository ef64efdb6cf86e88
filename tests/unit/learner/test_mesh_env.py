"""DistEnv.from_environ: one code path for torchrun, srun and mpirun; MeshConfig sizes."""

from __future__ import annotations

import pytest

from megagrpo.errors import MegagrpoError
from megagrpo.learner.mesh import DistEnv, MeshConfig


def test_torchrun_variables():
    env = DistEnv.from_environ(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        3,
        8,
        1,
        "10.0.0.1",
        1234,
    )
    assert env.launcher == "torchrun"


def test_torchrun_wins_over_outer_slurm_step():
    env = DistEnv.from_environ(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "MASTER_ADDR": "h",
        }
    )
    assert (env.rank, env.world_size, env.launcher) == (5, 8, "torchrun")


def test_srun_variables_and_nodelist_master():
    env = DistEnv.from_environ(
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
         "SLURM_NODELIST": "node[03-05,07]"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (2, 4, 0, "srun")
    assert env.master_addr == "node03" and env.master_port == 29500


def test_srun_step_task_count_wins():
    env = DistEnv.from_environ(
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2", "MASTER_ADDR": "a"}
    )
    assert env.world_size == 2


def test_mpirun_variables():
    env = DistEnv.from_environ(
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2222"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (1, 2, 1, "mpirun")


def test_single_process_default():
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.master_addr, env.launcher) == (0, 1, "127.0.0.1", "single")


def test_multi_process_without_master_addr_is_a_clear_error():
    with pytest.raises(MegagrpoError, match="MASTER_ADDR"):
        DistEnv.from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_bad_values():
    with pytest.raises(MegagrpoError, match="RANK"):
        DistEnv.from_environ({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(MegagrpoError, match="outside world size"):
        DistEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a"})


def test_data_parallel_inferred_and_impossible_meshes_named():
    assert MeshConfig(tp=2, pp=2).data_parallel_size(8) == 2
    assert MeshConfig(tp=2, ep=2, etp=2, sequence_parallel=True).data_parallel_size(4) == 2
    with pytest.raises(MegagrpoError, match=r"tp\*pp\*cp = 2\*2\*1 = 4 does not divide the world size 6"):
        MeshConfig(tp=2, pp=2).data_parallel_size(6)
    with pytest.raises(MegagrpoError, match=r"ep\*etp\*pp = 4\*1\*1 = 4 does not divide the world size 2"):
        MeshConfig(ep=4).data_parallel_size(2)
    with pytest.raises(MegagrpoError, match="sequence_parallel"):
        MeshConfig(sequence_parallel=True).validate()


@pytest.mark.parametrize(
    "variables, nodes",
    [
        ({"RANK": "3", "WORLD_SIZE": "8", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}, 2),
        ({"RANK": "3", "WORLD_SIZE": "8"}, 1),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "12", "SLURM_NNODES": "4", "SLURM_STEP_NUM_NODES": "3"}, 3),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "12", "SLURM_NNODES": "4"}, 4),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "10", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 3),
    ],
)
def test_the_node_count_of_the_launch(variables, nodes):
    """Issue 36, item 8: a loopback address is refused only on a launch of several nodes."""
    assert DistEnv.from_environ({"MASTER_ADDR": "10.0.0.1", **variables}).nodes == nodes
