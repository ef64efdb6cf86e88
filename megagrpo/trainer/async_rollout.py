"""Asynchronous rollout with a hard staleness bound (`rollout.mode: async`, `rollout.max_staleness: k`).

Schedule. Step n's first dynamic-sampling round is drawn and generated with policy version
v(n) = max(0, n - k): the engine holds version n at the start of step n (the weight sync after step n - 1
lands first), so at that point the queue gets step n + k's round, generated while the learner trains
step n. Refill rounds, if dynamic sampling needs them, run at their step with the current weights
(lag 0). The lag of a round is fixed when it is queued and is at most k by construction, so the queue
never has to throw work away; a round that is older than the bound anyway (the bound tightened under a
queued round) is generated again with the current weights and counted (`rollout/dropped_stale`).

Why a fixed lag and not "whatever version is current": a seeded run then repeats exactly (the round of
step m always comes from version max(0, m - k) with the seeds of step m), k = 0 is colocated mode's step
sequence, and the bound test needs no timing luck.

Weight updates wait for the queue to be idle (`RolloutQueue.drain`, request boundaries): SGLang applies
an update between batches anyway, and partial rollouts (abort, update, resume) would mix versions inside
one completion for a gain that a fixed one-step lag already gives.

Resume. A checkpoint records each queued round's step and the prompt iterator's position before its
draw; a resumed run draws those prompts again and regenerates the rounds with the same seeds and the
checkpoint's weights (fresher than the lost rounds), counted once in `rollout/regenerated`. Every
later draw is the uninterrupted run's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megagrpo.dist.agree import agreed
from megagrpo.rollout.dynamic import DynamicSamplingConfig
from megagrpo.rollout.prefetch import QueuedRound, RolloutQueue

# A queued round that failed surfaces on its engine's owner only (the worker runs there); every rank
# calls `take` and `drain` at the same points, so they agree there before the next collective.
_WORKER = "the async rollout worker (a round queued on its engine failed)"


@dataclass
class StepLag:
    """What taking a step's queued round cost and found: the wait, and completions generated again."""

    learner_wait: float = 0.0  # seconds the learner waited for samples
    dropped_stale: int = 0  # completions of a queued round older than the bound, regenerated
    regenerated: int = 0  # completions of rounds lost with a resume, regenerated


class AsyncRollout:
    """The queue of a session's future first rounds. `session` supplies the prompts, seeds and engine."""

    def __init__(self, session, max_staleness: int) -> None:
        self.s = session
        self.k = max_staleness
        self.queue = RolloutQueue()
        self._requeue: list[tuple[int, dict]] = []  # a resumed run's queued rounds, to generate again

    def take(self, step: int) -> tuple[QueuedRound | None, StepLag]:
        """The queued round of `step` (None: sample it now), waiting for it if it is still generating.
        Every rank: a round that failed on its owner raises there and stops the others (`dist.agree`;
        one int64 all-reduce over WORLD)."""
        with agreed(_WORKER):
            return self._take(step)

    def drain(self) -> float:
        """`RolloutQueue.drain` on every rank at once (before a weight sync, after a skipped step): seconds
        waited; a failed round stops every rank as in `take`."""
        with agreed(_WORKER):
            return self.queue.drain()

    def _take(self, step: int) -> tuple[QueuedRound | None, StepLag]:
        lag = StepLag()
        if self._requeue:  # a resumed run: the checkpoint's queued rounds, drawn again in their order
            lag.regenerated = len(self._requeue) * self._round_prompts() * self.s.cfg.rollout.group_size
            now = self.s.prompts.state_dict()
            for m, drawn_from in self._requeue:  # each round's prompts, where they were drawn from
                self.s.prompts.load_state_dict(drawn_from)
                self._queue_round(m, version=step)
            self.s.prompts.load_state_dict(now)
            self._requeue = []
        rnd, lag.learner_wait = self.queue.take(step)
        # Refill rounds use the engine from this thread next: the worker must be idle (after a resume it
        # may still be regenerating a later round; otherwise the sync's drain left it idle already).
        lag.learner_wait += self.queue.drain()
        if rnd is not None and rnd.version < step - self.k:
            # Same prompts and seeds, the current weights: the step keeps its batch, the bound holds.
            lag.dropped_stale = len(rnd.draw) * self.s.cfg.rollout.group_size
            if rnd.work is not None:
                rnd.groups, rnd.rewards, rnd.counts = rnd.work()
            rnd.version = step
        return rnd, lag

    def fill(self, step: int) -> None:
        """Queue the first rounds of the steps after `step`, up to `step + k` and the run's last step,
        with the engine's current weights (version `step`)."""
        last = min(step + self.k, self.s.cfg.schedule.steps - 1)
        start = step + 1 if self.queue.last_step is None else self.queue.last_step + 1
        for m in range(max(start, step + 1), last + 1):
            self._queue_round(m, version=step)

    def _round_prompts(self) -> int:
        """A step's first round: what dynamic sampling draws with the whole batch missing."""
        d = DynamicSamplingConfig.from_config(self.s.cfg)
        return d.draw_size(d.batch_prompts)

    def _queue_round(self, m: int, version: int) -> None:
        """Draw step m's first round (every rank draws the same prompts) and queue its generation on
        this engine's share, with step m's seeds."""
        s, G = self.s, self.s.cfg.rollout.group_size
        state = s.prompts.state_dict()
        draw = [p for _, p in zip(range(self._round_prompts()), s.prompt_stream())]
        share = s.engines.share(len(draw))
        mine = draw[share.start : share.stop]
        work = None
        if s.engine is not None:
            sampling = replace(s.sampling, seed=s.request_seed(m, 0))

            def work(mine=mine, sampling=sampling, offset=share.start * G):
                counts: dict[str, float] = {}
                groups = s.generate_with(mine, sampling, G, offset, version=version)
                rewards = s.score(mine, groups, counts=counts) if mine else torch.empty(0, G)
                return groups, rewards, counts

        self.queue.submit(
            QueuedRound(step=m, version=version, draw=draw, share=share, prompts_state=state, work=work)
        )

    # -- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Called between steps (the queue idle): each queued round's step and where its prompts were
        drawn (refills of earlier steps may sit between two rounds' draws)."""
        return {
            "max_staleness": self.k,
            "queued": [{"step": p.step, "prompts_state": p.prompts_state} for p in self.queue.pending()],
        }

    def load_state_dict(self, st: dict | None) -> None:
        self._requeue = [(int(q["step"]), q["prompts_state"]) for q in (st or {}).get("queued", [])]

    def close(self) -> None:
        self.queue.close()


def lag_metrics(lags: torch.Tensor, k: int, sl: StepLag) -> dict[str, float]:
    """`rollout/` staleness of the step's completions (`lags` [n] int64, the whole batch, the same on every
    rank). `rollout/lag_<d>_frac` for d = 0..k is the lag histogram that report.png plots."""
    n = max(int(lags.numel()), 1)
    m = {
        "rollout/staleness_mean": float(lags.double().mean()) if lags.numel() else 0.0,
        "rollout/staleness_max": float(lags.max()) if lags.numel() else 0.0,
        "rollout/dropped_stale": float(sl.dropped_stale),
        "rollout/regenerated": float(sl.regenerated),
    }
    for d in range(k + 1):
        m[f"rollout/lag_{d}_frac"] = float((lags == d).sum()) / n
    return m
