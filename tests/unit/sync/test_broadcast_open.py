"""Issue 36, item 9: `BroadcastTransport.open` against a fake engine and a fake group rendezvous. An engine
that refuses `/init_weights_update_group` ends the wait at once with its answer, naming the engine, instead
of leaving the owner in the group's rendezvous until `engine_timeout_s` and a bare `DistStoreError`; a
group that does not form is named too."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import megagrpo.sync.broadcast as broadcast
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.engines.remote import EngineUnreachable

NAME = "engine 0 (http://127.0.0.1:1, rank 2 on n2)"
REFUSAL = (
    '{"success":false,"message":"Failed to init parameter update group: group megagrpo-weights-0 exists"}'
)


@pytest.fixture
def rendezvous(monkeypatch):
    """The group's rendezvous as rank 0 sees it while the engine's workers never join: it waits until
    released, or raises DistStoreError as torch does past its deadline (`fail_after_s`)."""
    state = SimpleNamespace(release=threading.Event(), fail_after_s=None, calls=[])

    def weights_group(backend, store, world_size, name, timeout, device):
        state.calls.append((backend, world_size, name))
        state.release.wait(state.fail_after_s or timeout.total_seconds())
        raise dist.DistStoreError(
            f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: /{name}/0/1"
        )

    monkeypatch.setattr(broadcast, "weights_group", weights_group)
    yield state
    state.release.set()


def transport(call) -> broadcast.BroadcastTransport:
    remote = SimpleNamespace(
        name=NAME, index=0, url="http://127.0.0.1:1", cfg=SimpleNamespace(tp_size=1), call=call
    )
    return broadcast.BroadcastTransport(remote, timeout_s=600)


def test_a_refusal_ends_the_wait_at_once_with_the_engines_reason(rendezvous):
    def refuse(path, body):
        raise EngineUnreachable(f"{NAME}: {path} failed with HTTP 400: {REFUSAL}")

    t = transport(refuse)
    t0 = time.monotonic()
    with pytest.raises(MegagrpoError) as e:
        t.open()
    assert time.monotonic() - t0 < 30  # not the 600 s deadline
    message = str(e.value)
    assert message.startswith(f"{NAME}: the engine refused /init_weights_update_group")
    assert "megagrpo-weights-0 exists" in message and "HTTP 400" in message
    assert rendezvous.calls == [("gloo", 2, "megagrpo-weights-0")] and t.group is None


def test_a_group_that_does_not_form_is_named_with_the_engines_answer(rendezvous):
    rendezvous.fail_after_s = 0.2
    answered = threading.Event()

    def never_answers(path, body):
        answered.wait(60)
        return {"success": True}

    t = transport(never_answers)
    try:
        with pytest.raises(MegagrpoError) as e:
            t.open()
    finally:
        answered.set()
    message = str(e.value)
    assert message.startswith(f"{NAME}: its weights group megagrpo-weights-0 (gloo, 2 ranks) did not form")
    assert "DistStoreError: wait timeout" in message and "no answer yet" in message
