"""The routers' load-drift table in a checkpoint (issue 25, item 8): one copy in `meta.json`, whatever the
world size, with no collective; every rank restores it, on any mesh, and the resumed tracker logs the
`moe/load_drift` an uninterrupted one logs. Checkpoints with the former per-rank list still load."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megagrpo.moe.routers import _TAPS, RouterTaps
from megagrpo.moe.stats import LoadDriftTracker, load_distribution
from megagrpo.trainer.grpo import GRPOTrainer
from megagrpo.trainer.session import Session

L, E = 3, 8


class _Learner:
    arch = SimpleNamespace(is_moe=True)


def _learner(tracker: LoadDriftTracker | None = None) -> _Learner:
    learner = _Learner()
    taps = RouterTaps(slots=[], by_chunk={}, moe_layers=list(range(L)), num_experts=E, topk=2, config=None)
    if tracker is not None:
        taps.state["drift"] = tracker
    _TAPS[learner] = taps
    return learner


def _trainer(learner) -> GRPOTrainer:
    """A trainer with only what its checkpoint state reads (the session's own part is stubbed below)."""
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.learner, t.tis_cap, t.mis_cap = learner, None, None
    return t


def _load(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return load_distribution(torch.randint(0, 50, (L, E), generator=g).double())


@pytest.fixture
def world(monkeypatch):
    """A pretend job of `world.size` ranks (this one `world.rank`); a collective would be an error here."""
    w = SimpleNamespace(size=1, rank=0)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: w.size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: w.rank)

    def no_collective(*a, **k):
        raise AssertionError("the router state moved between ranks")

    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    monkeypatch.setattr(Session, "extra_state", lambda self: {"step": 2})
    monkeypatch.setattr(Session, "load_extra_state", lambda self, st: None)
    return w


def _saved(world, size: int, tracker: LoadDriftTracker) -> str:
    world.size = size
    return json.dumps(_trainer(_learner(tracker)).extra_state())


def test_one_copy_whatever_the_world_size(world):
    a = LoadDriftTracker()
    a.update(_load(0))
    one, many = _saved(world, 1, a), _saved(world, 512, a)
    assert one == many  # L x E floats once, not once per rank
    assert json.loads(many)["router_state"]["drift"]["prev"] == a.state_dict()["prev"]


@pytest.mark.parametrize("resume_world, resume_rank", [(4, 3), (8, 5)])
def test_every_rank_resumes_the_drift_of_an_uninterrupted_run(world, resume_world, resume_rank):
    a = LoadDriftTracker()
    a.update(_load(0))
    a.update(_load(1))
    extra = json.loads(_saved(world, 4, a))
    world.size, world.rank = resume_world, resume_rank  # the same mesh, or another one
    learner = _learner()
    _trainer(learner).load_extra_state(extra)
    resumed = _TAPS[learner].state["drift"]
    want = a.update(_load(2))
    assert "moe/load_drift" in want and resumed.update(_load(2)) == want


def test_a_checkpoint_with_per_rank_copies_still_loads(world):
    a = LoadDriftTracker()
    a.update(_load(0))
    world.size = 2
    learner = _learner()
    _trainer(learner).load_extra_state({"router_taps": [{"drift": a.state_dict()}] * 2})
    assert _TAPS[learner].state["drift"].update(_load(1)) == a.update(_load(1))
