"""Routing replay (R2/R3) on megatron-core's `RouterReplay`, and router statistics during learner passes.

One `StepReplay` per training step (`StepReplay.for_step(mode, learner, batch)`, every rank, same batch):

* `old_pass_hooks()` for the old-policy forward: R2 RECORDs the learner's own top-k, R3 REPLAYs the
  sampler's `batch["routes"]`, mode "none" only observes. Every pass records, per token and MoE layer,
  the learner's own top-k, the routes it used and log r_old at them (the RSPO reference).
* `train_hooks(rows)` for the training forward of each mini-batch (`rows` = its rows of the global
  batch): R2 replays the recorded routes, R3 the sampler's, also in the activation-recompute forward of
  the backward (REPLAY_BACKWARD). Every pass measures |log r_theta - log r_old| at the old routes.
* `token_weights(data)` inside the loss function: the RSPO weight gamma `[b, T]` of the micro-batch
  whose forward just ran (stop-gradient).
* `old_pass_metrics()` and `step_metrics()`: collectives (every rank must call them, in the same order);
  they return the same dict on every rank.

Alignment. Routes are kept as route tables `[B, T, L, K]` in the padded layout of the step's batch (see
`megagrpo.moe.routes`): the global batch, or with `sharded=True` this DP rank's rows (the trainer's data
plane). The learner's router order (padded `[T_mb, b]` or packed THD, the TP rank's sequence-parallel
slice, the micro-batch's samples, the pipeline stage's own layers) comes from
`megagrpo.learner.layout.router_token_positions`. A rank fills the table entries of the tokens and
layers it saw; the entries are merged after the pass over the ranks that share the batch (each entry has
exactly one owner: SP slices and PP stages, and DP shards of a global batch, are disjoint), so the next
pass may split the batch differently. Sharded, that merge stays inside the DP rank's replica (TP x CP x
PP) and the metrics are summed over DP; no replay collective spans WORLD.

Accounting (per step, all passes): a route is consumed when a router call in a hooked forward takes it.
`moe/replay_unconsumed` counts (token, layer) routes of real tokens that no router consumed in a pass
plus routes queued for the recompute that no recompute consumed; `moe/replay_reused` those consumed more
than once in a pass; `moe/replay_fallback_tokens` real tokens (the last token of a sequence excepted,
whose route the sampler never computes and whose output no loss uses) replayed with a filler route
because the table had none. All three are 0 in a healthy run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megagrpo.errors import MegagrpoError
from megagrpo.moe import routes as rt
from megagrpo.moe import stats
from megagrpo.moe.routers import RouterSlot, RouterTaps, router_taps

MODES = ("none", "R2", "R3")


@dataclass
class _Ctx:
    """The micro-batch whose chunk forward is running: its router tokens on this rank."""

    mb: Any  # megagrpo.learner.forward.MicroBatch
    prow: Tensor  # [n] row of the pass batch (-1 = padding slot)
    grow: Tensor  # [n] row of the global batch (-1 = padding slot)
    pos: Tensor  # [n] position
    valid: Tensor  # [n] bool, a real token
    last: Tensor  # [n] bool, the last token of its sequence


class _Pass:
    """One hooked pass (the old-policy forward or one mini-batch's training step)."""

    def __init__(self, step: StepReplay, kind: str, mode: str, rows: Tensor, source: Tensor | None) -> None:
        self.step, self.kind, self.mode = step, kind, mode  # mode: record | replay | observe
        self.rows = rows.to(torch.int64)  # [Bp] global row of each pass row
        self.source = source  # [B, T, L, K] route table replayed (mode replay)
        B, T, L, K = len(rows), step.T, step.L, step.K
        dev, ids = step.device, rt.route_dtype(step.E)
        # consumption counts saturate at 3 (only 0, 1 and "more than 1" are read); uint8 so NCCL can sum them
        self.counts = torch.zeros(B, T, L, dtype=torch.uint8, device=dev) if mode == "replay" else None
        self.fallback = torch.zeros(B, T, dtype=torch.uint8, device=dev)
        self.own: Tensor | None = torch.full((B, T, L, K), rt.NO_ROUTE, dtype=ids, device=dev)
        if kind == "old":
            self.used = torch.full((B, T, L, K), rt.NO_ROUTE, dtype=ids, device=dev)
            self.logr = torch.zeros(B, T, L, K, dtype=torch.float32, device=dev)
        else:
            self.dlogr = torch.zeros(B, T, L, dtype=torch.float32, device=dev)  # |d log r| mean over K
        self.full_dlogr: Tensor | None = None  # RSPO under PP: [Bp, T, L] from a pre-pass
        self.ctx: _Ctx | None = None
        self.armed: set[int] = set()  # routers given this micro-batch's routes (REPLAY_FORWARD)
        self.by_data: dict[int, Any] = {}  # id(mb.data) -> mb, for token_weights
        self.backward = kind == "train"  # runs a backward (recompute replays); False for RSPO pre-passes
        self.leftover = 0  # recompute routes never consumed (set when the pass ends)
        self.ended = False

    # -- ForwardHooks ------------------------------------------------------------------------------

    def before_forward(self, mb: Any, chunk: Any) -> None:
        from megatron.core import parallel_state

        from megagrpo.learner.layout import router_token_positions

        s = self.step
        s._activate(self)
        if mb.T != s.T:
            raise MegagrpoError(
                f"the learner batch has {mb.T} columns but the replay was set up for T={s.T}; pass the same "
                "global batch (sliced by rows only) to StepReplay.for_step and the learner"
            )
        cfg = s.taps.config
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sp = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
        T_mb = None if mb.packed is not None else int(mb.input_ids.shape[1])
        sample, pos = router_token_positions(
            mb.seq_lens, T=T_mb, packed=mb.packed, tp_rank=tp_rank, sp_size=sp
        )
        dev = s.device
        sample, pos = sample.to(dev), pos.to(dev)
        valid = sample >= 0
        samples = mb.samples.to(dev)
        prow = torch.where(valid, samples[sample.clamp_min(0)], torch.full_like(sample, -1))
        grow = torch.where(valid, self.rows[prow.clamp_min(0)], torch.full_like(sample, -1))
        lens = mb.seq_lens.to(dev)[sample.clamp_min(0)]
        self.ctx = _Ctx(mb, prow, grow, pos, valid, valid & (pos == lens - 1))
        self.by_data[id(mb.data)] = mb
        self.armed.clear()
        if self.mode == "replay":
            for slot in s.taps.by_chunk.get(id(chunk), []):
                idx, missing = rt.lookup(self.source, grow, pos, slot.moe, num_experts=s.E)
                bad = missing & ~self.ctx.last
                if bad.any():
                    self.fallback[prow[bad], pos[bad]] = 1
                slot.replay.set_target_indices(idx)
                slot.pushes += 1
                self.armed.add(id(slot))

    def after_forward(self, mb: Any, chunk: Any) -> None:
        self.ctx = None

    # -- RouterPass ----------------------------------------------------------------------------------

    def in_forward(self) -> bool:
        return self.ctx is not None

    def router_pre(self, slot: RouterSlot, hidden: Tensor) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        c = self.ctx
        n = int(hidden.shape[0]) * int(hidden.shape[1])
        if n != c.prow.numel():
            raise RuntimeError(
                f"router layer {slot.moe} sees {n} tokens, the layout predicts {c.prow.numel()} "
                "(megagrpo.learner.layout.router_token_positions disagrees with the model input)"
            )
        rr = slot.replay
        if self.mode == "observe":
            if rr is not None:
                rr.clear_router_replay_action()
            return
        if self.mode == "record":
            rr.set_router_replay_action(RouterReplayAction.RECORD)
            return
        if id(slot) not in self.armed:
            raise RuntimeError(f"router of MoE layer {slot.moe} runs in a chunk the replay hooks did not arm")
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        have = c.valid & (self.source[c.grow.clamp_min(0), c.pos, slot.moe, 0] != rt.NO_ROUTE)
        at = (c.prow[have], c.pos[have], slot.moe)
        self.counts[at] = (self.counts[at] + 1).clamp_max(3)

    def router_post(self, slot: RouterSlot, hidden: Tensor) -> None:
        c, s = self.ctx, self.step
        v = c.valid
        prow, pos, grow = c.prow[v], c.pos[v], c.grow[v]
        logits = slot.logits(hidden)
        own = slot.own_topk(logits) if (self.own is not None or self.mode == "observe") else None
        if self.own is not None:
            self.own[prow, pos, slot.moe] = own[v].to(self.own.dtype)
        if self.kind == "old":
            if self.mode == "record":
                used = slot.replay.get_recorded_indices()
            elif self.mode == "replay":
                used = slot.replay.target_topk_idx
            else:
                used = own
            used = used.to(torch.int64)[v]
            self.used[prow, pos, slot.moe] = used.to(self.used.dtype)
            self.logr[prow, pos, slot.moe] = s._router_logp(logits[v], used)
        elif s.old_used is not None:
            old = s.old_used[grow, pos, slot.moe]
            have = old[:, 0] != rt.NO_ROUTE
            new_lp = s._router_logp(logits[v][have], old[have])
            d = (new_lp - s.old_logr[grow[have], pos[have], slot.moe]).abs().mean(-1)
            self.dlogr[prow[have], pos[have], slot.moe] = d

    # -- end of pass -----------------------------------------------------------------------------------

    def end(self) -> None:
        """Count the recompute routes left in the routers' queues; forget the queued routes."""
        if self.ended:
            return
        self.ended = True
        taps = self.step.taps
        if self.mode == "replay" and self.backward and self.step.recompute_routers:
            self.leftover = sum(max(sl.pushes - sl.pops, 0) for sl in taps.slots)
        if taps.active is self:
            taps.active = None
        taps.reset_replay()


def pass_table_bytes(rows: int, T: int, L: int, K: int) -> int:
    """Bytes of the route tables live during one step's old-policy pass under R3 over `rows` rows of T
    columns (what `_Pass.__init__` and `StepReplay` allocate): the sampler's routes, the pass's own and
    used routes (int16 each, `routes.route_dtype`), log r at the used routes (fp32), consumption counts
    (uint8 per layer) and fallback flags (uint8 per token). For `tools/bench_rows.py`; keep in step with
    the allocations."""
    n = rows * T
    return n * L * K * (2 + 2 + 2 + 4) + n * L + n


class _Hooks:
    """`megagrpo.learner.forward.ForwardHooks` of one pass."""

    def __init__(self, p: _Pass) -> None:
        self._p = p

    def before_forward(self, mb: Any, chunk: Any) -> None:
        self._p.before_forward(mb, chunk)

    def after_forward(self, mb: Any, chunk: Any) -> None:
        self._p.after_forward(mb, chunk)


class StepReplay:
    """Routing replay and router statistics for one training step. See the module doc."""

    def __init__(
        self,
        mode: str,
        taps: RouterTaps,
        batch: dict[str, Tensor],
        *,
        device: torch.device,
        gamma_min: float = stats.DEFAULT_GAMMA_MIN,
        pipeline_parallel: int = 1,
        router_shift: bool = False,
        learner: Any = None,
        sharded: bool = False,
        merge_group: Any = None,
        reducer: Any = None,
    ) -> None:
        if mode not in MODES:
            raise MegagrpoError(f"replay={mode!r}; use one of {MODES}")
        if not 0.0 <= gamma_min <= 1.0:
            raise MegagrpoError(f"algo.router_shift_gamma_min={gamma_min} must be in [0, 1]")
        self.mode, self.taps, self.device, self.gamma_min = mode, taps, device, gamma_min
        self.pp, self.router_shift, self.learner = pipeline_parallel, router_shift, learner
        # sharded: `batch` is this DP rank's rows; tables merge over the ranks that share those rows
        # (`merge_group`, None = alone) and metrics reduce over DP (`reducer`). Otherwise every rank holds
        # the global batch and tables merge over WORLD.
        self.sharded, self.merge_group, self.reducer = sharded, merge_group, reducer
        if router_shift and pipeline_parallel > 1 and learner is None:
            raise MegagrpoError("RSPO with pipeline parallelism needs the learner (use StepReplay.for_step)")
        self._inputs = {k: batch[k] for k in ("input_ids", "seq_lens", "attention_mask") if k in batch}
        if "input_ids" not in batch or batch["input_ids"].dim() != 2:
            raise MegagrpoError("StepReplay.for_step needs the global batch with 'input_ids' [B, T]")
        self.B, self.T = (int(x) for x in batch["input_ids"].shape)
        if "seq_lens" in batch:
            self.seq_lens = batch["seq_lens"].to(device=device, dtype=torch.int64)
        elif "attention_mask" in batch:
            self.seq_lens = batch["attention_mask"].to(device).bool().sum(-1).to(torch.int64)
        else:
            raise MegagrpoError("StepReplay.for_step needs 'seq_lens' [B] (or 'attention_mask') in the batch")
        self.L, self.K, self.E = len(taps.moe_layers), taps.topk, taps.num_experts
        self.real = rt.real_tokens(self.seq_lens, self.T)  # [B, T]
        lm = batch.get("loss_mask")
        lm = lm.to(device).bool() & self.real if lm is not None else self.real
        # Statistics are taken at the positions that PREDICT a loss token (logp[:, t] is computed at
        # position t - 1, whose routing is that of input token t - 1).
        self.pred_mask = torch.zeros_like(lm)
        self.pred_mask[:, :-1] = lm[:, 1:]
        c = taps.config
        self.score = "probs" if c.moe_router_score_function == "sigmoid" else "logits"
        self.recompute_routers = c.recompute_granularity == "full" or (
            c.recompute_granularity == "selective" and "moe" in (c.recompute_modules or [])
        )
        self.sampler_routes: Tensor | None = None
        if "routes" in batch:
            self.sampler_routes = rt.validate_sampler_routes(
                batch["routes"].to(device),
                self.seq_lens,
                T=self.T,
                moe_layers=taps.moe_layers,
                num_layers=c.num_layers,
                topk=self.K,
                num_experts=self.E,
            )
        if mode == "R3" and self.sampler_routes is None:
            raise MegagrpoError(
                "replay=R3 needs the sampler's routes (batch['routes']); enable routed-expert capture in the "
                "rollout or use replay=R2"
            )
        if mode != "none" and any(sl.replay is None for sl in taps.slots):
            raise MegagrpoError(
                f"replay={mode} needs the model built with routing replay (LearnerConfig.routing_replay=True)"
            )
        taps.reset_replay()
        taps.active = None
        self.old: _Pass | None = None
        self.old_used: Tensor | None = None  # [B, T, L, K] merged routes used by the old pass
        self.old_own: Tensor | None = None  # [B, T, L, K] merged own top-k of the old pass
        self.old_logr: Tensor | None = None  # [B, T, L, K] log r_old at old_used
        self.train: list[_Pass] = []
        self._prepasses: list[_Pass] = []  # RSPO under PP: forward-only passes that measure gamma
        self._own_passes: list[_Pass] = []  # the first and the latest training pass (agreement)
        self._old_metrics: dict[str, float] | None = None

    @classmethod
    def for_step(
        cls,
        mode: str,
        learner: Any,
        batch: dict[str, Tensor],
        *,
        gamma_min: float = stats.DEFAULT_GAMMA_MIN,
        router_shift: bool = False,
        sharded: bool = False,
    ) -> StepReplay:
        """The step's replay: mode "R2", "R3" or "none" (statistics and RSPO weights only, no replay; works
        on a model built without routing replay). `batch` is the global batch (every rank the same), with
        `routes` int `[B, T, L, K]` when the sampler returned them (required for R3). Bad routes raise
        MegagrpoError here, before any pass. `router_shift` (RSPO) announces that the loss will call
        `token_weights`: under pipeline parallelism each mini-batch then gets a forward-only pre-pass that
        measures gamma over all stages (its layers live on other ranks than the loss)."""
        from megatron.core import parallel_state

        taps = router_taps(learner)
        device = next(learner.model[0].parameters()).device
        merge_group, reducer = None, None
        if sharded:
            from megagrpo.diagnostics.reduce import DistReducer

            merge_group = learner.mesh.replica
            dp_group = learner.mesh.data_parallel_group()
            reducer = DistReducer(dp_group) if dp_group is not None else None
        return cls(
            mode,
            taps,
            batch,
            device=device,
            gamma_min=gamma_min,
            pipeline_parallel=parallel_state.get_pipeline_model_parallel_world_size(),
            router_shift=router_shift,
            learner=learner,
            sharded=sharded,
            merge_group=merge_group,
            reducer=reducer,
        )

    # -- merges over the ranks that share this batch ------------------------------------------------------

    def _merge_routes(self, t: Tensor) -> Tensor:
        if self.sharded and self.merge_group is None:
            return t
        return rt.merge_routes(t, self.E, group=self.merge_group)

    def _merge_sum(self, t: Tensor) -> Tensor:
        if self.sharded and self.merge_group is None:
            return t
        return rt.all_reduce_sum(t, group=self.merge_group)

    # -- passes --------------------------------------------------------------------------------------

    def _activate(self, p: _Pass) -> None:
        cur = self.taps.active
        if cur is p:
            return
        if cur is not None:
            cur.end()
        self.taps.reset_replay()
        self.taps.active = p

    def old_pass_hooks(self) -> _Hooks:
        """Hooks for the old-policy forward over the whole global batch (the learner batch without
        `routes`, same rows): R2 records, R3 replays the sampler's routes, none observes."""
        if self.old is not None:
            raise RuntimeError("old_pass_hooks() is called once per step")
        mode = {"R2": "record", "R3": "replay", "none": "observe"}[self.mode]
        self.old = _Pass(self, "old", mode, torch.arange(self.B), self.sampler_routes)
        return _Hooks(self.old)

    def _finish_old(self) -> None:
        if self.old is None or self.old_used is not None:
            return
        p = self.old
        p.end()
        self.old_used = self._merge_routes(p.used)
        self.old_own = self._merge_routes(p.own)
        self.old_logr = self._merge_sum(p.logr)

    def old_routes(self) -> Tensor | None:
        """Collective. `[B, T, L, K]` (`routes.route_dtype`): the routes the old pass used (R2: recorded, R3: the sampler's
        with fillers, none: the router's own), -1 at padding; None before the old pass."""
        self._finish_old()
        return self.old_used

    def train_hooks(self, rows: Tensor) -> _Hooks:
        """Hooks for the training step of the mini-batch made of global-batch rows `rows` `[b]`."""
        self._finish_old()
        if self.taps.active is not None:
            self.taps.active.end()
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).to(self.device)
        if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= self.B:
            raise MegagrpoError(f"train_hooks(rows): rows must index the global batch of {self.B} rows")
        if self.mode == "R2":
            if self.old_used is None:
                raise MegagrpoError(
                    "replay=R2 replays the routes recorded in the old-policy pass, which did not run; set "
                    "algo.old_logp=recompute or use replay=R3"
                )
            source, mode = self.old_used, "replay"
        elif self.mode == "R3":
            source, mode = self.sampler_routes, "replay"
        else:
            source, mode = None, "observe"
        full_dlogr = None
        if self.router_shift and self.pp > 1 and self.old_used is not None:
            full_dlogr = self._measure_shift(mode, rows, source)
        p = _Pass(self, "train", mode, rows, source)
        p.full_dlogr = full_dlogr
        self.train.append(p)
        if p.own is not None:
            # keep the first pass's own routes and the latest one's (the last mini-batch at the end)
            self._own_passes = self._own_passes[:1] + [p]
            for q in self.train[1:-1]:
                q.own = None
        return _Hooks(p)

    def _measure_shift(self, mode: str, rows: Tensor, source: Tensor | None) -> Tensor:
        """Forward-only pass over the mini-batch with the same routes: per-layer |d log r| `[b, T, L]`
        summed over all ranks (every stage's layers), for token_weights under pipeline parallelism."""
        from megagrpo.learner.forward import forward_logprobs

        pre = _Pass(self, "train", mode, rows, source)
        pre.own, pre.backward = None, False
        self._prepasses.append(pre)
        cpu_rows = rows.cpu()
        sub = {k: v[cpu_rows.to(v.device)] for k, v in self._inputs.items()}
        opts = self.learner.run_options(with_entropy=False, local_rows=self.sharded)
        forward_logprobs(self.learner.model, sub, opts, hooks=_Hooks(pre))
        pre.end()
        return self._merge_sum(pre.dlogr)

    # -- RSPO ------------------------------------------------------------------------------------------

    def _router_logp(self, logits: Tensor, routes: Tensor) -> Tensor:
        """log r(e_k) `[n, K]`: r the router's softmax over all experts (sigmoid scores for sigmoid routers)."""
        x = logits if self.score == "logits" else torch.sigmoid(logits)
        idx = routes.to(torch.int64).unsqueeze(1)  # gather wants int64; tables keep int16
        return stats.gather_router_logp(x.unsqueeze(1), idx, scores=self.score)[:, 0]

    def token_weights(self, data: dict[str, Tensor]) -> Tensor:
        """RSPO weight (arXiv 2510.23027, Sec. 3) of the micro-batch `data` (the dict the loss function
        receives, `mb.data`) whose forward just ran: float32 `[b, T]`, detached,
        gamma = max(exp(-(1/L) sum_l (1/K) sum_k |log r_theta(e_k) - log r_old(e_k)|), gamma_min) over the
        experts e_k the old pass used; 1.0 at padding and at tokens without an old route.

        Collective over the tensor-parallel group (every TP rank's loss function calls it). Needs the
        old-policy pass. With pipeline parallelism the last stage cannot see the other stages' routers
        within the same forward: for_step(..., router_shift=True) measures gamma in a forward-only
        pre-pass per mini-batch (same weights and routes, so the same values; costs one forward).
        """
        from megatron.core import parallel_state

        p = self.taps.active
        if p is None or p.kind != "train" or id(data) not in p.by_data:
            raise RuntimeError(
                "token_weights(data) must be called from the loss function of a hooked train step"
            )
        if self.old_used is None:
            raise MegagrpoError("algo.router_shift needs the old-policy pass: set algo.old_logp=recompute")
        mb = p.by_data[id(data)]
        rows = mb.samples.to(self.device)
        if p.full_dlogr is not None:
            d = p.full_dlogr[rows]  # [b, T, L] measured by the pre-pass over every stage
        elif self.pp > 1:
            raise MegagrpoError(
                "algo.router_shift with mesh.pp > 1: create the step's replay with "
                "StepReplay.for_step(..., router_shift=True) so gamma is measured over every pipeline stage"
            )
        else:
            d = p.dlogr[rows]  # [b, T, L], this TP rank's sequence slice only
            d = rt.all_reduce_sum(d, parallel_state.get_tensor_model_parallel_group())
        g = p.rows[rows]
        have = self.real[g] & (self.old_used[g][..., 0] != rt.NO_ROUTE).all(-1)
        gamma = torch.where(
            have, torch.exp(-d.mean(-1)).clamp_min(self.gamma_min), torch.ones_like(d[..., 0])
        )
        # position t - 1 predicts token t: move the weights onto the token columns of logp (1 beyond the end)
        gamma = torch.cat([torch.ones_like(gamma[:, :1]), gamma[:, :-1]], dim=1)
        return torch.where(self.real[g], gamma, torch.ones_like(gamma)).detach()

    # -- metrics ---------------------------------------------------------------------------------------

    def old_pass_metrics(self) -> dict[str, float]:
        """Collective. Rollout vs learner-old top-k agreement (when the batch has routes), expert-load
        entropy of the old pass's own top-k and its drift since the previous step."""
        if self._old_metrics is not None:
            return dict(self._old_metrics)
        self._finish_old()
        out: dict[str, float] = {}
        if self.old_own is None:
            self._old_metrics = out
            return out
        own_ok = (self.old_own[..., 0] != rt.NO_ROUTE).all(-1)
        if self.sampler_routes is not None:
            have = (self.sampler_routes[..., 0] != rt.NO_ROUTE).all(-1)
            mask = self.pred_mask & have & own_ok
            agr = stats.topk_agreement(
                self.sampler_routes, self.old_own, mask, n_experts=self.E, reducer=self.reducer
            )
            out.update(agr.metrics("rollout_old"))
        counts = stats.expert_counts(self.old_own, self.real & own_ok, n_experts=self.E, reducer=self.reducer)
        load = stats.load_distribution(counts)
        out.update(stats.load_metrics(load))
        tracker = self.taps.state.setdefault("drift", stats.LoadDriftTracker())
        out.update(tracker.update(load))
        self._old_metrics = out
        return dict(out)

    def step_metrics(self) -> dict[str, float]:
        """Collective, after the last training pass. Replay accounting over the step's passes, learner-old
        vs current agreement on the first and last mini-batch, RSPO gamma statistics."""
        if self.taps.active is not None:
            self.taps.active.end()
        out: dict[str, float] = {}
        if self.mode != "none":
            unconsumed = reused = fallback = 0
            for p in ([self.old] if self.old is not None else []) + self._prepasses + self.train:
                if p.mode != "replay":
                    continue
                counts = self._merge_sum(p.counts)
                expect = self.real[p.rows].unsqueeze(-1) & (p.source[p.rows][..., 0] != rt.NO_ROUTE)
                unconsumed += int((expect & (counts == 0)).sum()) + int(
                    self._merge_sum(torch.tensor(p.leftover, device=self.device))
                )
                reused += int((counts > 1).sum())
                fallback += int((self._merge_sum(p.fallback) > 0).sum())
            totals = torch.tensor([unconsumed, reused, fallback], dtype=torch.float64, device=self.device)
            if self.reducer is not None:
                totals = self.reducer.sum(totals)
            out["moe/replay_unconsumed"] = float(totals[0])
            out["moe/replay_reused"] = float(totals[1])
            out["moe/replay_fallback_tokens"] = float(totals[2])
        if self.old_own is not None and self._own_passes:
            last = len(self._own_passes) - 1
            for i, p in enumerate(self._own_passes):
                own = self._merge_routes(p.own)
                old = self.old_own[p.rows]
                ok = (own[..., 0] != rt.NO_ROUTE).all(-1) & (old[..., 0] != rt.NO_ROUTE).all(-1)
                agr = stats.topk_agreement(
                    old, own, self.pred_mask[p.rows] & ok, n_experts=self.E, reducer=self.reducer
                )
                if i == 0:
                    out.update(agr.metrics("old_current_first"))
                if i == last:
                    out.update(agr.metrics("old_current"))
        if self.old_used is not None and self.train:
            d = torch.cat([self._merge_sum(p.dlogr) for p in self.train])  # [sum Bp, T, L]
            rows = torch.cat([p.rows for p in self.train])
            have = (self.old_used[rows][..., 0] != rt.NO_ROUTE).all(-1)
            shift = stats.router_shift_from_logp(
                d.unsqueeze(-1), torch.zeros_like(d).unsqueeze(-1), self.pred_mask[rows] & have,
                gamma_min=self.gamma_min, reducer=self.reducer,
            )  # fmt: skip
            out.update(shift.metrics())
        return out
