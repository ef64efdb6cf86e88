"""The GRPO-family training loop (one step = DESIGN.md's data flow).

sample (dynamic sampling) -> reward -> advantages -> sampler sleeps -> old-policy pass (routing record or
R3 replay) -> mismatch metrics and TIS/MIS weights -> k mini-batch updates -> router statistics -> sync ->
sampler wakes -> periodic evaluation -> checkpoint.

Sampling is data-parallel: each engine owner (`rollout.groups`) samples and scores its share of every
round, and dynamic sampling decides from the gathered rewards. The data plane (`trainer.rows`) then
plans which rows each DP rank trains on and moves each row from its owner to that rank's replica only:
from here on every per-token tensor of a step is this rank's rows (the local batch), and whatever spans
the batch (advantages, the loss normaliser, mismatch quantiles, metrics) is reduced over DP.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.algo.advantages import gdpo, group_advantages
from megagrpo.algo.aggregation import loss_normaliser_tensor
from megagrpo.algo.filters import keep_groups, overlong_mask, soft_overlong_penalty
from megagrpo.algo.importance import combine_corrections, importance_masks, importance_metrics
from megagrpo.algo.kl import kl_penalised_rewards
from megagrpo.algo.losses import policy_loss
from megagrpo.config.schema import Config
from megagrpo.diagnostics.adaptive_cap import AdaptiveCap
from megagrpo.diagnostics.mismatch import mismatch_metrics, token_ratio_quantiles
from megagrpo.diagnostics.reduce import DistReducer, LocalReducer
from megagrpo.rollout.dynamic import DynamicSamplingConfig, dynamic_sample
from megagrpo.rollout.episodes.multi_turn import COUNT_PREFIX
from megagrpo.trainer import checkpointing
from megagrpo.trainer.async_rollout import StepLag, lag_metrics
from megagrpo.trainer.batch import response_mask, rollout_batch, select_rows, turn_index
from megagrpo.trainer.episodes import multi_turn_metrics
from megagrpo.trainer.rows import StepRows, distribute_rows
from megagrpo.trainer.session import Session


def length_shaped_rewards(rewards: torch.Tensor, lengths: torch.Tensor, so) -> torch.Tensor:
    """`rewards [n, G]` plus the soft overlong penalty of `lengths [n*G]` when `so` (algo.soft_overlong) is on."""
    if not so.enabled:
        return rewards
    pen = soft_overlong_penalty(lengths, so.max_len, so.cache_len, so.factor)
    return rewards + pen.view_as(rewards)


def local_batch(rows: StepRows, adv: torch.Tensor, rewards: torch.Tensor, *, pad_id: int) -> dict:
    """This rank's learner batch (`trainer.batch.rollout_batch`) from the step's rows and the per-session
    `adv` and `rewards` `[n, G]`: every row takes its session's (`StepRows.session`), so each branch of an
    agent session trains with the session's advantage (docs/agentic.md, "How branches train")."""
    sessions = rows.session[rows.local]
    return rollout_batch(
        [rows.completions], adv.reshape(-1)[sessions], pad_id=pad_id, rewards=rewards.reshape(-1)[sessions]
    )


def correction_masks(spec, cap: float, learner_logp, sampler_logp, loss_mask):
    """One TIS/MIS section (`algo.tis` or `algo.mis`) applied with upper bound `cap`; the schema's null
    `cap_low` is 1/cap for the masking modes (symmetric in log space) and no lower bound for truncate."""
    cap_low = spec.cap_low
    if cap_low is None and spec.mode != "truncate":
        cap_low = 1.0 / cap
    return importance_masks(
        learner_logp,
        sampler_logp,
        loss_mask,
        level=spec.level,
        mode=spec.mode,
        cap_high=cap,
        cap_low=cap_low,
        veto_low=spec.veto_low,
    )


def correction_caps(algo) -> tuple[AdaptiveCap | None, AdaptiveCap | None]:
    """The `auto` caps of `algo.tis` and `algo.mis` (None where a section is off or has a fixed cap)."""
    tis = AdaptiveCap.from_auto_config(algo.tis.auto) if algo.tis.enabled and algo.tis.cap == "auto" else None
    mis = (
        AdaptiveCap.from_auto_config(algo.mis.auto, log_name="mismatch/mis_cap")
        if algo.mis.enabled and algo.mis.cap == "auto"
        else None
    )
    return tis, mis


def mismatch_measurements(
    sampler_logp, learner_logp, loss_mask, caps: list[AdaptiveCap], *, full: bool, reducer=None
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics to log, metrics the `auto` caps update from). `full` (diagnostics.mismatch) computes the
    whole mismatch/ set, with each cap's quantile added; otherwise only what the caps read is measured.
    `reducer` combines the DP ranks' rows (`diagnostics.reduce`)."""
    if full:
        extra = tuple(c.quantile for c in caps)
        m = mismatch_metrics(
            sampler_logp, learner_logp, loss_mask, extra_token_quantiles=extra, reducer=reducer
        ).metrics
        return m, m
    if not caps:
        return {}, {}
    qs = [c.quantile for c in caps]
    return {}, token_ratio_quantiles(sampler_logp, learner_logp, loss_mask, qs, reducer=reducer)


def token_lags(batch: dict[str, torch.Tensor], step: int, row_lags: torch.Tensor) -> torch.Tensor:
    """int64 `[b, T]`: how many versions before `step` each token's policy was: a multi-turn row's model
    tokens from their own versions (`batch["versions"]`), every other token its row's lag (`row_lags [b]`)."""
    lags = row_lags.to(torch.int64)[:, None].expand(batch["input_ids"].shape).clone()
    if "versions" in batch:
        own = batch["versions"] >= 0
        lags[own] = step - batch["versions"][own]
    return lags


def mask_stale_tokens(batch: dict[str, torch.Tensor], lags: torch.Tensor, max_lag: int) -> int:
    """Clear `loss_mask` where a token's policy is more than `max_lag` versions old (`lags [b, T]`); returns
    how many trained tokens that removed. Masked, not regenerated: the trajectory's other tokens, its
    reward and its group stay valid, and regenerating would change the batch after dynamic sampling."""
    stale = batch["loss_mask"] & (lags > max_lag)
    batch["loss_mask"] &= ~stale
    return int(stale.sum())


# the mismatch/ metrics reported per policy lag in async mode, and per turn in multi-turn rollouts
LAG_MISMATCH_KEYS = ("n_tokens", "abs_dp_mean", "kl_sampler_learner_k3", "chi2")


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"perf/{k}_seconds": v for k, v in self.seconds.items()}


class GRPOTrainer(Session):
    """`Session` supplies the learner, engine, data, rewards, logging and checkpoints; this adds the step."""

    stage = "train"

    def __init__(self, cfg: Config, *, resume: str | None = None) -> None:
        super().__init__(cfg, resume=resume)
        a = cfg.algo
        self.tis_cap, self.mis_cap = correction_caps(a)
        if (
            self.async_rollout is not None
            and cfg.rollout.max_staleness > 0
            and not (a.tis.enabled or a.mis.enabled)
        ) and self.rank0:
            print(
                f"warning: rollout.mode=async with max_staleness={cfg.rollout.max_staleness} and neither "
                "algo.tis nor algo.mis enabled: samples up to that many versions old are trained on "
                "without the behaviour-policy weight of the decoupled objective (docs/async.md); "
                "enable algo.tis (cap auto) to correct the lag",
                flush=True,
            )
        self.restore()

    # -- state beyond the learner ------------------------------------------------------------------

    def extra_state(self) -> dict:
        st = super().extra_state()
        st["tis_cap"] = self.tis_cap.state_dict() if self.tis_cap else None
        st["mis_cap"] = self.mis_cap.state_dict() if self.mis_cap else None
        st["router_state"] = checkpointing.router_state(self.learner)  # one copy: the same on every rank
        return st

    def load_extra_state(self, st: dict) -> None:
        super().load_extra_state(st)
        if self.tis_cap and st.get("tis_cap"):
            self.tis_cap.load_state_dict(st["tis_cap"])
        if self.mis_cap and st.get("mis_cap"):
            self.mis_cap.load_state_dict(st["mis_cap"])
        checkpointing.load_router_state(self.learner, st)

    # -- one step ----------------------------------------------------------------------------------

    def _sample(self, timer: PhaseTimer) -> tuple[StepRows | None, dict[str, torch.Tensor] | None, dict]:
        """Every rank: data-parallel dynamic sampling and rewards, advantages of the whole batch (from
        per-row scalars), this rank's rows -> (the step's rows, the local learner batch, metrics that are
        the same on every rank)."""
        cfg, a = self.cfg, self.cfg.algo
        with timer("rollout"):
            first, lag = None, StepLag()
            if self.async_rollout is not None:
                first, lag = self.async_rollout.take(self.step)
            if first is not None:  # the step's first round was generated ahead: refills are call 1, 2, ..
                self._calls = 1
                for k, v in first.counts.items():
                    self.reward_counts[k] = self.reward_counts.get(k, 0.0) + v
            dyn = dynamic_sample(
                self.generate_groups,
                self.prompt_stream(),
                self.sampling,
                DynamicSamplingConfig.from_config(cfg),
                self.score,
                keep_fn=keep_groups
                if a.dynamic_sampling
                else (lambda r: torch.ones(r.shape[0], dtype=torch.bool)),
                engines=self.engines,
                first_round=first,
                version=self.step,
            )
        if self.async_rollout is not None:  # the next steps' first rounds, generated while this one trains
            self.async_rollout.fill(self.step)
        self._lag = lag
        m: dict[str, float] = {**dyn.metrics(), **self._reward_counts()}
        if dyn.kept == 0:
            return None, None, {**m, "rollout/skipped_step": 1.0}
        G = cfg.rollout.group_size
        lags = (self.step - torch.tensor(dyn.versions, dtype=torch.int64)).repeat_interleave(G)
        with timer("rows"):
            rows = distribute_rows(
                self.engines, self.learner.mesh, dyn, cfg.rollout.group_size,
                num_mini_batches=a.ppo_mini_batches, micro_batch_size=cfg.schedule.micro_batch_size,
                balance=self.learner.cfg.balance, routes=self.route_slices,
            )  # fmt: skip
        with timer("reward"):  # per session (`trainer.rows`: rows and sessions), each row takes its session's
            rewards = length_shaped_rewards(dyn.rewards.clone(), rows.session_response_len, a.soft_overlong)
            if cfg.rewards.combine == "gdpo":  # the schema ties it to algo.advantages=gdpo
                weights = torch.tensor([f.weight for f in cfg.rewards.functions], dtype=torch.float32)
                adv = gdpo(rows.per_reward, weights, a.adv_eps)
            else:
                adv = group_advantages(rewards, a.advantages, a.adv_eps)
        m.update(lag_metrics(lags, self.max_lag, lag))
        batch = local_batch(rows, adv, rewards, pad_id=self.pad_id)
        # policy lag of each of this rank's tokens (mismatch by lag): a trajectory's tokens carry their own
        self._token_lags = token_lags(batch, self.step, lags[rows.session[rows.local]])
        if a.overlong_filter:
            keep = overlong_mask([c.finish_reason for c in rows.completions])
            batch["loss_mask"] &= keep[:, None]
        if cfg.rollout.multi_turn.enabled:
            m.update(self._mask_stale_tokens(batch))
            m["rollout/rows_per_session"] = rows.plan.num_rows / rows.session_response_len.numel()
        lengths = rows.response_len
        m.update(
            {
                "reward/mean": float(dyn.rewards.mean()),
                "reward/std": float(dyn.rewards.std()) if dyn.rewards.numel() > 1 else 0.0,
                "adv/mean": float(adv.mean()),
                "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
                "adv/abs_max": float(adv.abs().max()),
                "rollout/response_len_mean": float(lengths.float().mean()),
                "rollout/response_len_max": float(lengths.max()),
                "rollout/truncated_frac": float(rows.truncated.float().mean()),
                "rollout/completions": float(lengths.numel()),
                "perf/rows_bytes_max": self._max_over_world(float(rows.bytes_received)),
            }
        )
        if rows.per_reward is not None:  # each function's score over the kept completions (schema: label)
            for j, f in enumerate(cfg.rewards.functions):
                m[f"reward/{f.label or f.name}/mean"] = float(rows.per_reward[..., j].mean())
        return rows, batch, m

    def _mask_stale_tokens(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Clear the loss of model tokens more than `max_lag` versions old (a trajectory spanning a weight
        update can hold some, docs/agentic.md), and count them over DP: `rollout/stale_tokens_masked`."""
        stale = mask_stale_tokens(batch, self._token_lags, self.max_lag)
        n = torch.tensor([float(stale)], dtype=torch.float64, device=self.learner.mesh.device)
        return {"rollout/stale_tokens_masked": float(self._dp_reducer().sum(n))}

    def _max_over_world(self, x: float) -> float:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.learner.mesh.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def _dp_reducer(self):
        """Reduces per-row partial results over the DP ranks (each holds different rows)."""
        group = self.learner.mesh.data_parallel_group()
        return DistReducer(group) if group is not None else LocalReducer()

    def _reward_counts(self) -> dict[str, float]:
        """This step's reward error/timeout counts over every engine and round (collective), and the
        run-long totals (means come from the kept batch)."""
        counts = self.engines.sum_counts(self.reward_counts)
        turns = {k: counts.pop(k) for k in list(counts) if k.startswith(COUNT_PREFIX)}
        self.reward_totals["reward/errors_total"] += counts.get("reward/errors", 0.0)
        self.reward_totals["reward/timeouts_total"] += counts.get("reward/timeouts", 0.0)
        return {**counts, **(self.reward_totals if counts else {}), **multi_turn_metrics(turns)}

    def _importance(self, old_logp, batch, metrics) -> torch.Tensor | None:
        """TIS and/or MIS weights from learner-old vs sampler; with both on, one ratio times the other
        section's mask (`combine_corrections`). Per rank: two DP all-reduces of 9 and 2 scalars per section."""
        a = self.cfg.algo
        sections = []
        for name, spec, auto in (("tis", a.tis, self.tis_cap), ("mis", a.mis, self.mis_cap)):
            if not spec.enabled:
                continue
            cap = auto.cap if auto is not None else float(spec.cap)
            sampler_logp, loss_mask = (batch[k].to(old_logp.device) for k in ("sampler_logp", "loss_mask"))
            masks = correction_masks(spec, cap, old_logp, sampler_logp, loss_mask)
            reduced = importance_metrics(masks, loss_mask, self._dp_reducer())
            metrics.update(
                {
                    f"{k}" if name == "tis" else k.replace("mismatch/is_", "mismatch/mis_"): float(v)
                    for k, v in reduced.items()
                }
            )
            if auto is not None:
                metrics.update(auto.metrics())
            sections.append((spec.mode, masks))
        return combine_corrections(sections) if sections else None

    def train_step(self) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algo
        timer = PhaseTimer()
        t_step = time.perf_counter()
        self.sync_wait_seconds = 0.0
        if self.async_rollout is not None:
            self.async_rollout.queue.take_busy_seconds()  # the step's sampler time starts now
        rows, batch, metrics = self._sample(timer)
        if batch is not None and self.engine is not None and not self.own_devices:
            with timer("sleep"):
                self.engine.release(["kv_cache", "weights"])
        if batch is None:
            if self.async_rollout is not None:  # no sync follows: the queue must be idle between steps
                self.async_rollout.drain()  # every rank: a failed round stops them all
            # Every group had equal rewards in every round: all advantages are 0, so there is nothing to
            # learn from; the step is counted and logged (rollout/skipped_step) but no update is made.
            if self.rank0:
                print(
                    f"warning: step {self.step + 1}: dynamic sampling kept no group in "
                    f"{int(metrics['rollout/dynamic_rounds'])} rounds; no update this step",
                    flush=True,
                )
            metrics["perf/step_seconds"] = time.perf_counter() - t_step
            metrics.update(self._idle_metrics(timer, metrics["perf/step_seconds"]))
            return metrics
        metrics["rollout/skipped_step"] = 0.0
        self.learner_phase()  # the engines released above; nothing more to release

        dp_rank = self.learner.mesh.dp_rank
        micro = rows.plan.micro_batch_rows(dp_rank)  # the training step's micro-batches, for every pass
        learner_batch = {k: v for k, v in batch.items() if k != "routes"}
        replay = self.replay_for(batch, rows.route_layers)
        with timer("old_logp"):
            if a.old_logp == "recompute":
                hooks = replay.old_pass_hooks() if replay else None
                old = self.learner.forward(
                    learner_batch, hooks=hooks, local_rows=True, micro_batch_rows=micro
                )
                old_logp = old["logprobs"]
            else:
                old_logp = batch["sampler_logp"]
        # The schema allows neither with old_logp=rollout: both compare this learner pass with the sampler.
        caps = [c for c in (self.tis_cap, self.mis_cap) if c is not None]
        logged, measured = mismatch_measurements(
            batch["sampler_logp"].to(old_logp.device), old_logp, batch["loss_mask"].to(old_logp.device), caps,
            full=cfg.diagnostics.mismatch,
            reducer=self._dp_reducer(),
        )  # fmt: skip
        metrics.update(logged)
        if self.async_rollout is not None and cfg.diagnostics.mismatch:
            metrics.update(self._mismatch_by_lag(batch, old_logp))
        if cfg.rollout.multi_turn.enabled and cfg.diagnostics.mismatch:
            metrics.update(self._mismatch_by_turn(batch, old_logp))
        iw = self._importance(old_logp, batch, metrics)
        for cap in caps:  # after the weights: a step's cap never depends on its own measurement
            cap.update(measured)
        learner_batch["old_logp"] = old_logp
        if iw is not None:
            learner_batch["importance_weights"] = iw
        if a.kl.coef > 0:
            learner_batch["ref_logp"] = self.learner.forward(
                learner_batch, reference=True, with_entropy=False, local_rows=True, micro_batch_rows=micro
            )["logprobs"]
            if a.kl.placement == "reward":
                metrics.update(self._kl_in_reward(learner_batch, rows))
        if replay is not None:
            metrics.update(replay.old_pass_metrics())

        with timer("train"):
            metrics.update(self._updates(learner_batch, rows, replay))
        if replay is not None:
            metrics.update(replay.step_metrics())

        with timer("sync"):
            metrics.update(self.sync_weights())
        metrics.update(timer.metrics())
        metrics["perf/step_seconds"] = time.perf_counter() - t_step
        metrics.update(self._idle_metrics(timer, metrics["perf/step_seconds"]))
        metrics["perf/tokens_per_second"] = float(rows.seq_lens.sum()) / max(
            metrics["perf/step_seconds"], 1e-9
        )
        return metrics

    @property
    def max_lag(self) -> int:
        return self.cfg.rollout.max_staleness if self.async_rollout is not None else 0

    def _idle_metrics(self, timer: PhaseTimer, step_seconds: float) -> dict[str, float]:
        """perf/learner_idle_seconds: the step's wait for samples: the rollout phase (the wait for a
        queued round, or sampling now) plus, async, the wait for the sampler before the weight sync.
        perf/sampler_idle_seconds: the step's time an engine did not generate (colocated: everything
        but the rollout). Both are the largest over the ranks."""
        rollout = timer.seconds.get("rollout", 0.0)
        learner_idle, busy = rollout + self.sync_wait_seconds, rollout
        if self.async_rollout is not None:  # the queue's generation, less the time the step waited on it
            busy += self.async_rollout.queue.take_busy_seconds() - self._lag.learner_wait
        sampler_idle = max(step_seconds - busy, 0.0) if self.engine is not None else 0.0
        both = torch.tensor(
            [learner_idle, sampler_idle], dtype=torch.float64, device=self.learner.mesh.device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return {"perf/learner_idle_seconds": float(both[0]), "perf/sampler_idle_seconds": float(both[1])}

    def _mismatch_by_lag(self, batch: dict[str, torch.Tensor], old_logp: torch.Tensor) -> dict[str, float]:
        """`mismatch/lag_<d>/...` over the tokens of completions generated d versions ago (d = 0..k), so
        the lag's share of the sampler/learner gap is told apart from numerics (lag 0)."""
        lags = self._token_lags.to(old_logp.device)
        return self._mismatch_by(batch, old_logp, "lag", [lags == d for d in range(self.max_lag + 1)])

    def _mismatch_by_turn(self, batch: dict[str, torch.Tensor], old_logp: torch.Tensor) -> dict[str, float]:
        """`mismatch/turn_<k>/...` over the model tokens of each trajectory's k-th turn (k = 0 ..
        max_turns - 1): whether the gap grows as the context fills with environment tokens."""
        turn = turn_index(batch["model_mask"]).to(old_logp.device)
        n = self.cfg.rollout.multi_turn.max_turns
        return self._mismatch_by(batch, old_logp, "turn", [turn == k for k in range(n)])

    def _mismatch_by(self, batch, old_logp, name: str, selections: list[torch.Tensor]) -> dict[str, float]:
        """`mismatch/<name>_<i>/<key>` for each token selection i (LAG_MISMATCH_KEYS; a DP reduction each)."""
        dev = old_logp.device
        sampler_logp, loss_mask = batch["sampler_logp"].to(dev), batch["loss_mask"].to(dev)
        out: dict[str, float] = {}
        for i, sel in enumerate(selections):
            m = mismatch_metrics(sampler_logp, old_logp, loss_mask & sel, reducer=self._dp_reducer()).metrics
            for key in LAG_MISMATCH_KEYS:
                out[f"mismatch/{name}_{i}/{key}"] = m[f"mismatch/{key}"]
        return out

    def _kl_in_reward(self, batch: dict[str, torch.Tensor], rows: StepRows) -> dict[str, float]:
        """algo.kl.placement=reward: penalise each session's reward by coef * sum_t KL(old || ref) over the
        response tokens of its rows (one row per session, or one per branch of an agent session) and
        replace `batch["advantages"]` with the group advantages of the penalised rewards, each row its
        session's. A group's rows may sit on different DP ranks, so each session's reward sum, penalty and
        row count (3 x n x G floats) are summed over DP first; every rank then computes the same advantages.
        The reward sum over k equal fp32 rewards, divided by k in fp64, is the reward exactly."""
        a = self.cfg.algo
        dev = batch["ref_logp"].device  # the learner's device; the rollout batch stays on the host
        _, penalty = kl_penalised_rewards(
            batch["rewards"].to(dev),
            batch["old_logp"].to(dev),
            batch["ref_logp"],
            response_mask(batch).to(dev),
            a.kl.coef,
            a.kl.estimator,
        )
        sessions = rows.session[rows.local].to(dev)
        per_row = torch.stack([batch["rewards"].to(dev), penalty, torch.ones_like(penalty)]).to(torch.float64)
        per_session = torch.zeros(3, rows.session_response_len.numel(), dtype=torch.float64, device=dev)
        per_session.index_add_(1, sessions, per_row)
        reward_sum, pen, count = self._dp_reducer().sum(per_session)
        shaped = reward_sum / count - pen
        G = self.cfg.rollout.group_size
        adv = group_advantages(shaped.to(torch.float32).view(-1, G), a.advantages, a.adv_eps).reshape(-1)
        batch["advantages"] = adv[sessions].to(batch["advantages"].device, torch.float32)
        return {
            "reward/kl_penalty_mean": float(pen.mean()),
            "adv/mean": float(adv.mean()),
            "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "adv/abs_max": float(adv.abs().max()),
        }

    def _updates(self, batch: dict[str, torch.Tensor], rows: StepRows, replay) -> dict[str, float]:
        """`ppo_epochs` passes over the plan's mini-batches (this rank's rows of each), one optimizer step
        each. The loss normaliser is the whole mini-batch's, summed over DP."""
        a = self.cfg.algo
        plan, dp_rank = rows.plan, self.learner.mesh.dp_rank
        red = self._dp_reducer()
        out: dict[str, float] = {}
        steps = 0
        for _epoch in range(a.ppo_epochs):
            for sl, n_micro in zip(plan.mini_batch_slices(dp_rank), plan.micro_batches, strict=True):
                local = torch.arange(sl.start, sl.stop)
                mb = select_rows(batch, local)
                local_norm = loss_normaliser_tensor(mb["loss_mask"], a.agg, a.agg_constant)
                norm = float(red.sum(local_norm.to(self.learner.mesh.device)))  # NCCL reduces device tensors
                loss_fn = self._loss_fn(norm, replay)
                hooks = replay.train_hooks(local, num_micro_batches=n_micro) if replay is not None else None
                m = self.learner.train_step(
                    mb, loss_fn, num_micro_batches=n_micro, hooks=hooks, local_rows=True
                )
                for k, v in m.items():
                    out[k] = out.get(k, 0.0) + float(v)
                steps += 1
        return {k: v / steps for k, v in out.items()}

    def _loss_fn(self, normaliser: float, replay=None):
        a = self.cfg.algo
        rspo = a.router_shift and replay is not None

        def loss_fn(logp, entropy, data):
            return policy_loss(
                logp,
                data["old_logp"],
                data["advantages"],
                data["loss_mask"],
                variant=a.variant,
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                clip_ratio_c=a.clip_ratio_c,
                agg=a.agg,
                agg_constant=a.agg_constant,
                importance_weights=data.get("importance_weights"),
                ref_logp=data.get("ref_logp"),
                kl_coef=a.kl.coef if a.kl.placement == "loss" else 0.0,  # reward: already in advantages
                kl_estimator=a.kl.estimator,
                token_weights=replay.token_weights(data) if rspo else None,  # RSPO: stop-gradient gamma
                entropy=entropy,
                entropy_coef=a.entropy_coef,
                normaliser=normaliser,
                sapo_tau_pos=a.sapo_tau_pos,
                sapo_tau_neg=a.sapo_tau_neg,
            )

        return loss_fn

    def run(self) -> int:
        return self.loop(self.train_step, total=self.cfg.schedule.steps)


def train(cfg: Config, resume: str | None = None) -> int:
    trainer = GRPOTrainer(cfg, resume=resume)
    try:
        return trainer.run()
    finally:
        trainer.close()


__all__ = ["GRPOTrainer", "train", "Path"]
