"""Issue 25, item 18: `dist.agree.agreed`, the failure flag agreed before the next collective. The real
thing runs on 4 gloo ranks in tests/dist/test_rows.py (a bad route on one owner); here the protocol, with
the other ranks' flags supplied to the one all-reduce it makes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megagrpo.errors import MegagrpoError
from megagrpo.dist import agree
from megagrpo.dist.agree import PeerFailed, agreed


@pytest.fixture
def world(monkeypatch):
    """This process is rank 1 of 4; `peers` holds the flags the other ranks contribute."""
    calls: list[int] = []
    peers = {"flags": [0, 0, 0]}

    def all_reduce(t, op=None, group=None):
        assert op == dist.ReduceOp.MAX and t.dtype == torch.int64 and t.numel() == 1
        calls.append(int(t))
        t.fill_(max([int(t), *peers["flags"]]))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    return calls, peers


def test_nothing_failed_costs_one_all_reduce(world):
    calls, _ = world
    with agreed("x"):
        pass
    assert calls == [0]


def test_the_failing_rank_raises_its_own_error(world):
    calls, peers = world
    peers["flags"] = [3 + 1, 0, 0]  # rank 3 failed too
    with pytest.raises(MegagrpoError, match="my own"), agreed("x"):
        raise MegagrpoError("my own")
    assert calls == [1 + 1]


def test_the_others_name_the_failing_rank(world):
    calls, peers = world
    peers["flags"] = [0, 2 + 1, 0]
    with (
        pytest.raises(PeerFailed, match=r"^rank 2 failed in the step's rows;") as e,
        agreed("the step's rows"),
    ):
        pass
    assert e.value.rank == 2 and isinstance(e.value, MegagrpoError)
    assert calls == [0]


def test_rank_0_failing_is_named_too(world):
    _, peers = world
    peers["flags"] = [0 + 1, 0, 0]
    with pytest.raises(PeerFailed, match="^rank 0 failed"), agreed("x"):
        pass


def test_without_a_process_group_it_only_runs_the_body():
    assert not dist.is_initialized()
    with agreed("x"):
        pass
    with pytest.raises(ValueError, match="bug"), agreed("x"):
        raise ValueError("bug")
    assert agree.failed_rank(True) == 0 and agree.failed_rank(False) is None


def test_the_failing_rank_leaves_its_error_before_the_others_learn_of_it(world, monkeypatch, tmp_path):
    """Under `--nproc` the peers exit as soon as the all-reduce tells them, and the launcher may stop the
    failing rank during its cleanup: its own message must already be with the CLI by then."""
    from megagrpo.errors import ERROR_DIR_ENV

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    seen_at_all_reduce = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: (seen_at_all_reduce.append(sorted(p.name for p in tmp_path.iterdir())), real(t, **kw)))  # fmt: skip
    with pytest.raises(MegagrpoError, match="engine 0: gone"), agreed("the weight sync"):
        raise MegagrpoError("engine 0: gone; resume from the last checkpoint")
    assert seen_at_all_reduce == [["rank1"]]
    assert (tmp_path / "rank1").read_text() == "engine 0: gone; resume from the last checkpoint"
    world[1]["flags"] = [
        3 + 1,
        0,
        0,
    ]  # a peer failed: this rank's PeerFailed is an echo, left by the CLI only
    (tmp_path / "rank1").unlink()
    with pytest.raises(PeerFailed), agreed("the weight sync"):
        pass
    assert not list(tmp_path.iterdir())
