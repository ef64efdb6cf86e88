"""Cold-start SFT (the R1 recipe's first stage) on the same megatron learner, ending in an HF directory.

The loss is the token-mean negative log-likelihood of the completion tokens, computed through the
algorithm core as REINFORCE with advantage 1 (identical to NLL, and so it shares the distributed
normalisation of every RL loss).

Multi-turn traces. When `rollout.multi_turn` is enabled and the SFT rows carry a `trace` (the gold
conversation after the prompt, e.g. synthetic `tool_arithmetic`), each row is rendered as the RL stage's
rollouts will render it (`TraceExamples`): the environment starts the conversation, the chat template's
deltas join the turns, and the loss covers the model's turns only (each with its EOS).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from megagrpo.algo.aggregation import loss_normaliser
from megagrpo.algo.losses import policy_loss
from megagrpo.config.schema import Config, DataConfig
from megagrpo.data.sources import RowError
from megagrpo.data.template import PromptFormatter
from megagrpo.errors import MegagrpoError
from megagrpo.trainer.batch import sft_batch
from megagrpo.trainer.components import optimizer_factory
from megagrpo.trainer.preflight import checkpoint_root, model_field
from megagrpo.trainer.session import Session
from megagrpo.trainer.weights import save_hf

# Learner metrics an SFT step logs as they are (docs/metrics.md): the policy term is renamed sft/nll, and the
# RL-only ratio and clip statistics of the REINFORCE-with-advantage-1 loss say nothing here.
SFT_LEARNER_METRICS = ("loss/entropy", "loss/grad_norm", "loss/lr", "loss/update_skipped")


def sft_metrics(learner_metrics: dict[str, float], *, tokens: float) -> dict[str, float]:
    """One SFT step's log record from `Learner.train_step`'s metrics."""
    out = {"sft/nll": float(learner_metrics.get("loss/policy", float("nan"))), "sft/tokens": tokens}
    out.update({k: float(learner_metrics[k]) for k in SFT_LEARNER_METRICS if k in learner_metrics})
    return out


def sft_data(cfg: Config) -> tuple[str, DataConfig]:
    """(config section, its value) of the SFT rows: sft.data, or the main data section when it is null
    (its rows then need data.completion_key)."""
    if cfg.sft.data is None:
        return "data", cfg.data
    return "sft.data", cfg.sft.data


class TraceExamples:
    """SFT examples of rows carrying a `trace`, tokenised exactly as the multi-turn driver will build their
    trajectories: the environment of `rollout.multi_turn` gives the first messages and the tools, a fresh
    `ChatDeltas` renders them (with `model.chat_template_kwargs`, as the rollouts do), `PromptFormatter.sft_trace_example` the turns after them. A trace that the
    rollout limits would cut (a turn above `rollout.max_new_tokens`, more than `max_turns` turns, more than
    `max_tokens` tokens after the prompt) is an error: SFT would teach what sampling can never produce."""

    def __init__(self, cfg: Config, formatter: PromptFormatter, section: str) -> None:
        from megagrpo.envs.registry import build_environment, resolve_environment

        self.mt, self.formatter, self.section = cfg.rollout.multi_turn, formatter, section
        self.max_new_tokens = cfg.rollout.max_new_tokens
        where = "rollout.multi_turn.environment"
        build_environment(self.mt.environment, self.mt.environment_options, where=where)  # checks the options
        self.env_cls = resolve_environment(self.mt.environment, where=where)

    def __call__(self, samples: Sequence[dict]) -> tuple[list[tuple[list[int], list[int]]], list[list[bool]]]:
        """(prompt ids, response ids) per sample and each response's loss mask, for `sft_batch`."""
        from megagrpo.rollout.episodes.chat_delta import ChatDeltas

        envs = [self.env_cls(**self.mt.environment_options) for _ in samples]

        async def starts() -> list:
            return await asyncio.gather(*(e.reset(dict(s)) for e, s in zip(envs, samples, strict=True)))

        examples, masks = [], []
        for s, env, first in zip(samples, envs, asyncio.run(starts()), strict=True):
            where = f"{self.section}: {s.get('_source', 'a row')}"
            if "trace" not in s:
                raise MegagrpoError(f"{where} has no 'trace'; multi-turn SFT needs one in every row")
            chat = ChatDeltas(
                self.formatter.tok, tools=list(env.tool_schemas() or []), **self.formatter.template_kwargs
            )
            try:
                prompt, response, mask = self.formatter.sft_trace_example(chat, first, s["trace"])
            except RowError as e:
                raise MegagrpoError(f"{where}: {e}") from None
            self._check_limits(where, mask)
            examples.append((prompt, response))
            masks.append(mask)
        return examples, masks

    def _check_limits(self, where: str, mask: list[bool]) -> None:
        turns = [len(list(run)) for model, run in itertools.groupby(mask) if model]  # tokens per turn
        for n, limit, what in (
            (len(turns), self.mt.max_turns, "model turns, above rollout.multi_turn.max_turns"),
            (len(mask), self.mt.max_tokens, "tokens after its prompt, above rollout.multi_turn.max_tokens"),
            (max(turns), self.max_new_tokens, "tokens in one model turn, above rollout.max_new_tokens"),
        ):
            if n > limit:
                raise MegagrpoError(
                    f"{where}: its trace has {n} {what}={limit}, so a rollout could never produce it; raise "
                    "the limit or shorten the trace"
                )


class SFTTrainer(Session):
    stage = "sft"
    needs_engine = False

    def __init__(self, cfg: Config, *, resume: str | None = None) -> None:
        if cfg.sft.steps < 1:
            raise MegagrpoError(f"sft.steps={cfg.sft.steps}: set sft.steps >= 1 to run the SFT stage")
        super().__init__(cfg, resume=resume)
        self.traces = None  # multi-turn traces (module doc), or single-turn completions
        with_trace = [s for s in self.sets.train if s.get("trace")]
        if with_trace and cfg.rollout.multi_turn.enabled:
            self.traces = TraceExamples(cfg, self.formatter, self.data_section())
            bad = next((s for s in self.sets.train if not s.get("trace")), None)
            if bad is not None:  # found now, not when a later step draws it
                raise MegagrpoError(
                    f"{bad.get('_source', self.data_section())}: has no 'trace', while other rows do; multi-turn "
                    "SFT trains on traces, so give every row one (or split the file)"
                )
        else:
            bad = next((s for s in self.sets.train if "completion" not in s), None)
            if bad is not None:
                raise MegagrpoError(
                    f"{bad.get('_source', self.data_section())}: has a tool-use 'trace' and no 'completion'; "
                    "traces train only with rollout.multi_turn.enabled=true (and its environment), else give "
                    "the row a completion"
                )
        self.restore()

    def initial_model_path(self) -> str:
        return model_field(self.cfg, "sft")[1]

    def checkpoint_dir(self) -> str:
        return str(checkpoint_root(self.cfg, "sft"))

    def output_dir(self) -> Path:
        # Its own metrics, TensorBoard and report: the RL stage's log starts again at step 0.
        return Path(self.cfg.logging.out_dir) / "sft"

    def data_config(self):
        return sft_data(self.cfg)[1]

    def data_section(self) -> str:
        return sft_data(self.cfg)[0]

    def data_purpose(self) -> str:
        return "sft"

    def routing_replay(self) -> bool:
        return False

    def make_optimizer(self):
        s = self.cfg.sft
        return optimizer_factory(self.cfg, lr=s.lr, total_steps=s.steps, warmup_steps=s.warmup_steps)

    def sft_step(self) -> dict[str, float]:
        samples = self.prompts.take(self.cfg.sft.batch_size)
        if self.traces is not None:
            examples, masks = self.traces(samples)
        else:
            examples, masks = [self.formatter.sft_example(s) for s in samples], None
        batch = sft_batch(examples, pad_id=self.pad_id, completion_masks=masks)
        norm = loss_normaliser(batch["loss_mask"], "token-mean")

        def loss_fn(logp, entropy, data):
            adv = torch.ones(logp.shape[0], dtype=logp.dtype, device=logp.device)
            return policy_loss(
                logp,
                logp.detach(),
                adv,
                data["loss_mask"],
                variant="reinforce",
                agg="token-mean",
                entropy=entropy,
                normaliser=norm,
            )

        m = self.learner.train_step(batch, loss_fn, num_micro_batches=self.micro_batches(batch))
        return sft_metrics(m, tokens=float(batch["loss_mask"].sum()))

    def run(self) -> int:
        code = self.loop(self.sft_step, total=self.cfg.sft.steps)
        if code == 0:
            out = Path(self.cfg.sft.output_dir)
            save_hf(self.learner, out, side_files_from=self.initial_model_path())
            if self.rank0:
                print(f"SFT model written to {out}", flush=True)
        return code


def sft(cfg: Config, resume: str | None = None) -> int:
    trainer = SFTTrainer(cfg, resume=resume)
    try:
        return trainer.run()
    finally:
        trainer.close()
