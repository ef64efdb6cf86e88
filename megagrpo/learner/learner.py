"""`Learner`: one object per process tying the mesh, the policy (and optional frozen reference) model,
the optimizer, the forward-only pass and the train step.

Every rank calls every method with the SAME global batch (see `forward` for the batch dict); the
learner shards it over data-parallel ranks and returns results identical on every rank. With
`local_rows=True` each DP rank passes only its own rows instead (`learner.row_plan`), and results
cover those rows; losses and metrics are still reduced over every DP rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.learner import forward as fwd
from megagrpo.learner import train_step as ts
from megagrpo.learner.checkpoint import (
    CheckpointMeta,
    init_optimizer_state,
    load_checkpoint,
    save_checkpoint,
)
from megagrpo.learner.mesh import DistEnv, Mesh, MeshConfig, destroy_mesh, init_mesh
from megagrpo.learner.model import build_gpt_model, wrap_ddp
from megagrpo.learner.optimizer import OptimizerConfig, build_optimizer

# optimizer_factory(ddp_chunks) -> (MegatronOptimizer, OptimizerParamScheduler or None)
OptimizerFactory = Callable[[list[Any]], tuple[Any, Any]]


@dataclass(frozen=True)
class LearnerConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dtype: torch.dtype = torch.float32
    layer_spec: str = "auto"  # auto | local | transformer_engine
    fp8: str | None = None  # None | hybrid | e4m3 (GPU + TE)
    fp8_recipe: str = "delayed"
    recompute: str | None = None  # None | full | selective
    routing_replay: bool = False  # megatron moe_enable_routing_replay (R2/R3, issue 7)
    router_bias_update_rate: float = 0.0  # megatron's expert-bias update per step; 0 = frozen bias
    num_micro_batches: int = 1  # per DP rank and optimizer step
    packed: bool = True  # THD packing; False = padded micro-batches
    balance: bool = True  # token-balanced DP shards / micro-batches
    temperature: float = 1.0  # sampler temperature applied to the logits
    chunk_tokens: int = 1024  # logprob working-set bound
    seed: int = 0
    reference_model: bool = False  # build a frozen reference (KL) model on the same mesh
    ref_offload: bool = False  # keep the reference weights on the CPU between uses (GPU only)
    distributed_optimizer: bool = True
    timeout_minutes: int = 30  # every collective's timeout (dist.timeout_minutes)


class Learner:
    """Policy (+ reference) model on a mesh.

    optimizer: a `learner.optimizer.OptimizerConfig` (megatron Adam/DistributedOptimizer + LR schedule);
    None builds a forward-only learner. `optimizer_factory` replaces the standard construction.
    """

    def __init__(
        self,
        arch: ModelArch,
        cfg: LearnerConfig,
        *,
        optimizer: OptimizerConfig | None = None,
        optimizer_factory: OptimizerFactory | None = None,
        env: DistEnv | None = None,
    ) -> None:
        self.arch, self.cfg = arch, cfg
        self.mesh: Mesh = init_mesh(cfg.mesh, env, seed=cfg.seed, timeout_s=cfg.timeout_minutes * 60)
        build = dict(
            dtype=cfg.dtype,
            fp8=cfg.fp8,
            fp8_recipe=cfg.fp8_recipe,
            recompute=cfg.recompute,
            routing_replay=cfg.routing_replay,
            layer_spec=cfg.layer_spec,
            router_bias_update_rate=cfg.router_bias_update_rate,
        )
        self.chunks = build_gpt_model(arch, cfg.mesh, **build)
        self.model = wrap_ddp(self.chunks, distributed_optimizer=cfg.distributed_optimizer)
        self.optimizer, self.scheduler = (None, None)
        if optimizer is not None and optimizer_factory is None:
            if optimizer.use_distributed_optimizer != cfg.distributed_optimizer:
                optimizer = dataclasses.replace(
                    optimizer, use_distributed_optimizer=cfg.distributed_optimizer
                )
            optimizer_factory = functools.partial(build_optimizer, cfg=optimizer)
        if optimizer_factory is not None:
            self.optimizer, self.scheduler = optimizer_factory(self.model)
        self.reference: list[Any] | None = None
        if cfg.reference_model:
            # No routing replay for the reference: megatron's RouterReplay keeps ONE process-global list of
            # router instances, which must hold only the policy's layers.
            self.reference = build_gpt_model(
                arch,
                cfg.mesh,
                **{**build, "recompute": None, "routing_replay": False, "router_bias_update_rate": 0.0},
            )
            for chunk in self.reference:
                chunk.requires_grad_(False)
                chunk.eval()
            self.copy_policy_to_reference()
        self.step = 0
        self._offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (storage, pinned bytes)
        self.offloaded = False

    # -- options -----------------------------------------------------------------------------------

    def run_options(
        self, *, with_entropy: bool = True, num_micro_batches: int | None = None, local_rows: bool = False
    ) -> fwd.RunOptions:
        c = self.cfg
        return fwd.RunOptions(
            vocab_size=self.arch.vocab_size,
            num_micro_batches=num_micro_batches or c.num_micro_batches,
            packed=c.packed,
            balance=c.balance,
            temperature=c.temperature,
            with_entropy=with_entropy,
            chunk_tokens=c.chunk_tokens,
            local_rows=local_rows,
        )

    # -- passes ------------------------------------------------------------------------------------

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        *,
        reference: bool = False,
        with_entropy: bool = True,
        num_micro_batches: int | None = None,
        hooks: fwd.ForwardHooks | None = None,
        local_rows: bool = False,
        micro_batch_rows: list[torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward only: `{"logprobs": [B, T], "entropy": [B, T]}` fp32, original order, on every rank.

        batch: `input_ids [B, T]` (right-padded) and `seq_lens [B]` (or `attention_mask [B, T]`).
        reference=True runs the frozen reference model (KL); it needs `LearnerConfig.reference_model`.
        local_rows: the batch is this DP rank's rows (see the module doc); `micro_batch_rows` then may give
        the micro-batches as row indices (`RowPlan.micro_batch_rows`).
        """
        if reference and self.reference is None:
            raise MegagrpoError("reference logprobs need a reference model: set algo.kl.coef > 0")
        self._require_on_device()
        model = self.reference if reference else self.model
        opts = self.run_options(
            with_entropy=with_entropy, num_micro_batches=num_micro_batches, local_rows=local_rows
        )
        if reference and self.cfg.ref_offload:
            self._move_reference(torch.device("cuda", torch.cuda.current_device()))
        try:
            return fwd.forward_logprobs(model, batch, opts, hooks=hooks, parts=micro_batch_rows)
        finally:
            if reference and self.cfg.ref_offload:
                self._move_reference(torch.device("cpu"))

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        loss_fn: fwd.LossFn,
        *,
        num_micro_batches: int | None = None,
        hooks: fwd.ForwardHooks | None = None,
        local_rows: bool = False,
    ) -> dict[str, float]:
        """Forward+backward with `loss_fn` (per-micro-batch, globally normalised; see train_step.py), then
        one optimizer step. Returns metrics identical on every rank."""
        if self.optimizer is None:
            raise MegagrpoError(
                "this Learner was built without an optimizer_factory; it can only run forward"
            )
        self._require_on_device()
        metrics = ts.train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            loss_fn,
            self.run_options(num_micro_batches=num_micro_batches, local_rows=local_rows),
            hooks=hooks,
        )
        self.step += 1
        return metrics

    # -- reference model ---------------------------------------------------------------------------

    def copy_policy_to_reference(self) -> None:
        """Reference weights := current policy weights (call after loading the initial checkpoint)."""
        if self.reference is None:
            return
        for pol, ref in zip(self.chunks, self.reference):
            ref_params = dict(ref.named_parameters())
            with torch.no_grad():
                for name, p in pol.named_parameters():
                    ref_params[name].data.copy_(p.data.to(ref_params[name].device))
        if self.cfg.ref_offload:
            self._move_reference(torch.device("cpu"))

    def _move_reference(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            return  # already on the CPU
        for chunk in self.reference or []:
            chunk.to(device)

    # -- checkpoints (learner.checkpoint: atomic dist checkpoints, loadable on any mesh) -------------

    def save(
        self, path: str | Path, *, consumed_samples: int = 0, extra: dict[str, Any] | None = None
    ) -> Path:
        """Save policy weights, optimizer, scheduler, RNG and `self.step` to `path` (collective)."""
        self._require_on_device()
        return save_checkpoint(
            path,
            self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            step=self.step,
            consumed_samples=consumed_samples,
            arch=self.arch,
            extra=extra,
        )

    def load(self, path: str | Path, *, weights_only: bool = False) -> CheckpointMeta:
        """Resume from `path` (weights, optimizer, scheduler, RNG, step); `weights_only` loads just the
        weights (initial weights from a converted model), into the reference model too when present."""
        self._require_on_device()
        meta = load_checkpoint(
            path,
            self.model,
            optimizer=None if weights_only else self.optimizer,
            scheduler=None if weights_only else self.scheduler,
            arch=self.arch,
            load_rng=not weights_only,
        )
        if weights_only:
            self.copy_policy_to_reference()
        else:
            self.step = meta.step
        return meta

    # -- device memory (colocation with the sampler) -------------------------------------------------

    def init_optimizer_state(self) -> None:
        """Create Adam's state (zeros) now instead of at the first step, so the learner reaches its
        steady-state footprint before the sampler sizes itself (or before `offload`). Training is
        unchanged: the optimizer would create the same zeros lazily."""
        if self.optimizer is not None:
            init_optimizer_state(self.optimizer)

    def _device_storages(self) -> dict[int, torch.UntypedStorage]:
        """The CUDA storages the learner owns, once each: parameters and the DDP param/grad buffers they
        view (policy and, unless it lives on the CPU already, reference), fp32 main parameters, their
        grads and Adam's moments."""
        tensors: list[torch.Tensor] = []
        chunks = list(self.model) + ([] if self.cfg.ref_offload else list(self.reference or []))
        for chunk in chunks:
            tensors += list(chunk.parameters())
            # megatron's DDP keeps its _ParamAndGradBuffers in a list attribute named `buffers`, which on
            # an unwrapped module (the reference) is nn.Module's method instead.
            ddp_buffers = getattr(chunk, "buffers", None)
            ddp_buffers = ddp_buffers if isinstance(ddp_buffers, list) else []
            for buf in [*ddp_buffers, *getattr(chunk, "expert_parallel_buffers", [])]:
                tensors += [t for t in (buf.param_data, buf.grad_data) if t is not None]
        opt = self.optimizer
        for sub in (getattr(opt, "chained_optimizers", None) or [opt]) if opt is not None else []:
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                params = group["params"]
                tensors += [*params, *(p.grad for p in params if p.is_leaf and p.grad is not None)]
            for state in inner.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        out: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            if t.is_cuda:
                st = t.untyped_storage()
                if st.nbytes() > 0:
                    out.setdefault(st.data_ptr(), st)
        return out

    def offload(self) -> None:
        """Move the learner's device memory (parameters, gradients, optimizer state) to pinned host
        memory while the sampler runs, and return it to the driver (`empty_cache`).

        Every CUDA storage is copied out and resized to 0 bytes; the tensor objects and their views
        (DDP buffers, `main_grad`, the optimizer's references) stay valid and come back bit-identical
        with `reload`. Cost per rank: one device-to-host copy of the learner's footprint (bf16 params +
        fp32 grads + 12 bytes per parameter of this rank's DistributedOptimizer shard) and back with
        `reload`, and pinned host memory of that size while offloaded (torch's pinned-memory cache keeps
        it for the next offload). On the CPU the learner's memory already is host memory: a
        no-op.
        """
        if self.offloaded or not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        for st in self._device_storages().values():
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=True)  # torch caches pinned blocks
            host.copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),)))
            self._offloaded.append((st, host))
        for st, _ in self._offloaded:
            st.resize_(0)
        torch.cuda.empty_cache()
        self.offloaded = True

    def _require_on_device(self) -> None:
        if self.offloaded:
            raise RuntimeError("the learner is offloaded (the sampler's phase); call reload() first")

    def reload(self) -> None:
        """Undo `offload`: reallocate every storage and copy its bytes back (a no-op on the CPU)."""
        if not self.offloaded:
            return
        device = torch.device("cuda", torch.cuda.current_device())
        for st, host in self._offloaded:
            st.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (host.numel(),)).copy_(
                host, non_blocking=True
            )
        torch.cuda.synchronize()
        self._offloaded = []
        self.offloaded = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self, *, process_group: bool = False) -> None:
        destroy_mesh(process_group=process_group)
