"""The async rollout schedule (`trainer.async_rollout`) on a fake engine: the staleness bound, the version
each round records, refills, a stale round, and resume. The real engine and learner run the same code
in tests/integration/test_async_rollout.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megagrpo.config.schema import Config
from megagrpo.data.iterator import PromptIterator
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.dynamic import DynamicSamplingConfig, dynamic_sample
from megagrpo.rollout.groups import EngineGroups
from megagrpo.rollout.prefetch import QueuedRound, RolloutQueue
from megagrpo.trainer.async_rollout import AsyncRollout, lag_metrics

G = 4


class FakeSession:
    """What `AsyncRollout` reads from a session. The engine's weights are `version`; a generation records
    the version it ran with, and `set_weights` (the sync) refuses to land while a round is generating."""

    def __init__(self, k: int, *, prompts_per_step: int = 4, dynamic: bool = True, gen_seconds: float = 0.0):
        self.cfg = Config.model_validate(
            {
                "model": {"hf_path": "unused"},
                "rollout": {
                    "mode": "async",
                    "max_staleness": k,
                    "group_size": G,
                    "prompts_per_step": prompts_per_step,
                },
                "algo": {"dynamic_sampling": dynamic},
                "schedule": {"steps": 100},
            }
        )
        self.prompts = PromptIterator([{"q": i} for i in range(1000)], seed=0)
        self.engines = EngineGroups(world=1, rank=0, num_engines=1)
        self.engine = object()
        self.sampling = SamplingConfig()
        self.version = 0
        self.generating = threading.Event()
        self.gen_seconds = gen_seconds
        self.generated: list[tuple[int, int]] = []  # (prompt q, version) of every group generated

    def prompt_stream(self):
        while True:
            for sample in self.prompts.take(1):
                yield SimpleNamespace(sample=sample)

    def request_seed(self, step: int, call: int) -> int:
        return step * 100 + call

    def generate_with(self, prompts, sampling, group_size, index_offset, version=None):
        self.generating.set()
        try:
            time.sleep(self.gen_seconds)
            out = []
            for p in prompts:
                p.version = self.version
                self.generated.append((p.sample["q"], self.version))
                out.append([p.sample["q"]] * group_size)
            return out
        finally:
            self.generating.clear()

    def score(self, prompts, groups, counts=None):
        if counts is not None:
            counts["reward/errors"] = counts.get("reward/errors", 0.0) + 1.0
        # every third prompt has equal rewards (dropped by dynamic sampling: refills happen)
        return torch.tensor([[0.0] * G if p.sample["q"] % 3 == 0 else [0.0, 1.0] * (G // 2) for p in prompts])

    def set_weights(self, version: int) -> None:
        assert not self.generating.is_set(), "weights changed inside a request"
        self.version = version


def run_steps(s: FakeSession, ar: AsyncRollout, steps: range, *, sync: bool = True):
    """The trainer's use of the queue: take, sample (refills now), fill, train, drain, sync."""
    dcfg = DynamicSamplingConfig.from_config(s.cfg)
    out = []
    for step in steps:
        first, lag = ar.take(step)
        dyn = dynamic_sample(
            lambda mine, sampling, g, index_offset: s.generate_with(mine, sampling, g, index_offset),
            s.prompt_stream(),
            s.sampling,
            dcfg,
            lambda mine, groups: s.score(mine, groups),
            None if s.cfg.algo.dynamic_sampling else (lambda r: torch.ones(r.shape[0], dtype=torch.bool)),
            engines=s.engines,
            first_round=first,
            version=step,
        )
        ar.fill(step)
        lags = (step - torch.tensor(dyn.versions)).repeat_interleave(G)
        # each kept group's recorded version is the version its prompt was really generated with
        assert [p.version for p in dyn.prompts] == dyn.versions
        out.append((dyn, lag, lags, first))
        ar.queue.drain()
        if sync:
            s.set_weights(step + 1)
    return out


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_no_trained_sample_is_older_than_k_and_the_lag_reaches_k(k):
    s = FakeSession(k, gen_seconds=0.002)
    ar = AsyncRollout(s, k)
    try:
        steps = run_steps(s, ar, range(8))
    finally:
        ar.close()
    for step, (dyn, lag, lags, first) in enumerate(steps):
        assert int(lags.max()) <= k
        assert dyn.kept == 4
        m = lag_metrics(lags, k, lag)
        assert m["rollout/staleness_max"] <= k
        assert sum(m[f"rollout/lag_{d}_frac"] for d in range(k + 1)) == pytest.approx(1.0)
        assert m["rollout/dropped_stale"] == 0 and m["rollout/regenerated"] == 0
        # the first round comes from version max(0, step - k), refills from the current one
        if k:
            assert (first is None) == (step == 0)
        if first is not None:
            assert first.version == max(0, step - k)
    # once the pipeline is full the first round's lag is exactly k
    assert int(steps[-1][2].max()) == k


def test_k0_samples_every_step_now_with_the_current_weights():
    s = FakeSession(0)
    ar = AsyncRollout(s, 0)
    try:
        steps = run_steps(s, ar, range(4))
    finally:
        ar.close()
    assert all(first is None and int(lags.max()) == 0 for _, _, lags, first in steps)


def test_the_queue_draws_the_prompts_colocated_mode_draws_in_the_same_order():
    """k only changes WHEN a round is generated and with which weights, not which prompts a step gets."""
    ks = {}
    for k in (0, 2):
        s = FakeSession(k, dynamic=False)
        ar = AsyncRollout(s, k)
        try:
            ks[k] = [[p.sample["q"] for p in dyn.prompts] for dyn, *_ in run_steps(s, ar, range(5))]
        finally:
            ar.close()
    assert ks[0] == ks[2]


def test_reward_counts_of_a_queued_round_travel_with_it():
    s = FakeSession(1)
    ar = AsyncRollout(s, 1)
    try:
        ar.fill(0)
        rnd, _ = ar.take(1)
    finally:
        ar.close()
    assert rnd.counts == {"reward/errors": 1.0}


def test_a_stale_round_is_generated_again_and_counted():
    """A round older than the bound at its step (here: the bound tightened to 0 after it was queued) is
    generated again with the engine's weights at that step, and its completions are counted."""
    s = FakeSession(1)
    ar = AsyncRollout(s, 1)
    try:
        ar.fill(0)  # step 1's round, generated with version 0
        ar.queue.drain()
        s.set_weights(1)  # the sync after step 0
        ar.k = 0
        rnd, lag = ar.take(1)
    finally:
        ar.close()
    assert lag.dropped_stale == len(rnd.draw) * G
    assert rnd.version == 1
    assert [v for _, v in s.generated] == [0] * len(rnd.draw) + [1] * len(rnd.draw)


def test_resume_draws_the_queued_prompts_again_and_counts_them():
    k = 2
    s = FakeSession(k)
    ar = AsyncRollout(s, k)
    try:
        whole = run_steps(s, ar, range(5))
    finally:
        ar.close()
    # a run checkpointed after step 2 (steps 3 and 4 queued), resumed by a fresh session
    s2 = FakeSession(k)
    ar2 = AsyncRollout(s2, k)
    try:
        head = run_steps(s2, ar2, range(3))
        state = {"prompts": s2.prompts.state_dict(), "async": ar2.state_dict()}
        assert [q["step"] for q in state["async"]["queued"]] == [3, 4]
    finally:
        ar2.close()
    s3 = FakeSession(k)
    s3.prompts.load_state_dict(state["prompts"])
    s3.version = 3
    ar3 = AsyncRollout(s3, k)
    ar3.load_state_dict(state["async"])
    try:
        tail = run_steps(s3, ar3, range(3, 5))
    finally:
        ar3.close()
    assert tail[0][1].regenerated == 2 * 5 * G and tail[1][1].regenerated == 0  # ceil(4 * 1.25) prompts
    # the same prompts as the uninterrupted run at every step (refills included), now from the
    # checkpoint's weights (fresher)
    for (dyn_w, *_), (dyn_r, _, lags, _) in zip(whole[3:], tail, strict=True):
        assert [p.sample["q"] for p in dyn_w.prompts] == [p.sample["q"] for p in dyn_r.prompts]
        assert int(lags.max()) <= k
    assert [p.sample["q"] for p in head[0][0].prompts] == [p.sample["q"] for p in whole[0][0].prompts]


def test_the_queue_surfaces_a_generation_error_in_the_main_thread():
    q = RolloutQueue()

    def broken():
        raise RuntimeError("engine died")

    try:
        q.submit(QueuedRound(step=1, version=0, draw=[1], share=range(1), prompts_state={}, work=broken))
        with pytest.raises(RuntimeError, match="engine died"):
            q.take(1)
    finally:
        q.close()


def test_the_queue_refuses_rounds_out_of_order_and_rounds_left_behind():
    q = RolloutQueue()
    try:
        q.submit(QueuedRound(step=2, version=0, draw=[], share=range(0), prompts_state={}))
        with pytest.raises(ValueError, match="after step 2"):
            q.submit(QueuedRound(step=1, version=0, draw=[], share=range(0), prompts_state={}))
        with pytest.raises(RuntimeError, match="never taken"):
            q.take(3)
        assert q.take(1) == (None, 0.0)
    finally:
        q.close()
