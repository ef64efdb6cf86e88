"""The GRPO-family training loop (one step = DESIGN.md's data flow).

sample (dynamic sampling) -> reward -> advantages -> sampler sleeps -> old-policy pass (routing record or
R3 replay) -> mismatch metrics and TIS/MIS weights -> k mini-batch updates -> router statistics -> sync ->
sampler wakes -> periodic evaluation -> checkpoint.

Sampling is data-parallel: each engine owner (`rollout.groups`) samples and scores its share of every
round, dynamic sampling decides from the gathered rewards, and the kept groups are gathered so every
learner rank holds the same global batch (the learner shards it over DP itself).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.algo.advantages import gdpo, group_advantages
from megagrpo.algo.aggregation import loss_normaliser
from megagrpo.algo.filters import keep_groups, overlong_mask, soft_overlong_penalty
from megagrpo.algo.importance import importance_masks, importance_metrics
from megagrpo.algo.kl import kl_penalised_rewards
from megagrpo.algo.losses import policy_loss
from megagrpo.config.schema import Config
from megagrpo.diagnostics.adaptive_cap import AdaptiveCap
from megagrpo.diagnostics.mismatch import mismatch_metrics, token_ratio_quantiles
from megagrpo.rollout.dynamic import DynamicSamplingConfig, dynamic_sample
from megagrpo.trainer.batch import response_mask, rollout_batch, select_rows
from megagrpo.trainer.session import Session


def response_lengths(completions) -> torch.Tensor:
    """Output tokens per completion, int64 `[B]`: the DAPO length penalty takes integer lengths only."""
    return torch.tensor([c.output_ids.numel() for c in completions], dtype=torch.int64)


def length_shaped_rewards(rewards: torch.Tensor, lengths: torch.Tensor, so) -> torch.Tensor:
    """`rewards [n, G]` plus the soft overlong penalty of `lengths [n*G]` when `so` (algo.soft_overlong) is on."""
    if not so.enabled:
        return rewards
    pen = soft_overlong_penalty(lengths, so.max_len, so.cache_len, so.factor)
    return rewards + pen.view_as(rewards)


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


def mismatch_measurements(
    sampler_logp, learner_logp, loss_mask, caps: list[AdaptiveCap], *, full: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics to log, metrics the `auto` caps update from). `full` (diagnostics.mismatch) computes the
    whole mismatch/ set, with each cap's quantile added; otherwise only what the caps read is measured."""
    if full:
        extra = tuple(c.quantile for c in caps)
        m = mismatch_metrics(sampler_logp, learner_logp, loss_mask, extra_token_quantiles=extra).metrics
        return m, m
    if not caps:
        return {}, {}
    return {}, token_ratio_quantiles(sampler_logp, learner_logp, loss_mask, [c.quantile for c in caps])


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
        self.tis_cap = (
            AdaptiveCap.from_auto_config(a.tis.auto) if a.tis.enabled and a.tis.cap == "auto" else None
        )
        self.mis_cap = (
            AdaptiveCap.from_auto_config(a.mis.auto, log_name="mismatch/mis_cap")
            if (a.mis.enabled and a.mis.cap == "auto")
            else None
        )
        self.restore()

    # -- state beyond the learner ------------------------------------------------------------------

    def extra_state(self) -> dict:
        st = super().extra_state()
        st["tis_cap"] = self.tis_cap.state_dict() if self.tis_cap else None
        st["mis_cap"] = self.mis_cap.state_dict() if self.mis_cap else None
        st["router_taps"] = self._gather_router_state()
        return st

    def _gather_router_state(self) -> list | None:
        """Collective: every rank's router state (its pipeline stage's layers), indexed by global rank."""
        if not self.learner.arch.is_moe:
            return None
        from megagrpo.moe.routers import router_taps

        mine = router_taps(self.learner).state_dict()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [mine]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def load_extra_state(self, st: dict) -> None:
        super().load_extra_state(st)
        if self.tis_cap and st.get("tis_cap"):
            self.tis_cap.load_state_dict(st["tis_cap"])
        if self.mis_cap and st.get("mis_cap"):
            self.mis_cap.load_state_dict(st["mis_cap"])
        per_rank = st.get("router_taps")
        world = dist.get_world_size() if dist.is_initialized() else 1
        # A different world size means different stages per rank: the drift baseline restarts, which only
        # costs moe/load_drift for the first resumed step.
        if self.learner.arch.is_moe and per_rank and len(per_rank) == world:
            from megagrpo.moe.routers import router_taps

            router_taps(self.learner).load_state_dict(per_rank[dist.get_rank() if world > 1 else 0])

    # -- one step ----------------------------------------------------------------------------------

    def _sample(self, timer: PhaseTimer) -> tuple[dict[str, torch.Tensor] | None, dict[str, float]]:
        """Every rank: data-parallel dynamic sampling and rewards, then the kept groups gathered in batch
        order, advantages -> the learner batch and rollout/reward/adv metrics (the same on every rank)."""
        cfg, a = self.cfg, self.cfg.algo
        with timer("rollout"):
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
            )
        m: dict[str, float] = {**dyn.metrics(), **self._reward_counts()}
        if dyn.kept == 0:
            return None, {**m, "rollout/skipped_step": 1.0}
        kept = self.engines.gather_kept(dyn.prompts, dyn.positions, dyn.kept)
        with timer("reward"):
            rewards = dyn.rewards.clone()
            comps = [c for p in kept for c in p.completions]
            lengths = response_lengths(comps)
            rewards = length_shaped_rewards(rewards, lengths, a.soft_overlong)
            if cfg.rewards.combine == "gdpo":  # the schema ties it to algo.advantages=gdpo
                weights = torch.tensor([f.weight for f in cfg.rewards.functions], dtype=torch.float32)
                adv = gdpo(torch.stack([p.per_reward for p in kept]), weights, a.adv_eps)
            else:
                adv = group_advantages(rewards, a.advantages, a.adv_eps)
        batch = rollout_batch([p.completions for p in kept], adv, pad_id=self.pad_id, rewards=rewards)
        if a.overlong_filter:
            keep = overlong_mask([c.finish_reason for c in comps])
            batch["loss_mask"] &= keep[:, None]
        m.update(
            {
                "reward/mean": float(dyn.rewards.mean()),
                "reward/std": float(dyn.rewards.std()) if dyn.rewards.numel() > 1 else 0.0,
                "adv/mean": float(adv.mean()),
                "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
                "adv/abs_max": float(adv.abs().max()),
                "rollout/response_len_mean": float(lengths.float().mean()),
                "rollout/response_len_max": float(lengths.max()),
                "rollout/truncated_frac": float(batch["truncated"].float().mean()),
                "rollout/completions": float(len(comps)),
            }
        )
        return batch, m

    def _reward_counts(self) -> dict[str, float]:
        """This step's reward error/timeout counts over every engine and round (collective), and the
        run-long totals (means come from the kept batch)."""
        counts = self.engines.sum_counts(self.reward_counts)
        self.reward_totals["reward/errors_total"] += counts.get("reward/errors", 0.0)
        self.reward_totals["reward/timeouts_total"] += counts.get("reward/timeouts", 0.0)
        return {**counts, **(self.reward_totals if counts else {})}

    def _importance(self, old_logp, batch, metrics) -> torch.Tensor | None:
        """TIS and/or MIS weights from learner-old vs sampler (their product when both are on)."""
        a = self.cfg.algo
        weights = None
        for name, spec, auto in (("tis", a.tis, self.tis_cap), ("mis", a.mis, self.mis_cap)):
            if not spec.enabled:
                continue
            cap = auto.cap if auto is not None else float(spec.cap)
            masks = correction_masks(spec, cap, old_logp, batch["sampler_logp"], batch["loss_mask"])
            metrics.update(
                {
                    f"{k}" if name == "tis" else k.replace("mismatch/is_", "mismatch/mis_"): float(v)
                    for k, v in importance_metrics(masks, batch["loss_mask"]).items()
                }
            )
            if auto is not None:
                metrics.update(auto.metrics())
            weights = masks.weights if weights is None else weights * masks.weights
        return weights

    def train_step(self) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algo
        timer = PhaseTimer()
        t_step = time.perf_counter()
        batch, metrics = self._sample(timer)
        if batch is not None and self.engine is not None:
            with timer("sleep"):
                self.engine.release(["kv_cache", "weights"])
        if batch is None:
            # Every group had equal rewards in every round: all advantages are 0, so there is nothing to
            # learn from; the step is counted and logged (rollout/skipped_step) but no update is made.
            if self.rank0:
                print(
                    f"warning: step {self.step + 1}: dynamic sampling kept no group in "
                    f"{int(metrics['rollout/dynamic_rounds'])} rounds; no update this step",
                    flush=True,
                )
            metrics["perf/step_seconds"] = time.perf_counter() - t_step
            return metrics
        metrics["rollout/skipped_step"] = 0.0
        self.learner_phase()  # the engines released above; nothing more to release

        learner_batch = {k: v for k, v in batch.items() if k != "routes"}
        replay = self.replay_for(batch)
        with timer("old_logp"):
            if a.old_logp == "recompute":
                old = self.learner.forward(learner_batch, hooks=replay.old_pass_hooks() if replay else None)
                old_logp = old["logprobs"]
            else:
                old_logp = batch["sampler_logp"]
        # The schema allows neither with old_logp=rollout: both compare this learner pass with the sampler.
        caps = [c for c in (self.tis_cap, self.mis_cap) if c is not None]
        logged, measured = mismatch_measurements(
            batch["sampler_logp"], old_logp, batch["loss_mask"], caps, full=cfg.diagnostics.mismatch
        )
        metrics.update(logged)
        iw = self._importance(old_logp, batch, metrics)
        for cap in caps:  # after the weights: a step's cap never depends on its own measurement
            cap.update(measured)
        learner_batch["old_logp"] = old_logp
        if iw is not None:
            learner_batch["importance_weights"] = iw
        if a.kl.coef > 0:
            learner_batch["ref_logp"] = self.learner.forward(
                learner_batch, reference=True, with_entropy=False
            )["logprobs"]
            if a.kl.placement == "reward":
                metrics.update(self._kl_in_reward(learner_batch))
        if replay is not None:
            metrics.update(replay.old_pass_metrics())

        with timer("train"):
            metrics.update(self._updates(learner_batch, replay))
        if replay is not None:
            metrics.update(replay.step_metrics())

        with timer("sync"):
            metrics.update(self.sync_weights())
        metrics.update(timer.metrics())
        metrics["perf/step_seconds"] = time.perf_counter() - t_step
        metrics["perf/tokens_per_second"] = float(batch["seq_lens"].sum()) / max(
            metrics["perf/step_seconds"], 1e-9
        )
        return metrics

    def _kl_in_reward(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """algo.kl.placement=reward: penalise each sequence's reward by coef * sum_t KL(old || ref) over its
        response tokens and replace `batch["advantages"]` with the group advantages of the penalised
        rewards. Local: every rank holds the same gathered batch and computes the same advantages."""
        a = self.cfg.algo
        dev = batch["ref_logp"].device  # the learner's device; the rollout batch stays on the host
        shaped, penalty = kl_penalised_rewards(
            batch["rewards"].to(dev),
            batch["old_logp"].to(dev),
            batch["ref_logp"],
            response_mask(batch).to(dev),
            a.kl.coef,
            a.kl.estimator,
        )
        G = self.cfg.rollout.group_size
        adv = group_advantages(shaped.view(-1, G), a.advantages, a.adv_eps).reshape(-1)
        batch["advantages"] = adv.to(batch["advantages"].device, torch.float32)
        return {
            "reward/kl_penalty_mean": float(penalty.mean()),
            "adv/mean": float(adv.mean()),
            "adv/std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "adv/abs_max": float(adv.abs().max()),
        }

    def _updates(self, batch: dict[str, torch.Tensor], replay) -> dict[str, float]:
        """`ppo_epochs` passes over `ppo_mini_batches` mini-batches, one optimizer step each."""
        a = self.cfg.algo
        B = batch["input_ids"].shape[0]
        n_mini = a.ppo_mini_batches
        order = torch.arange(B)
        out: dict[str, float] = {}
        steps = 0
        for _epoch in range(a.ppo_epochs):
            for rows in torch.chunk(order, n_mini):
                mb = select_rows(batch, rows)
                norm = loss_normaliser(mb["loss_mask"], a.agg, a.agg_constant)
                loss_fn = self._loss_fn(norm, replay)
                hooks = replay.train_hooks(rows) if replay is not None else None
                m = self.learner.train_step(
                    mb, loss_fn, num_micro_batches=self.micro_batches(mb), hooks=hooks
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
