"""`Session`: what every stage (SFT, GRPO, eval) shares: the learner loaded from an HF directory, the SGLang
engines (one per rollout group, `rollout.groups`), prompts, rewards, metric sinks, evaluation, checkpoints,
signals and the step loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.config.loader import dump_config
from megagrpo.config.schema import Config
from megagrpo.dist.agree import agreed
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.groups import EngineGroups
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer import checkpointing
from megagrpo.trainer.batch import turn_index
from megagrpo.trainer.components import learner_config, load_tokenizer, optimizer_factory, sampling_config
from megagrpo.trainer.health import HealthConfig, health_warnings
from megagrpo.trainer.metrics import MetricsLogger, console_line
from megagrpo.trainer.rows import route_slices
from megagrpo.trainer.samplers import SamplerMixin, merge_engine_metrics
from megagrpo.trainer.signals import ENGINE_LOST_EXIT_CODE, REQUEUE_EXIT_CODE, StopRequest
from megagrpo.trainer.weights import load_hf_into_learner


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def request_seed_base(seed: int, step: int, call: int) -> int:
    """Seed base of one engine call: a hash, so no two (step, call) pairs share request seeds, and a
    resumed run draws exactly the rollouts the uninterrupted one drew."""
    digest = hashlib.blake2b(f"{seed}:{step}:{call}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


class Session(SamplerMixin):
    stage = "train"  # train | sft | eval: selects the model path, data section and whether an engine runs
    needs_engine = True

    def __init__(self, cfg: Config, *, resume: str | None = None) -> None:
        from megagrpo.data.iterator import PromptIterator
        from megagrpo.data.sets import build_prompt_sets
        from megagrpo.data.template import PromptFormatter
        from megagrpo.learner.learner import Learner
        from megagrpo.trainer.episodes import row_check

        self.cfg = cfg
        self.resume_arg = resume if resume is not None else cfg.checkpoint.resume
        self.model_path = str(self.initial_model_path())
        self.out_dir = Path(self.output_dir())
        self.ckpt_root = Path(self.checkpoint_dir())
        self.arch = arch_from_hf(self.model_path)
        self.tokenizer = load_tokenizer(cfg, self.model_path)
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.data_cfg = self.data_config()
        self.formatter = PromptFormatter(self.tokenizer, self.data_cfg, cfg.model.chat_template_kwargs)
        self.sets = build_prompt_sets(
            self.data_cfg,
            self.formatter,
            purpose=self.data_purpose(),
            section=self.data_section(),
            row_check=row_check(cfg.rollout.multi_turn),
        )
        if not self.sets.train:
            raise MegagrpoError(f"{self.data_section()}: no usable training rows")
        self.prompts = PromptIterator(self.sets.train, seed=cfg.schedule.seed, shuffle=self.data_cfg.shuffle)
        self.learner = Learner(
            self.arch,
            learner_config(cfg, routing_replay=self.routing_replay()),
            optimizer_factory=self.make_optimizer(),
        )
        self.rank0 = _rank() == 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.engines = EngineGroups.current(self.num_engines())
        # which sampler route columns each rank's pipeline stage reads (the data plane sends only those)
        self.route_slices = route_slices(self.learner) if self.arch.is_moe else None
        load_hf_into_learner(self.learner, self.model_path)
        self.step = 0
        self._calls = 0  # engine calls within the current step: part of each call's sampling seed
        self.history: list[dict[str, float]] = []
        self.sync_wait_seconds = 0.0  # async: the step's wait for the sampler before its weight sync
        self.placement = None  # CPU cores of the engines and the learner (rollout.placement)
        self.engine = None
        self.engine_store = None  # disaggregated owners: the launch's store, where the engines are found
        self.engine_restarts = (
            0  # replacements of this owner's engine (`rollout.fault_tolerance.max_restarts`)
        )
        self.recovery = dict.fromkeys(
            ("rollout/engine_restarts", "rollout/regenerated_requests", "perf/recovery_seconds"), 0.0
        )
        self.weights_transport = None  # disaggregated owners: the engine's weights broadcast group
        self.stage_routes: list = []  # disaggregated, PP > 1: (route, transport) of this rank's stage
        self.rewards = None  # the reward functions run where the completions are: on engine owners
        # Run-long reward error/timeout totals over every engine, the same on every rank (checkpointed).
        self.reward_totals = {"reward/errors_total": 0.0, "reward/timeouts_total": 0.0}
        self.reward_counts: dict[str, float] = {}  # this step's, on this engine (`score`)
        if self.engines.engine is not None and self.needs_engine:
            from megagrpo.rewards.runner import RewardRunner

            self.rewards = RewardRunner(cfg)
        self.episodes = None  # rollout.multi_turn: trajectories instead of completions, on engine owners
        # The owners probe their host's sandbox here (it may deny what the CLI's host allowed): a refusal
        # stops every rank at once, not at the start's barrier.
        with agreed("the multi-turn check on the engine owners (rollout.multi_turn)"):
            if self.rewards is not None and cfg.rollout.multi_turn.enabled:
                from megagrpo.trainer.episodes import EpisodeSampler

                self.episodes = EpisodeSampler(cfg.rollout.multi_turn, cfg.model.chat_template_kwargs)
        self.start_engine()
        self.sampling = sampling_config(cfg)
        # rollout.mode=async: future steps' first rounds, generated while the learner trains
        self.async_rollout = None
        if self.asynchronous:
            from megagrpo.trainer.async_rollout import AsyncRollout

            self.async_rollout = AsyncRollout(self, cfg.rollout.max_staleness)
        self.logger = MetricsLogger(
            self.out_dir,
            enabled=self.rank0,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            run_config=cfg.model_dump(mode="json"),
            job_type=self.stage,
        )
        self.stop = StopRequest()
        if self.rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(dump_config(cfg))

    # -- stage-specific choices --------------------------------------------------------------------

    # A resumed run re-logs the steps after its checkpoint, so those records are dropped first.
    rewrites_log_on_resume = True

    def initial_model_path(self) -> str:
        return self.cfg.model.hf_path

    def checkpoint_dir(self) -> str:
        return self.cfg.checkpoint.dir

    def output_dir(self) -> str | Path:
        return self.cfg.logging.out_dir

    def data_config(self):
        return self.cfg.data

    def data_section(self) -> str:
        """The config section `data_config` comes from, for messages."""
        return "data"

    def data_purpose(self) -> str:
        return "rl"

    def routing_replay(self) -> bool:
        return self.cfg.replay != "none" and self.arch.is_moe

    def make_optimizer(self):
        return optimizer_factory(self.cfg)

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> int:
        """Micro-batches per DP rank for this (mini-)batch: ceil(rows per DP rank / micro_batch_size)."""
        dp = self.learner.mesh.dp
        rows = -(-batch["input_ids"].shape[0] // max(dp, 1))
        return max(1, -(-rows // self.cfg.schedule.micro_batch_size))

    def replay_for(self, batch: dict[str, torch.Tensor], route_layers: list[int] | None = None):
        """Routing replay (R2/R3) and router statistics for this step; None for a dense model.

        With `replay: none` an MoE model still gets a stats-only `StepReplay` (it only observes), so the
        `moe/` metrics and RSPO's router shift are available whatever the replay mode.
        """
        if not self.arch.is_moe:
            return None
        from megagrpo.moe.replay import StepReplay

        a = self.cfg.algo
        # bad routes in one DP rank's rows raise there: every rank stops, before the passes' collectives
        with agreed("the step's routes (routing replay found a bad route in its rows)"):
            return StepReplay.for_step(
                self.cfg.replay,
                self.learner,
                batch,
                gamma_min=a.router_shift_gamma_min,
                router_shift=a.router_shift,
                sharded=True,  # the batch is this DP rank's rows (trainer.rows)
                route_layers=route_layers,  # and its routes, this stage's MoE layers
                turns=turn_index(batch["model_mask"]) if "model_mask" in batch else None,
                num_turns=self.cfg.rollout.multi_turn.max_turns if self.cfg.rollout.multi_turn.enabled else 0,
            )

    # -- prompts and generation ---------------------------------------------------------------------

    def prompt_stream(self) -> Iterator[PromptGroup]:
        """Every rank draws the same prompts (the iterator is seeded alike); each engine samples its share."""
        while True:
            for sample in self.prompts.take(1):
                p = self.formatter(sample)
                yield PromptGroup(input_ids=list(p.input_ids), text=p.text, sample=sample)

    def response_text(self, c) -> str:
        """The completion as verifiers should see it: without the EOS token that ended it (the engine keeps
        special tokens in `text` so that text and output_ids agree)."""
        eos = self.tokenizer.eos_token
        if c.finish_reason == "stop" and eos and c.text.endswith(eos):
            return c.text[: -len(eos)]
        return c.text

    def generate_groups(
        self, prompts: list[PromptGroup], sampling, group_size: int, *, index_offset: int = 0
    ) -> list[list]:
        """This engine's share of one engine call: each prompt group gets its completions. Called on every
        rank (an empty share on ranks without an engine), so every rank counts the same calls: a call's
        number is part of its requests' seeds."""
        sampling = replace(sampling, seed=self.request_seed(self.step, self._calls))
        if self._calls == 0:
            self.inject_planned_fault()
        self._calls += 1
        return self.generate_recovering(prompts, sampling, group_size, index_offset)

    def request_seed(self, step: int, call: int) -> int:
        return request_seed_base(self.cfg.schedule.seed, step, call)

    def generate_with(
        self,
        prompts: list[PromptGroup],
        sampling,
        group_size: int,
        index_offset: int,
        version: int | None = None,
    ) -> list:
        """This engine's completions of `prompts` with `sampling` as it is (its seed included); multi-turn,
        its trajectories, each token recording `version` (default: the current step) as its policy's."""
        if not prompts:
            return []
        if self.episodes is not None:
            v = self.step if version is None else version
            return self.episodes.generate(self.engine, prompts, sampling, group_size, index_offset, v)
        groups = self.engine.generate(
            [p.input_ids for p in prompts], sampling, group_size, index_offset=index_offset
        )
        for p, group in zip(prompts, groups, strict=True):
            p.completions = group
        return groups

    def score(
        self, prompts: list[PromptGroup], groups: list[list], counts: dict[str, float] | None = None
    ) -> torch.Tensor:
        """Rewards of this engine's groups, float32 `[n, G]`, set on each group with the per-function
        scores; the error/timeout counts add up in `counts` (default: the step's `self.reward_counts`)."""
        counts = self.reward_counts if counts is None else counts
        comps = [c for g in groups for c in g]
        G = len(groups[0])
        mt = self.cfg.rollout.multi_turn
        if self.episodes is not None:
            for k, v in self.episodes.counts(prompts).items():
                counts[k] = counts.get(k, 0.0) + v
            if mt.reward == "environment":  # one reward, not a reward function's column
                rewards = self.episodes.environment_rewards(prompts)
                for i, p in enumerate(prompts):
                    p.rewards, p.per_reward = rewards[i].clone(), None
                return rewards
        rb = self.rewards.score(
            [p.text for p in prompts for _ in range(G)],
            [self.response_text(c) for c in comps],
            [p.sample for p in prompts for _ in range(G)],
            G,
        )
        for i, p in enumerate(prompts):
            p.rewards = rb.rewards[i].clone()
            p.per_reward = rb.per_reward[i].clone()
        for k, v in rb.metrics.items():
            if k.endswith(("/errors", "/timeouts")):
                counts[k] = counts.get(k, 0.0) + float(v)
        return rb.rewards

    # -- evaluation ----------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: one completion per held-out prompt at `rollout.eval_temperature`, the prompts
        split over the engines like a training round (`rollout.groups`), with seeds from each prompt's
        index in the held-out set.

        `eval/accuracy` is the fraction of prompts whose FIRST reward function scores >= 1 (the task's
        verifier by convention), or, multi-turn with `reward: environment`, whose trajectory the
        environment rewards >= 1; `eval/reward_mean` the mean combined reward. Multi-turn, each held-out
        row is one trajectory, and `eval/response_len_mean` counts its tokens after the prompt.
        """
        samples = self.sets.heldout
        if not samples:
            return {}
        share = self.engines.share(len(samples))
        sums = torch.zeros(4, dtype=torch.float64)  # correct, reward, response tokens, prompts
        if len(share):
            mine = samples[share.start : share.stop]
            prompts = [self.formatter(s) for s in mine]
            sampling = replace(
                sampling_config(self.cfg, eval=True),
                seed=request_seed_base(self.cfg.schedule.seed, self.step, -1),
            )
            if self.episodes is not None:
                groups = [
                    PromptGroup(input_ids=p.input_ids, text=p.text, sample=s) for p, s in zip(prompts, mine)
                ]
                comps = [g[0] for g in self.generate_with(groups, sampling, 1, share.start)]
                combined = self.score(groups, [[c] for c in comps], counts={}).view(-1)
                first = torch.stack(
                    [g.per_reward.view(-1)[0] if g.per_reward is not None else g.rewards[0] for g in groups]
                )
            else:
                groups = self.engine.generate(
                    [p.input_ids for p in prompts], sampling, 1, index_offset=share.start
                )
                comps = [g[0] for g in groups]
                rb = self.rewards.score(
                    [p.text for p in prompts], [self.response_text(c) for c in comps], mine, 1
                )
                first, combined = rb.per_reward.view(len(comps), -1)[:, 0], rb.rewards
            sums += torch.tensor(
                [
                    float((first >= 1.0 - 1e-6).sum()),
                    float(combined.double().sum()),
                    float(sum(c.output_ids.numel() for c in comps)),
                    float(len(comps)),
                ],
                dtype=torch.float64,
            )
        total = torch.stack(self.engines.gather_from_engines(sums)).sum(0)
        n = float(total[3])
        return {
            "eval/accuracy": float(total[0]) / n,
            "eval/reward_mean": float(total[1]) / n,
            "eval/response_len_mean": float(total[2]) / n,
            "eval/prompts": n,
        }

    # -- checkpoints --------------------------------------------------------------------------------

    def extra_state(self) -> dict:
        return {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "stage": self.stage,
            "reward_totals": dict(self.reward_totals),
            "async_rollout": self.async_rollout.state_dict() if self.async_rollout else None,
        }

    def load_extra_state(self, st: dict) -> None:
        self.step = int(st["step"])
        self.prompts.load_state_dict(st["prompts"])
        if self.async_rollout is not None:  # the queued rounds' prompts are drawn again
            self.async_rollout.load_state_dict(st.get("async_rollout"))
        if "reward_totals" in st:
            self.reward_totals = {k: float(v) for k, v in st["reward_totals"].items()}
        elif st.get("rewards"):  # checkpoints written before the totals moved out of the runner
            old = st["rewards"]
            self.reward_totals = {
                "reward/errors_total": float(old["total_errors"]),
                "reward/timeouts_total": float(old["total_timeouts"]),
            }

    def save(self) -> Path:
        """Checkpoint (collective). Between steps the learner is offloaded: it comes back for the save
        with the engine's KV cache released and its weights kept (no sync follows), a smaller footprint
        than the weight sync's, and goes again after."""
        offloaded = self.learner.offloaded
        if offloaded:
            self.learner_phase(release=("kv_cache",))
        path = checkpointing.save(
            self.learner,
            self.ckpt_root,
            self.step,
            self.extra_state(),
            keep_last=self.cfg.checkpoint.keep_last,
            hf_dir=self.cfg.model.hf_path,
        )
        if offloaded:
            self.sampler_phase()
        return path

    def restore(self) -> None:
        """Resume from `--resume` ('auto': the latest complete checkpoint, if any; or a path)."""
        if self.resume_arg in (None, "never", "none"):
            return
        path = checkpointing.resolve(self.ckpt_root, self.resume_arg)
        if path is None:
            return
        if self.needs_engine:
            self.learner_phase()  # a sync follows: the engine may drop its weights
        st = checkpointing.load(self.learner, path)
        self.load_extra_state(st)
        if self.rewrites_log_on_resume:
            self.logger.truncate_after(self.step)
        if self.needs_engine:
            self.sync_weights()  # the engine started from the HF weights; give it the checkpoint's
        if self.rank0:
            print(f"resumed from {path} at step {self.step}", flush=True)

    # -- the loop -----------------------------------------------------------------------------------

    def loop(self, step_fn: Callable[[], dict[str, float]], total: int) -> int:
        """Run steps up to `total`; returns the exit code: 0 when the run is complete, `REQUEUE_EXIT_CODE`
        when a stop signal ended it early (a checkpoint of the step reached is on disk either way).

        A stop is acted on at a step boundary. One that arrives during the last step, or during its save,
        finds the run complete: exit 0, nothing to requeue. One that arrives during the save of an
        earlier step N stops at N without saving N twice (a second save would eat the grace period)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cfg = self.cfg
        self.stop.install()
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            disable=not (self.rank0 and cfg.logging.console),
        )
        exit_code = 0
        saved: tuple[int, Path] | None = None  # (step, checkpoint) of the last save of this run
        try:
            with progress:
                task = progress.add_task(self.stage, total=total, completed=self.step, info="")
                if self.step == 0 and self.needs_engine and cfg.schedule.eval_every > 0:
                    self._log(0, self.evaluate(), progress)
                while self.step < total:
                    if self._stop_agreed():
                        break
                    self._calls = 0
                    self.reward_counts = {}
                    metrics = step_fn()
                    metrics.update(self.recovery_metrics())
                    self.step += 1
                    if (
                        self.needs_engine
                        and cfg.schedule.eval_every > 0
                        and (self.step % cfg.schedule.eval_every == 0 or self.step == total)
                    ):
                        metrics.update(self.evaluate())
                    self._log(self.step, metrics, progress)
                    progress.update(task, completed=self.step)
                    # The last step always saves ("0 = end only"): a finished run is never lost.
                    every = cfg.schedule.save_every
                    if self.step == total or (every > 0 and self.step % every == 0):
                        saved = (self.step, self.save())
                if self.step < total:  # every rank left the loop at the same agreed stop
                    path = saved[1] if saved is not None and saved[0] == self.step else self.save()
                    if self.rank0:
                        print(
                            f"{self.stop.name() or 'stop on another rank'}: saved {path} at step "
                            f"{self.step}; resume with --resume auto",
                            flush=True,
                        )
                    exit_code = REQUEUE_EXIT_CODE
        except MegagrpoError as e:
            lost = engine_failure(e)
            if lost is None:
                raise
            # Mid-step: the step's learner and data state are not a step boundary, so nothing is saved
            # here; the last checkpoint (schedule.save_every) resumes the run bit for bit.
            print(
                f"rollout engine lost at step {self.step} of {total}: {lost}. Exit {ENGINE_LOST_EXIT_CODE}; "
                f"resume from the last checkpoint with --resume auto (docs/reliability.md)",
                file=sys.stderr,
                flush=True,
            )
            exit_code = ENGINE_LOST_EXIT_CODE
        except SystemExit as e:
            if e.code not in (0, None):
                raise
            # A library's sys.exit(0) (SGLang's SIGTERM drain exits so) must not pass for a finished run.
            raise RuntimeError(
                f"SystemExit(0) raised inside the {self.stage} loop at step {self.step} of {total}; the run "
                "is neither complete nor saved since the last checkpoint"
            ) from e
        finally:
            self.stop.uninstall()
        return exit_code

    def _stop_agreed(self) -> bool:
        """True when any rank got a stop signal; every rank must see the same answer at the same step
        boundary, or the ones that stop would leave the others waiting in a collective."""
        self.stop.reassert()
        flag = torch.tensor(
            [1 if self.stop.requested else 0], dtype=torch.int64, device=self.learner.mesh.device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _log(self, step: int, metrics: dict[str, float], progress) -> None:
        flat = self.logger.log(step, metrics)
        if not self.rank0:
            return
        self.history = [h for h in self.history if h.get("_step", -1) < step] + [{**flat, "_step": step}]
        line = console_line(step, flat)
        progress.console.print(line, soft_wrap=True)
        for w in health_warnings(self.history, HealthConfig(**self.cfg.logging.health.model_dump())):
            progress.console.print(f"[yellow]health warning[/yellow]: {w}")

    def close(self) -> None:
        if self.async_rollout is not None:
            self.async_rollout.close()
        self.close_engines()
        if self.rewards is not None:
            self.rewards.close()
        self.logger.close()
        if self.rank0 and (self.out_dir / "metrics.jsonl").exists():
            from megagrpo.trainer.report import write_report

            try:
                write_report(self.out_dir, title=f"megagrpo {self.stage}")
            except Exception as e:  # a plotting failure must never lose a finished run
                print(f"report.png not written: {e}")
        self.learner.close(process_group=True)
        if self.placement is not None:
            from megagrpo.rollout.engines.placement import release

            release(self.placement)


__all__ = ["Session", "json", "merge_engine_metrics", "os", "time"]


def engine_failure(e: BaseException) -> str | None:
    """The `EngineFailed` message behind `e` (itself, or an error that names its engine and wraps it, as
    the weight sync's does), or None when no engine failed."""
    from megagrpo.rollout.engines.engine import EngineFailed

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, EngineFailed):
            return str(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
