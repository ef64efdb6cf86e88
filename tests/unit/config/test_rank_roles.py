"""Issue 27, the role split of a launch: `rank_roles` (which ranks learn, which run engines only) and
`check_mesh` in disaggregated placement (the learner mesh over the learner ranks alone, async on GPUs)."""

from __future__ import annotations

import pytest

from megagrpo.config import check_mesh, config_from_dict
from megagrpo.config.mesh_rules import Roles, rank_roles
from megagrpo.errors import MegagrpoError


def make(rollout: dict | None = None, **sections):
    return config_from_dict({"model": {"hf_path": "m"}, "rollout": rollout or {}, **sections})


def disaggregated(**rollout):
    return {"placement": {"kind": "disaggregated"}, **rollout}


def test_colocated_every_rank_learns_and_engines_follow_engine_count():
    assert rank_roles(16, 4, None, disaggregated=False, on_gpu=True) == Roles(16, 4, 0)
    assert rank_roles(3, 1, 2, disaggregated=False, on_gpu=False) == Roles(3, 2, 0)
    assert rank_roles(3, 1, None, disaggregated=False, on_gpu=False) == Roles(3, 1, 0)
    with pytest.raises(MegagrpoError, match="rollout.num_engines: 2 on GPUs"):
        rank_roles(16, 4, 2, disaggregated=False, on_gpu=True)


def test_disaggregated_engines_take_the_last_ranks():
    # 3 nodes x 8 GPUs, 2 engines of TP4: ranks 0-15 learn, 16-19 serve engine 0, 20-23 engine 1
    roles = rank_roles(24, 4, 2, disaggregated=True, on_gpu=True)
    assert roles == Roles(learners=16, engines=2, engine_ranks=8)
    assert [roles.engine_of(r, 4) for r in (0, 15, 16, 19, 20, 23)] == [None, None, 0, 0, 1, 1]
    # the default is one engine; on the CPU an engine of engine_tp ranks too
    assert rank_roles(24, 4, None, disaggregated=True, on_gpu=True) == Roles(20, 1, 4)
    cpu = rank_roles(3, 1, 1, disaggregated=True, on_gpu=False)
    assert cpu == Roles(2, 1, 1) and cpu.engine_of(2, 1) == 0 and cpu.engine_of(1, 1) is None


def test_disaggregated_refuses_a_launch_with_no_learner():
    with pytest.raises(MegagrpoError, match=r"take 8 of the 8 ranks.*at least 9"):
        rank_roles(8, 4, 2, disaggregated=True, on_gpu=True)
    with pytest.raises(MegagrpoError, match=r"take 4 of the 4 ranks.*at least 5"):
        rank_roles(4, 2, 2, disaggregated=True, on_gpu=False)
    assert rank_roles(4, 2, 1, disaggregated=True, on_gpu=False) == Roles(2, 1, 2)  # TP 2 on the CPU


def test_check_mesh_splits_the_learner_mesh_over_the_learner_ranks_only():
    cfg = make(
        disaggregated(engine_tp=4, num_engines=2, prompts_per_step=32, group_size=8),
        mesh={"tp": 2, "ep": 8, "sequence_parallel": True},
    )
    sizes = check_mesh(cfg, 24, on_gpu=True)
    assert (sizes.world_size, sizes.learners, sizes.engine_ranks, sizes.num_engines) == (24, 16, 8, 2)
    assert (sizes.dp, sizes.expert_dp) == (8, 2)  # 16 / tp 2, 16 / ep 8: not 24's
    assert sizes.seqs_per_rank_per_minibatch == 256 // 8
    # the learner ranks must take the mesh: 24 - 1 engine of TP4 = 20 learners, not a multiple of ep 8
    one = make(disaggregated(engine_tp=4), mesh={"tp": 2, "ep": 8, "sequence_parallel": True})
    with pytest.raises(MegagrpoError, match=r"ep\*etp\*pp = 8\*1\*1 = 8 does not divide the world size 20"):
        check_mesh(one, 24, on_gpu=True)


def test_colocated_check_mesh_reports_every_rank_as_a_learner():
    sizes = check_mesh(make({"engine_tp": 2, "prompts_per_step": 8, "group_size": 4}), 4, on_gpu=True)
    assert (sizes.learners, sizes.engine_ranks, sizes.num_engines, sizes.dp) == (4, 0, 2, 4)


def test_async_on_gpus_runs_disaggregated_and_is_refused_colocated():
    async_ = {"mode": "async", "prompts_per_step": 8, "group_size": 4}
    sizes = check_mesh(make(disaggregated(**async_, engine_tp=2)), 6, on_gpu=True)
    assert (sizes.learners, sizes.engine_ranks, sizes.dp) == (4, 2, 4)
    with pytest.raises(MegagrpoError, match="set rollout.placement.kind=disaggregated"):
        check_mesh(make(async_), 4, on_gpu=True)
    # the CPU's colocated async (one process, pinned cores) stays
    assert check_mesh(make(async_), 2, on_gpu=False).engine_ranks == 0


def test_cpu_disaggregated_two_learners_and_one_engine():
    """The issue's CPU shape: 3 processes, DP2 learner + 1 engine process."""
    cfg = make(disaggregated(mode="async", num_engines=1, prompts_per_step=4, group_size=4))
    sizes = check_mesh(cfg, 3, on_gpu=False)
    assert (sizes.learners, sizes.engine_ranks, sizes.num_engines, sizes.dp) == (2, 1, 1, 2)
    assert sizes.seqs_per_rank_per_minibatch == 8


def test_sft_ignores_the_placement_and_eval_keeps_it():
    cfg = make(disaggregated(num_engines=1), sft={"batch_size": 4})
    sft = check_mesh(cfg, 4, "sft", on_gpu=True)
    assert (sft.learners, sft.engine_ranks, sft.num_engines) == (4, 0, 0)
    ev = check_mesh(cfg, 4, "eval", on_gpu=True)
    assert (ev.learners, ev.engine_ranks, ev.num_engines) == (3, 1, 1)
