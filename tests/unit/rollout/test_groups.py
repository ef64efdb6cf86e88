"""Rollout groups: owners, shares and the engine count (issue 14)."""

from __future__ import annotations

import pytest

from megagrpo.config.mesh_rules import engine_count
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.groups import EngineGroups


def test_gpu_engines_are_one_per_colocation_group_owned_by_its_first_rank():
    n = engine_count(16, 4, None, on_gpu=True)
    assert n == 4
    assert EngineGroups(world=16, rank=0, num_engines=n).owners == [0, 4, 8, 12]
    assert EngineGroups(world=16, rank=8, num_engines=n).engine == 2
    assert EngineGroups(world=16, rank=9, num_engines=n).engine is None
    with pytest.raises(MegagrpoError, match="rollout.num_engines: 2 on GPUs"):
        engine_count(16, 4, 2, on_gpu=True)
    with pytest.raises(MegagrpoError, match="rollout.engine_tp: 3 does not divide"):
        engine_count(16, 3, None, on_gpu=True)


def test_cpu_engines_default_to_one_and_sit_on_evenly_spaced_ranks():
    assert engine_count(4, 1, None, on_gpu=False) == 1
    assert EngineGroups(world=4, rank=0, num_engines=2).owners == [0, 2]
    assert EngineGroups(world=3, rank=0, num_engines=2).owners == [0, 1]
    with pytest.raises(MegagrpoError, match="at most 4"):
        engine_count(4, 1, 5, on_gpu=False)


@pytest.mark.parametrize("n_prompts", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("engines", [1, 2, 3, 4])
def test_shares_partition_the_prompts_in_order(n_prompts, engines):
    shares = [EngineGroups(world=4, rank=0, num_engines=engines).share(n_prompts, e) for e in range(engines)]
    assert [i for s in shares for i in s] == list(range(n_prompts))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert len(EngineGroups(world=4, rank=1, num_engines=1).share(n_prompts)) == 0  # not an owner
