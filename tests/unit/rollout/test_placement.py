"""CPU placement of an async sampler (`rollout.placement`), and its refusals."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from megagrpo.config.schema import Config
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.engines.placement import CorePlacement, core_placement, engine_cores, release


def test_the_engine_gets_the_last_core_and_the_learner_the_rest_by_default():
    assert core_placement(None, available={0, 1, 2, 3}) == CorePlacement(
        learner=(0, 1, 2), engine=(3,), available=(0, 1, 2, 3)
    )
    assert core_placement([0, 1], available={0, 1, 2}).learner == (2,)


@pytest.mark.parametrize(
    ("cores", "available", "match"),
    [
        (None, {0}, "need one each"),
        ([5], {0, 1}, r"core\(s\) \[5\] are not available"),
        ([0, 1], {0, 1}, "leave at least one for the learner"),
    ],
)
def test_a_placement_without_a_core_for_each_side_is_refused(cores, available, match):
    with pytest.raises(MegagrpoError, match=match):
        core_placement(cores, available=available)


def test_bad_engine_cores_are_refused_by_the_schema():
    with pytest.raises(ValueError, match="engine_cores"):
        Config.model_validate({"model": {"hf_path": "m"}, "rollout": {"placement": {"engine_cores": []}}})


def test_async_needs_the_recomputed_old_policy():
    with pytest.raises(ValueError, match="algo.old_logp"):
        Config.model_validate(
            {
                "model": {"hf_path": "m"},
                "rollout": {"mode": "async"},
                "algo": {"old_logp": "rollout"},
                "diagnostics": {"mismatch": False},
            }
        )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin apart")
def test_an_engine_started_inside_inherits_the_engine_cores_and_the_learner_keeps_the_rest():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    p = core_placement(None)
    try:
        with engine_cores(p):
            assert os.sched_getaffinity(0) == set(p.engine)
            assert os.environ["OMP_NUM_THREADS"] == str(len(p.engine))
        assert os.sched_getaffinity(0) == set(p.learner)
        assert torch.get_num_threads() == len(p.learner)
    finally:
        release(p)
        torch.set_num_threads(threads)
    assert os.sched_getaffinity(0) == before


def test_async_on_gpus_is_refused_with_the_reason(monkeypatch):
    from megagrpo.trainer.session import Session

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake = SimpleNamespace(
        cfg=Config.model_validate({"model": {"hf_path": "m"}}), asynchronous=True, disaggregated=False
    )
    with pytest.raises(MegagrpoError, match="async on GPUs needs engines on devices of their own"):
        Session.core_placement(fake)
    fake.disaggregated = True
    assert Session.core_placement(fake) is None  # the engines are ranks of their own: no pinning
    fake.asynchronous = fake.disaggregated = False
    assert Session.core_placement(fake) is None  # colocated on GPUs: no pinning


def test_async_on_gpus_is_refused_before_anything_starts():
    """`check_mesh` runs before any process group, engine or `megagrpo submit` job."""
    from megagrpo.config.schema import check_mesh

    cfg = Config.model_validate({"model": {"hf_path": "m"}, "rollout": {"mode": "async"}, "schedule": {}})
    with pytest.raises(MegagrpoError, match="rollout.placement.kind=disaggregated"):
        check_mesh(cfg, 8, "train", on_gpu=True)
    disagg = cfg.model_copy(deep=True)
    disagg.rollout.placement.kind = "disaggregated"
    disagg.rollout.num_engines, disagg.rollout.engine_tp = 2, 2
    sizes = check_mesh(disagg, 8, "train", on_gpu=True)  # async on GPUs, engines on ranks 4..7
    assert (sizes.learners, sizes.engine_ranks, sizes.num_engines, sizes.dp) == (4, 4, 2, 4)
    assert check_mesh(cfg, 1, "train", on_gpu=False).num_engines == 1
    assert check_mesh(cfg, 8, "eval", on_gpu=True).num_engines == 8  # eval samples colocated anyway


def test_disaggregated_engine_ranks_take_the_engine_cores_and_learners_the_rest(monkeypatch):
    from megagrpo.rollout.engines.placement import disaggregated_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    p = disaggregated_cores(None)
    assert p.engine == (3,) and p.learner == (0, 1, 2)
    assert disaggregated_cores([2, 3]).learner == (0, 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert disaggregated_cores(None) is None  # one core: nothing to split, no error
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert disaggregated_cores(None) is None  # GPUs: every rank has its device
