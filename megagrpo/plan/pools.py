"""The memory plan of a disaggregated job (`rollout.placement.kind: disaggregated`): two pools of GPUs.

`config.mesh_rules.rank_roles` splits the launch by rank index: the first `learners` ranks are the
learner's world (its mesh and DP are over them alone), the last `num_engines * engine_tp` ranks run
SGLang servers only, one rank per GPU. The two pools never share a device, so each is planned alone,
with the arithmetic of `plan/memory.py` (its docstring has the formulas) and none of the colocated
phases: nothing is offloaded, nothing takes turns.

A learner GPU (the worst pipeline stage) must hold
  training:    learner state (+ resident reference) + activations and logits of the micro-batches in
               flight + the rows in flight (`rows_wire_bytes`; in async mode the engines' rounds arrive
               while the learner trains, so they are counted on top rather than in a phase of their own)
  weight sync: learner state (+ resident reference) + export buckets (`sync.bucket_mb`): the
               bucket the export builds, and per engine the rank sends to two send buffers, the
               bucket on the wire and the next one (`sync.broadcast`); a rank sends to one engine
               with PP 1, and with PP > 1 to every engine whose owner shares its pipeline group
               (`config.mesh_rules.engines_fed`)
An engine GPU must hold
  serving:     SGLang's static pool, mem_fraction_static x GPU memory (here a share of the whole device:
               nothing else is resident), i.e. the weight shard (`plan/engine_rank.py`) and the KV
               cache, + one bucket of received tensors (`update_weights_from_distributed` allocates
               them outside the static pool, one bucket at a time)
each within the GPU memory minus `RESERVE_GIB` (CUDA context, NCCL buffers; on the engine GPU SGLang's
CUDA graphs and sampling buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from megagrpo.config.mesh_rules import Roles, engines_fed, rank_roles
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.plan.engine_rank import GIB, EngineSpan, engine_weight_bytes, kv_bytes_per_token
from megagrpo.plan.memory import (
    Workload,
    _stage,
    _worst_stage,
    max_micro_batch,
    reference_bytes,
    workload_from_config,
)

if TYPE_CHECKING:
    from megagrpo.plan.host import HostPlan

W = 36  # the label column of the tables
SEND_BUFFERS = 2  # per engine fed: the bucket on the wire and the one filled meanwhile (`sync.broadcast`)


def _gib(x: int) -> str:
    return f"{x / GIB:.1f} GiB"


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


class _Verdict:
    """A pool's verdict from its `reasons`, `budget` and `total` (its largest phase peak)."""

    reasons: tuple[str, ...]
    budget: int

    @property
    def total(self) -> int:
        raise NotImplementedError

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def margin(self) -> int:
        return self.budget - self.total


@dataclass(frozen=True)
class LearnerPool(_Verdict):
    """Bytes per learner GPU (the worst pipeline stage) and the pool's verdict."""

    gpus: int
    workload: Workload  # its mesh spans the learner pool only
    params: int
    grads: int
    optimizer: int
    reference: int  # resident reference weights (0 when offloaded or absent)
    activations: int
    logits: int
    rows_in_flight: int
    export_buckets: int  # `sync.bucket_mb` buckets on a sending rank: 1 + 2 per engine it feeds
    train_peak: int
    sync_peak: int
    budget: int
    max_micro_batch: int  # largest micro_batch_size whose training peak fits (0: not even 1)
    stage: int = 0
    reasons: tuple[str, ...] = field(default=())
    engines_fed: int = 1  # the most engines one learner rank sends weights to
    num_layers: int = 0  # the model's decoder layers (the header names uneven stages' layer counts)

    @property
    def total(self) -> int:
        return max(self.train_peak, self.sync_peak)

    @property
    def export_buckets_n(self) -> int:
        return 1 + SEND_BUFFERS * self.engines_fed

    def lines(self) -> list[str]:
        m = self.workload.mesh
        rows = [
            f"learner pool: {self.gpus} GPUs ({_ranks(0, self.gpus)}), tp={m.tp} "
            f"pp={m.pp}{m.stages_note(self.num_layers)} ep={m.ep} "
            f"etp={m.etp} cp={m.cp} (dp={m.dp}, expert-dp={m.expert_dp}); no engine, never offloaded",
            f"  {f'per learner GPU (pipeline stage {self.stage})':<{W}}{'GiB':>9}",
        ]
        items = [
            ("learner parameters", self.params),
            ("learner gradients", self.grads),
            ("optimizer (Adam, fp32 master)", self.optimizer),
            ("reference model", self.reference),
            ("activations (in flight)", self.activations),
            ("logits and log-softmax", self.logits),
            ("rows in flight (data plane)", self.rows_in_flight),
            (f"export buckets ({self.export_buckets_n}, weight sync)", self.export_buckets),
            ("reserve (contexts, NCCL)", int(self.workload.reserve_gib * GIB)),
            None,
            ("training peak", self.train_peak),
            ("weight-sync peak", self.sync_peak),
        ]
        rows += ["" if x is None else f"  {x[0]:<{W}}{x[1] / GIB:9.2f}" for x in items]
        rows.append(
            f"  learner pool verdict: {'FITS' if self.fits else 'DOES NOT FIT'} (margin "
            f"{self.margin / GIB:+.2f} GiB); largest micro_batch_size that fits: {self.max_micro_batch}"
        )
        return rows + [f"    - {r}" for r in self.reasons]


@dataclass(frozen=True)
class EnginePool(_Verdict):
    """Bytes per engine GPU and the pool's verdict."""

    first_rank: int
    gpus: int
    engines: int
    engine_tp: int
    mem_fraction: float
    gpu_mem: int
    weights: int  # the weight shard: all parameters x the rollout dtype / engine_tp
    kv_cache: int  # the static pool minus the weights
    kv_tokens: int
    received_bucket: int  # one `sync.bucket_mb` bucket of received tensors
    reserve: int
    budget: int
    max_kv_tokens: int  # largest KV cache, in tokens, that fits beside the weights and the bucket
    max_mem_fraction: float  # largest mem_fraction_static that fits, rounded down to 0.01
    reasons: tuple[str, ...] = field(default=())

    @property
    def pool(self) -> int:
        return int(self.mem_fraction * self.gpu_mem)

    @property
    def total(self) -> int:
        return self.pool + self.received_bucket

    def lines(self) -> list[str]:
        rows = [
            f"engine pool: {self.gpus} GPUs ({_ranks(self.first_rank, self.gpus)}), {self.engines} "
            f"engine(s) of engine_tp={self.engine_tp}, mem_fraction_static={self.mem_fraction} of the "
            "whole GPU; no learner",
            f"  {'per engine GPU':<{W}}{'GiB':>9}",
        ]
        items = [
            ("engine weights", self.weights, f"  (1/{self.engine_tp} of the model)"),
            ("engine KV cache", self.kv_cache, f"  ({self.kv_tokens} tokens)"),
            ("received bucket (weight sync)", self.received_bucket, ""),
            ("reserve (context, graphs, NCCL)", self.reserve, ""),
            None,
            ("serving peak", self.total, ""),
        ]
        rows += ["" if x is None else f"  {x[0]:<{W}}{x[1] / GIB:9.2f}{x[2]}" for x in items]
        rows.append(
            f"  engine pool verdict: {'FITS' if self.fits else 'DOES NOT FIT'} (margin "
            f"{self.margin / GIB:+.2f} GiB); largest KV cache that fits: {self.max_kv_tokens} tokens; "
            f"largest mem_fraction_static that fits: {self.max_mem_fraction:.2f}"
        )
        return rows + [f"    - {r}" for r in self.reasons]


@dataclass(frozen=True)
class DisaggregatedPlan:
    """Both pools and the overall verdict: FITS only if both fit. Answers what `MemoryPlan` answers
    (fits, margin, max_micro_batch, kv_tokens) so callers need not tell the two apart."""

    gpu_mem_gib: float
    learner: LearnerPool
    engine: EnginePool
    host: HostPlan | None = None  # each node's host memory for tool calls (`plan/host.py`)
    engine_span: EngineSpan | None = None  # the nodes an engine takes (`plan/engines.py`)

    @property
    def fits(self) -> bool:
        span = self.engine_span is None or self.engine_span.fits
        return self.learner.fits and self.engine.fits and (self.host is None or self.host.fits) and span

    @property
    def margin(self) -> int:
        return min(self.learner.margin, self.engine.margin)

    @property
    def max_micro_batch(self) -> int:
        return self.learner.max_micro_batch

    @property
    def kv_tokens(self) -> int:
        return self.engine.kv_tokens

    @property
    def failing(self) -> list[str]:
        """The pools that do not fit: 'learner pool', 'engine pool', and 'host' for the nodes' memory."""
        out = [n for n, p in (("learner pool", self.learner), ("engine pool", self.engine)) if not p.fits]
        out += ["engine size"] if self.engine_span is not None and not self.engine_span.fits else []
        return out + (["host"] if self.host is not None and not self.host.fits else [])

    def summary(self) -> str:
        """One line for `megagrpo submit`."""
        lp, ep = self.learner, self.engine
        return (
            f"learner pool {lp.gpus} GPUs peak {lp.total / GIB:.1f} GiB, engine pool {ep.gpus} GPUs peak "
            f"{ep.total / GIB:.1f} GiB, of a {lp.budget / GIB:.1f} GiB budget per GPU "
            f"({self.gpu_mem_gib:g} GiB GPUs)"
        )

    def table(self) -> str:
        """What `megagrpo plan` prints for a disaggregated config."""
        w = self.learner.workload
        rows = [
            f"placement: disaggregated, {self.learner.gpus + self.engine.gpus} GPUs of "
            f"{self.gpu_mem_gib:g} GiB: {self.learner.gpus} learner + {self.engine.gpus} engine",
            f"micro-batch: {w.tokens()} tokens ({w.micro_batch_size} x {w.seq_len}), "
            f"recompute={w.recompute}, learner {w.param_dtype} params / {w.grad_dtype} grads",
            "",
            *self.learner.lines(),
            "",
            *self.engine.lines(),
            "",
        ]
        if self.host is not None and self.host.lines():
            rows += [*self.host.lines(), *(f"    - {r}" for r in self.host.reasons), ""]
        if self.engine_span is not None:
            rows += [*self.engine_span.lines(), *(f"    - {r}" for r in self.engine_span.reasons), ""]
        verdict = "FITS" if self.fits else f"DOES NOT FIT ({' and '.join(self.failing)})"
        rows.append(
            f"verdict: {verdict}: learner pool margin {self.learner.margin / GIB:+.2f} GiB, engine pool "
            f"margin {self.engine.margin / GIB:+.2f} GiB"
        )
        return "\n".join(rows)


def plan_learner_pool(arch: ModelArch, w: Workload, *, gpu_mem_gib: float, engines: int = 1) -> LearnerPool:
    """The learner pool of workload `w` (its mesh's world is the learner ranks alone) feeding `engines`."""
    w.mesh.check()
    budget = int(gpu_mem_gib * GIB) - int(w.reserve_gib * GIB)
    ref_resident = 0
    if w.reference and not w.ref_offload:
        ref_resident = max(reference_bytes(arch, w, s) for s in range(w.mesh.pp))
    worst = _worst_stage(arch, w, w.tokens(), ref_resident)
    train_peak = worst.train + w.rows_in_flight
    learner = max(_stage(arch, w, s, 1, ref_resident).resident for s in range(w.mesh.pp))
    fed = engines_fed(w.mesh.world_size, w.mesh.pp, engines)
    buckets = (1 + SEND_BUFFERS * fed) * w.sync_bucket_bytes
    sync_peak = learner + buckets
    reasons = []
    if train_peak > budget:
        reasons.append(
            f"training: {_gib(train_peak)} exceed {_gib(budget)}; lower schedule.micro_batch_size, set "
            "model.recompute_activations, or shard the learner more (mesh.tp/pp/ep, or more learner ranks)"
        )
    if sync_peak > budget:
        reasons.append(
            f"weight sync: learner state {_gib(learner)} + {1 + SEND_BUFFERS * fed} export buckets "
            f"{_gib(buckets)} exceed "
            f"{_gib(budget)}; lower sync.bucket_mb or shard the learner more"
        )
    max_mb = max_micro_batch(arch, w, ref_resident, budget, beside=w.rows_in_flight)
    return LearnerPool(
        num_layers=arch.num_layers,
        gpus=w.mesh.world_size,
        workload=w,
        params=worst.state.params,
        grads=worst.state.grads,
        optimizer=worst.state.optimizer,
        reference=ref_resident,
        activations=worst.activations,
        logits=worst.logits,
        rows_in_flight=w.rows_in_flight,
        export_buckets=buckets,
        engines_fed=fed,
        train_peak=train_peak,
        sync_peak=sync_peak,
        budget=budget,
        max_micro_batch=max_mb,
        stage=worst.stage,
        reasons=tuple(reasons),
    )


def plan_engine_pool(arch: ModelArch, w: Workload, roles: Roles, *, gpu_mem_gib: float) -> EnginePool:
    """The engine pool: `roles.engines` engines of `w.engine_tp` GPUs each, after the learner ranks."""
    mem = int(gpu_mem_gib * GIB)
    reserve = int(w.reserve_gib * GIB)
    budget = mem - reserve
    weights = engine_weight_bytes(arch, w.engine_tp, "fp8" if w.engine_fp8 else w.engine_dtype)
    pool = int(w.engine_mem_fraction * mem)
    per_token = kv_bytes_per_token(arch, w.engine_tp, w.engine_dtype)
    kv = pool - weights
    kv_tokens = max(0, kv // per_token)
    bucket = w.sync_bucket_bytes
    max_fraction = max(0.0, math.floor(100 * (budget - bucket) / mem) / 100)  # rounded down: it fits
    reasons = []
    if pool + bucket > budget:
        reasons.append(
            f"engine: its static pool {_gib(pool)} (rollout.mem_fraction_static={w.engine_mem_fraction} x "
            f"{gpu_mem_gib:g} GiB) + one received bucket {_gib(bucket)} exceed {_gib(budget)}; lower "
            f"rollout.mem_fraction_static (at most {max_fraction:.2f}) or sync.bucket_mb"
        )
    if kv_tokens < w.seq_len:
        reasons.append(
            f"engine: its weights ({_gib(weights)}) leave room for {kv_tokens} KV tokens, less than one "
            f"sequence ({w.seq_len}); raise rollout.engine_tp or rollout.mem_fraction_static"
        )
    return EnginePool(
        first_rank=roles.learners,
        gpus=roles.engine_ranks,
        engines=roles.engines,
        engine_tp=w.engine_tp,
        mem_fraction=w.engine_mem_fraction,
        gpu_mem=mem,
        weights=weights,
        kv_cache=max(0, kv),
        kv_tokens=kv_tokens,
        received_bucket=bucket,
        reserve=reserve,
        budget=budget,
        max_kv_tokens=max(0, (budget - bucket - weights) // per_token),
        max_mem_fraction=max_fraction,
        reasons=tuple(reasons),
    )


def plan_disaggregated(
    cfg: Any, arch: ModelArch, *, nodes: int, gpus_per_node: int, gpu_mem_gib: float
) -> DisaggregatedPlan:
    """Both pools of a disaggregated megagrpo config `cfg` on nodes x gpus_per_node GPUs (the launch's
    ranks, learner and engine together)."""
    if gpu_mem_gib <= 0:
        raise MegagrpoError(f"--gpu-mem-gib must be > 0, got {gpu_mem_gib}")
    r = cfg.rollout
    roles = rank_roles(nodes * gpus_per_node, r.engine_tp, r.num_engines, disaggregated=True, on_gpu=True)
    w = workload_from_config(cfg, roles.learners, engines=roles.engines)
    w = replace(w, offload_in_rollout=False)
    return DisaggregatedPlan(
        gpu_mem_gib=gpu_mem_gib,
        learner=plan_learner_pool(arch, w, gpu_mem_gib=gpu_mem_gib, engines=roles.engines),
        engine=plan_engine_pool(arch, w, roles, gpu_mem_gib=gpu_mem_gib),
    )
