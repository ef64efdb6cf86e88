"""The policy optimizer: megatron-core's Adam (optionally the DistributedOptimizer, ZeRO-1 over data
parallel ranks) with global-norm grad clipping, and its LR schedule (`OptimizerParamScheduler`).

`build_optimizer` takes model chunks already wrapped in megatron's `DistributedDataParallel`
(`megagrpo.learner.model.wrap_ddp`), because megatron's optimizers read the DDP grad buffers
(`param.main_grad`) and the DistributedOptimizer shards exactly those buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megagrpo.errors import MegagrpoError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6  # peak learning rate (after warm-up)
    min_lr: float = 0.0  # floor of the decay; reached at total_steps
    weight_decay: float = 0.01  # decoupled (AdamW) weight decay
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0  # max global L2 norm of the grads; 0 disables clipping
    warmup_steps: int = 0  # linear warm-up: step k (0-based) uses lr * (k+1) / (warmup_steps+1)
    decay_style: str = "constant"  # one of DECAY_STYLES
    total_steps: int = 1000  # optimizer steps of the whole run: the end of the decay
    use_distributed_optimizer: bool = True  # shard Adam state and fp32 main params over DP ranks

    def validate(self) -> None:
        """Raise MegagrpoError naming the `optimizer.<field>` that is out of range, and the fix."""

        def bad(field: str, why: str) -> MegagrpoError:
            return MegagrpoError(f"optimizer.{field}={getattr(self, field)!r}: {why}")

        if not self.lr > 0:
            raise bad("lr", "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise bad("min_lr", f"must lie in [0, lr={self.lr}]")
        if self.weight_decay < 0:
            raise bad("weight_decay", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad("betas", "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        if not self.eps > 0:
            raise bad("eps", "must be > 0")
        if self.clip_grad < 0:
            raise bad("clip_grad", "must be >= 0 (0 disables clipping)")
        if self.decay_style not in DECAY_STYLES:
            raise bad("decay_style", f"must be one of {', '.join(DECAY_STYLES)}")
        if self.total_steps < 1:
            raise bad("total_steps", "must be >= 1")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise bad("warmup_steps", f"must lie in [0, total_steps={self.total_steps})")


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module"):
        module = module.module
    return module


def _check_ddp(model_chunks: list[Any], cfg: OptimizerConfig) -> Any:
    from megatron.core.distributed import DistributedDataParallel

    if not model_chunks:
        raise ValueError("model_chunks is empty; pass the list returned by wrap_ddp")
    for i, chunk in enumerate(model_chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise ValueError(
                f"model_chunks[{i}] is a {type(chunk).__name__}, not megatron's DistributedDataParallel; "
                "wrap the chunks with megagrpo.learner.model.wrap_ddp first"
            )
        if chunk.ddp_config.use_distributed_optimizer != cfg.use_distributed_optimizer:
            raise MegagrpoError(
                f"optimizer.use_distributed_optimizer={cfg.use_distributed_optimizer} but the model was "
                f"wrapped with distributed_optimizer={chunk.ddp_config.use_distributed_optimizer}; pass the "
                "same value to wrap_ddp and build_optimizer"
            )
    return _unwrap(model_chunks[0]).config


def build_optimizer(model_chunks: list[Any], cfg: OptimizerConfig) -> tuple[Any, Any]:
    """Megatron Adam over the DDP-wrapped `model_chunks` and its LR/weight-decay schedule.

    Returns `(optimizer, scheduler)`: a `MegatronOptimizer` (a `ChainedOptimizer` when the model has
    expert and dense parameter groups) and an `OptimizerParamScheduler`. One training step is
    `optimizer.step()` (clips to `clip_grad`, steps, returns `(ok, grad_norm, zeros)`), then
    `scheduler.step(1)`, then `optimizer.zero_grad()`. The scheduler is `build_scheduler(optimizer, cfg)`.
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from megagrpo.compat import torch_adam

    cfg.validate()
    tcfg = _check_ddp(model_chunks, cfg)
    torch_adam.apply()  # megatron's torch-AdamW fallback (no TE/Apex) needs it on any device
    mcfg = MegatronOptimizerConfig(
        optimizer="adam",  # the DistributedOptimizer supports only Adam
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        bf16=bool(getattr(tcfg, "bf16", False)),
        fp16=bool(getattr(tcfg, "fp16", False)),
        params_dtype=tcfg.params_dtype,
    )
    optimizer = get_megatron_optimizer(mcfg, model_chunks)
    return optimizer, build_scheduler(optimizer, cfg)


def build_scheduler(optimizer: Any, cfg: OptimizerConfig) -> Any:
    """megatron's `OptimizerParamScheduler` for `cfg` over any optimizer with `param_groups`.

    LR: linear warm-up (step k < warmup_steps uses lr * (k+1) / (warmup_steps+1)), then `decay_style`
    from lr to min_lr at total_steps. Weight decay is constant. On checkpoint load the position
    (`num_steps`) comes from the checkpoint and the hyper-parameters from `cfg` (override mode).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg.validate()
    return OptimizerParamScheduler(
        optimizer,
        # megatron's warm-up is init + (max - init) * k / W; this init makes step 0 use lr / (W+1), not 0.
        init_lr=cfg.lr / (cfg.warmup_steps + 1),
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.total_steps,
        lr_decay_style=cfg.decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.total_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def optimizer_factory(cfg: OptimizerConfig):
    """`Learner(optimizer_factory=...)` adapter: `ddp_chunks -> (optimizer, scheduler)`."""

    def factory(model_chunks: list[Any]) -> tuple[Any, Any]:
        return build_optimizer(model_chunks, cfg)

    return factory
