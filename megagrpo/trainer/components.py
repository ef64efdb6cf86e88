"""Builds each subsystem's own config object from the one validated `Config`.

Subsystems keep small frozen dataclasses of their own (learner, rollout, optimizer); this module is the
single place that translates the user-facing schema into them.
"""

from __future__ import annotations

from typing import Any

import torch

from megagrpo.config.schema import Config
from megagrpo.learner.learner import LearnerConfig
from megagrpo.learner.mesh import MeshConfig
from megagrpo.rollout.config import RolloutConfig, SamplingConfig


def torch_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def mesh_config(cfg: Config) -> MeshConfig:
    """The learner's mesh as the config gives it: `config.mesh_rules` already rejected an impossible one."""
    m = cfg.mesh
    return MeshConfig(
        tp=m.tp, pp=m.pp, ep=m.ep, etp=m.etp, cp=m.cp, sequence_parallel=m.sequence_parallel,
        first_stage_layers=m.first_stage_layers, last_stage_layers=m.last_stage_layers,
    )  # fmt: skip


def learner_config(
    cfg: Config, *, micro_batches: int = 1, routing_replay: bool | None = None
) -> LearnerConfig:
    return LearnerConfig(
        mesh=mesh_config(cfg),
        dtype=torch_dtype(cfg.model.dtype),
        layer_spec=cfg.model.layer_spec,
        fp8=cfg.model.fp8,
        fp8_recipe=cfg.model.fp8_recipe,
        recompute="full" if cfg.model.recompute_activations else None,
        routing_replay=(cfg.replay != "none") if routing_replay is None else routing_replay,
        num_micro_batches=micro_batches,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        seed=cfg.schedule.seed,
        reference_model=cfg.algo.kl.coef > 0,
        ref_offload=cfg.model.ref_offload,
        router_bias_update_rate=cfg.model.router_bias_update_rate,
        distributed_optimizer=cfg.optimizer.distributed,
        timeout_minutes=cfg.dist.timeout_minutes,
    )


def optimizer_factory(
    cfg: Config, *, lr: float | None = None, total_steps: int | None = None, warmup_steps: int | None = None
):
    from megagrpo.learner.optimizer import OptimizerConfig
    from megagrpo.learner.optimizer import optimizer_factory as learner_optimizer_factory

    o = cfg.optimizer
    ocfg = OptimizerConfig(
        lr=o.lr if lr is None else lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
        eps=o.eps,
        clip_grad=o.clip_grad,
        warmup_steps=o.warmup_steps if warmup_steps is None else warmup_steps,
        decay_style=o.decay,
        total_steps=total_steps or cfg.schedule.steps,
        use_distributed_optimizer=o.distributed,
    )
    return learner_optimizer_factory(ocfg)


def load_tokenizer(cfg: Config, model_path: str) -> Any:
    """The run's tokenizer: model.tokenizer_path, else the model's own, running the checkpoint's Python
    only when model.trust_remote_code allows it (Kimi-K2's tiktoken tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        cfg.model.tokenizer_path or model_path, trust_remote_code=cfg.model.trust_remote_code
    )


def rollout_config(cfg: Config, model_path: str) -> RolloutConfig:
    r = cfg.rollout
    dtype = r.dtype if r.dtype != "auto" else ("bfloat16" if torch.cuda.is_available() else "float32")
    return RolloutConfig(
        model_path=model_path,
        tp_size=r.engine_tp,
        mem_fraction_static=r.mem_fraction_static,
        dtype=dtype,
        fp8=r.fp8,
        deterministic=r.deterministic,
        return_routes=True,  # MoE routes feed R3 and the rollout-vs-learner agreement statistics
        max_total_tokens=kv_cache_tokens(cfg),
        seed=cfg.schedule.seed,
        trust_remote_code=cfg.model.trust_remote_code,
    )


def kv_cache_tokens(cfg: Config) -> int | None:
    """The engine's KV-cache size (see `rollout.max_total_tokens`); None lets SGLang decide (GPU)."""
    r = cfg.rollout
    if r.max_total_tokens is not None or torch.cuda.is_available():
        return r.max_total_tokens
    per_seq = cfg.data.max_prompt_tokens + r.response_tokens
    return max(4096, int(r.prompts_per_step * r.oversample * r.group_size * per_seq))


def sampling_config(cfg: Config, *, eval: bool = False) -> SamplingConfig:
    r = cfg.rollout
    return SamplingConfig(
        temperature=r.eval_temperature if eval else r.temperature,
        top_p=1.0 if eval else r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
    )
