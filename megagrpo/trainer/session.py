"""`Session`: what every stage (SFT, GRPO, eval) shares: the learner loaded from an HF directory, the SGLang
engine (rank 0), prompts, rewards, metric sinks, evaluation, checkpoints, signals and the step loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.config.loader import dump_config
from megagrpo.config.schema import Config
from megagrpo.errors import MegagrpoError
from megagrpo.trainer import checkpointing
from megagrpo.trainer.components import learner_config, optimizer_factory, rollout_config, sampling_config
from megagrpo.trainer.health import HealthConfig, health_warnings
from megagrpo.trainer.metrics import MetricsLogger, console_line
from megagrpo.trainer.signals import REQUEUE_EXIT_CODE, StopRequest
from megagrpo.trainer.weights import export_buckets, load_hf_into_learner


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def request_seed_base(seed: int, step: int, call: int) -> int:
    """Seed base of one engine call: a hash, so no two (step, call) pairs share request seeds, and a
    resumed run draws exactly the rollouts the uninterrupted one drew."""
    digest = hashlib.blake2b(f"{seed}:{step}:{call}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (rank 0 owns the engine and the rewards on a CPU mesh)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Session:
    stage = "train"  # train | sft | eval: selects the model path, data section and whether an engine runs
    needs_engine = True

    def __init__(self, cfg: Config, *, resume: str | None = None) -> None:
        from transformers import AutoTokenizer

        from megagrpo.data.iterator import PromptIterator
        from megagrpo.data.sets import build_prompt_sets
        from megagrpo.data.template import PromptFormatter
        from megagrpo.learner.learner import Learner

        self.cfg = cfg
        self.resume_arg = resume if resume is not None else cfg.checkpoint.resume
        self.model_path = str(self.initial_model_path())
        self.out_dir = Path(self.output_dir())
        self.ckpt_root = Path(self.checkpoint_dir())
        self.arch = arch_from_hf(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or self.model_path)
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.data_cfg = self.data_config()
        self.formatter = PromptFormatter(self.tokenizer, self.data_cfg)
        self.sets = build_prompt_sets(
            self.data_cfg,
            self.formatter,
            purpose=self.data_purpose(),
            section="sft.data" if self.stage == "sft" else "data",
        )
        if not self.sets.train:
            raise MegagrpoError(f"{'sft.data' if self.stage == 'sft' else 'data'}: no usable training rows")
        self.prompts = PromptIterator(self.sets.train, seed=cfg.schedule.seed, shuffle=self.data_cfg.shuffle)
        self.learner = Learner(
            self.arch,
            learner_config(cfg, routing_replay=self.routing_replay()),
            optimizer_factory=self.make_optimizer(),
        )
        self.rank0 = _rank() == 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        load_hf_into_learner(self.learner, self.model_path)
        self.step = 0
        self._calls = 0  # engine calls within the current step: part of each call's sampling seed
        self.history: list[dict[str, float]] = []
        self.engine = None
        self.rewards = None
        if self.rank0 and self.stage != "sft":
            from megagrpo.rewards.runner import RewardRunner

            self.rewards = RewardRunner(cfg)
        self.start_engine()
        self.sampling = sampling_config(cfg)
        self.logger = MetricsLogger(
            self.out_dir,
            enabled=self.rank0,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            run_config=cfg.model_dump(mode="json"),
            job_type=self.stage,
        )
        self.prompt_text: dict[int, str] = {}
        self.prompt_sample: dict[int, dict] = {}
        self._pending: dict[int, tuple[str, dict]] = {}
        self.stop = StopRequest()
        if self.rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(dump_config(cfg))

    # -- phases: who holds the device memory ----------------------------------------------------------
    #
    # Colocated, the learner and the sampler take turns on the same devices (docs/architecture.md,
    # "Device memory"). Start: the learner reaches its steady-state footprint (Adam's state included),
    # moves it to host memory, and only then does the engine start, so SGLang sizes its weights + KV cache
    # from nearly the whole device (mem_fraction_static of it). Each step: rollout (learner offloaded);
    # `learner_phase` (engine released, learner reloaded); old logprobs and updates; `sync_weights`
    # (validation, then the engine's weights resumed and overwritten); `sampler_phase` (learner offloaded,
    # KV cache resumed). On the CPU the offload is a no-op and the order is the same.

    def start_engine(self) -> None:
        """Learner to its steady state and off the device, then (rank 0) the engine."""
        self.learner.init_optimizer_state()
        if not self.needs_engine:
            return
        self.learner.offload()
        barrier()  # every rank's learner is off its device before any engine process sizes itself
        if self.rank0:
            from megagrpo.rollout.engine import RolloutEngine

            self.engine = RolloutEngine(rollout_config(self.cfg, self.model_path)).start()
        barrier()

    def learner_phase(self, release: tuple[str, ...] = ("kv_cache", "weights")) -> None:
        """Sampler -> learner: the engine releases `release` (its weights only when a weight sync follows:
        a released weights region keeps no copy), then every rank reloads its learner."""
        if self.engine is not None:
            self.engine.release(list(release))
        barrier()  # the engine's memory is free on every device before any learner reloads
        self.learner.reload()

    def sampler_phase(self) -> None:
        """Learner -> sampler: every rank offloads its learner (and returns cached blocks to the driver),
        then the engine resumes whatever it released."""
        self.learner.offload()
        barrier()
        if self.engine is not None:
            self.engine.resume()

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

    def replay_for(self, batch: dict[str, torch.Tensor]):
        """Routing replay (R2/R3) and router statistics for this step; None for a dense model.

        With `replay: none` an MoE model still gets a stats-only `StepReplay` (it only observes), so the
        `moe/` metrics and RSPO's router shift are available whatever the replay mode.
        """
        if not self.arch.is_moe:
            return None
        from megagrpo.moe.replay import StepReplay

        a = self.cfg.algo
        return StepReplay.for_step(
            self.cfg.replay,
            self.learner,
            batch,
            gamma_min=a.router_shift_gamma_min,
            router_shift=a.router_shift,
        )

    # -- prompts and generation ---------------------------------------------------------------------

    def prompt_stream(self) -> Iterator[list[int]]:
        while True:
            for sample in self.prompts.take(1):
                p = self.formatter(sample)
                ids = list(p.input_ids)
                self._pending[id(ids)] = (p.text, sample)
                yield ids

    def response_text(self, c) -> str:
        """The completion as verifiers should see it: without the EOS token that ended it (the engine keeps
        special tokens in `text` so that text and output_ids agree)."""
        eos = self.tokenizer.eos_token
        if c.finish_reason == "stop" and eos and c.text.endswith(eos):
            return c.text[: -len(eos)]
        return c.text

    def generate_tracked(self, draw, sampling, group_size):
        sampling = replace(sampling, seed=request_seed_base(self.cfg.schedule.seed, self.step, self._calls))
        self._calls += 1
        groups = self.engine.generate(draw, sampling, group_size)
        for ids, group in zip(draw, groups):
            text, sample = self._pending.pop(id(ids))
            for c in group:
                self.prompt_text[id(c)] = text
                self.prompt_sample[id(c)] = sample
        return groups

    # -- sync and evaluation ------------------------------------------------------------------------

    def sync_weights(self) -> dict[str, float]:
        """Learner -> SGLang through the bridge's streaming export (every rank iterates it), then the
        sampler phase. Called in the learner phase, with the engine's weights and KV cache released: the
        export is validated before the weights region is resumed (`sync.weights.sync_weights`), so a bad
        export leaves the engine released, with its old weights where the CPU engine keeps them, rather
        than serving a half-overwritten set."""
        from megagrpo.sync.weights import sync_weights

        buckets = export_buckets(self.learner, self.cfg.sync.bucket_mb << 20)
        metrics: dict[str, float] = {}
        if self.rank0:
            stats = sync_weights(
                self.engine,
                buckets,
                checksum=self.cfg.sync.checksum,
                pack=self.cfg.sync.pack,
                before_send=lambda: self.engine.resume(["weights"]),
            )
            metrics = stats.metrics()
        else:
            for _ in buckets:
                pass
        self.sampler_phase()
        self.prompt_text.clear()
        self.prompt_sample.clear()
        return broadcast_from_rank0(metrics)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: one completion per held-out prompt at `rollout.eval_temperature`.

        `eval/accuracy` is the fraction of prompts whose FIRST reward function scores >= 1 (the task's
        verifier by convention); `eval/reward_mean` the mean combined reward.
        """
        metrics: dict[str, float] = {}
        if self.rank0 and self.sets.heldout:
            samples = self.sets.heldout
            prompts = [self.formatter(s) for s in samples]
            groups = self.engine.generate(
                [p.input_ids for p in prompts], sampling_config(self.cfg, eval=True), 1
            )
            comps = [g[0] for g in groups]
            rb = self.rewards.score(
                [p.text for p in prompts], [self.response_text(c) for c in comps], samples, 1
            )
            first = rb.per_reward.view(len(comps), -1)[:, 0]
            metrics = {
                "eval/accuracy": float((first >= 1.0 - 1e-6).float().mean()),
                "eval/reward_mean": float(rb.rewards.mean()),
                "eval/response_len_mean": float(sum(c.output_ids.numel() for c in comps) / len(comps)),
                "eval/prompts": float(len(comps)),
            }
        return broadcast_from_rank0(metrics)

    # -- checkpoints --------------------------------------------------------------------------------

    def extra_state(self) -> dict:
        st = {"step": self.step, "prompts": self.prompts.state_dict(), "stage": self.stage}
        if self.rewards is not None:  # rank 0's, which is the copy meta.json keeps
            st["rewards"] = self.rewards.state_dict()
        return st

    def load_extra_state(self, st: dict) -> None:
        self.step = int(st["step"])
        self.prompts.load_state_dict(st["prompts"])
        if self.rewards is not None and st.get("rewards"):
            self.rewards.load_state_dict(st["rewards"])

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
        try:
            with progress:
                task = progress.add_task(self.stage, total=total, completed=self.step, info="")
                if self.step == 0 and self.needs_engine and cfg.schedule.eval_every > 0:
                    self._log(0, self.evaluate(), progress)
                while self.step < total:
                    if self._stop_agreed():
                        break
                    self._calls = 0
                    metrics = step_fn()
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
                        self.save()
                if self._stop_agreed():
                    path = self.save()
                    if self.rank0:
                        print(
                            f"{self.stop.name()}: saved {path} at step {self.step}; resume with --resume auto",
                            flush=True,
                        )
                    exit_code = REQUEUE_EXIT_CODE
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
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
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


__all__ = ["Session", "json", "os", "time"]
