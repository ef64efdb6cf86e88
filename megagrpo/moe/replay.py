"""Routing replay (R2/R3) on megatron-core's `RouterReplay`, and router statistics during learner passes.

One `StepReplay` per training step (`StepReplay.for_step(mode, learner, batch)`, every rank):

* `old_pass_hooks()` for the old-policy forward: R2 RECORDs the learner's own top-k, R3 REPLAYs the
  sampler's `batch["routes"]` (every MoE layer's, or with `route_layers` only this pipeline stage's, as
  the trainer's data plane sends them), mode "none" only observes. Every pass keeps, per token and MoE layer, the
  learner's own top-k, the routes it used and log r_old at them (the RSPO reference).
* `train_hooks(rows, num_micro_batches=...)` for the training forward of each mini-batch (`rows` = its
  rows of the step's batch): R2 replays the recorded routes, R3 the sampler's, also in the
  activation-recompute forward of the backward (REPLAY_BACKWARD). Every pass measures
  |log r_theta - log r_old| at the old routes.
* `token_weights(data)` inside the loss function: the RSPO weight gamma `[b, T]` of the micro-batch
  whose forward just ran (stop-gradient).
* `old_pass_metrics()` and `step_metrics()`: collectives (every rank must call them, in the same order);
  they return the same dict on every rank.

Memory: nothing on the device is sized by the batch times the layers. A router call allocates what its
micro-batch's tokens on this rank need (`[n, K]` routes and lookups, `[n]` consumption counts, the
recomputed `[n, E]` router logits); `peak_table_bytes` is the most one micro-batch allocated. What must
outlive the old pass (its used routes: R2's replay source; its own top-k; log r_old) goes to a host
`_TokenStore` holding only the (token, layer) pairs this rank's routers saw: its sequence-parallel slice
of each micro-batch and its pipeline stage's layers (`store_bytes`). Statistics are carried by per-token
scalars of the pass rows (`[rows, T]`, like the logprobs: fallback flags, sum of |d log r| over layers,
layer counts) and running sums (`[L]` agreement and |d log r|, `[L, E]` expert load).

Alignment. A token is keyed by its (row, position) in the step's batch (`routes.token_keys`). The
learner's router order (padded `[T_mb, b]` or packed THD, the TP rank's sequence-parallel slice, the
micro-batch's samples, the stage's layers) comes from `megagrpo.learner.layout.router_token_positions`.
A training pass finds a token's old-pass values in this rank's store, so it must run the old pass's
micro-batches: the trainer does (`sharded=True`: every pass runs the data plane's plan, and a pass that
does not raises). Without `sharded` every rank holds the global batch and the learner splits it over DP
by itself, so the old pass's store is gathered over WORLD and any later split finds every token.
Sharded, per-token scalars merge inside the DP rank's replica (TP x CP x PP) and sums reduce over DP;
no replay collective spans WORLD.

Accounting (per step, all passes): a route is consumed when a router call in a hooked forward takes it.
`moe/replay_unconsumed` counts (token, layer) routes of real tokens that no router consumed in a
micro-batch's forward plus routes queued for the recompute that no recompute consumed;
`moe/replay_reused` those consumed more than once in a forward; `moe/replay_fallback_tokens` real tokens
(the last token of a sequence excepted, whose route the sampler never computes and whose output no loss
uses) replayed with a filler route because no route was known. All three are 0 in a healthy run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megagrpo.errors import MegagrpoError
from megagrpo.moe import routes as rt
from megagrpo.moe import stats
from megagrpo.moe.routers import RouterSlot, RouterTaps, router_taps

MODES = ("none", "R2", "R3")
_WORLD = object()  # merge over the default group (the global-batch mode)


@dataclass
class _Ctx:
    """The micro-batch whose chunk forward is running: its router tokens on this rank."""

    prow: Tensor  # [n] row of the pass batch (-1 = padding slot)
    grow: Tensor  # [n] row of the step's batch (-1 = padding slot)
    pos: Tensor  # [n] position
    valid: Tensor  # [n] bool, a real token
    last: Tensor  # [n] bool, the last token of its sequence
    pred: Tensor  # [n] bool, the token predicts a loss token (where statistics are taken)
    keys: Tensor  # [n] host int64 token keys (-1 = padding slot)
    fill_keys: Tensor  # [n] filler keys (routes.filler_keys)
    grow_h: Tensor  # host copies for lookups in host tables
    pos_h: Tensor
    valid_h: Tensor


def _gather_rows(t: Tensor, group: Any) -> Tensor:
    """Concatenation, in rank order, of every rank's `[n_r, ...]` (any n_r) over `group`."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    from megagrpo.diagnostics.reduce import DistReducer

    wide = t.to(torch.int32) if t.dtype == torch.int16 else t  # neither gloo nor NCCL moves int16
    return DistReducer(group).gather(wide.reshape(-1)).to(t.dtype).view(-1, *t.shape[1:])


class _TokenStore:
    """The old pass's values per (token, MoE layer) for the tokens this rank's routers saw, in host memory:
    per layer the sorted token keys and, at each, the used route and own top-k (`route_dtype` `[K]`) and log
    r at the used route (fp32 `[K]`)."""

    def __init__(self, K: int, ids: torch.dtype) -> None:
        self.K, self.ids = K, ids
        self._parts: dict[int, list[tuple[Tensor, ...]]] = {}
        self.cols: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # layer -> (keys, used, own, logr)

    def add(self, layer: int, keys: Tensor, used: Tensor, own: Tensor, logr: Tensor) -> None:
        cpu = torch.device("cpu")
        part = (keys.to(cpu), used.to(cpu, self.ids), own.to(cpu, self.ids), logr.to(cpu, torch.float32))
        self._parts.setdefault(layer, []).append(part)

    def finish(self, num_layers: int, merge_group: Any = None) -> None:
        """Sort each layer's entries by key; with `merge_group` first gather every rank's entries."""
        for layer in range(num_layers):  # every layer on every rank: the gathers are collectives
            parts = self._parts.pop(layer, [])
            if parts:
                cols = [torch.cat(c) for c in zip(*parts, strict=True)]
            else:
                e = torch.empty(0, self.K)
                cols = [torch.empty(0, dtype=torch.int64), e.to(self.ids), e.to(self.ids), e.float()]
            if merge_group is not None:
                cols = [_gather_rows(c, None if merge_group is _WORLD else merge_group) for c in cols]
            order = torch.argsort(cols[0])
            self.cols[layer] = tuple(c[order] for c in cols)  # type: ignore[assignment]

    def get(self, layer: int, keys: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(found `[n]`, used, own `[n, K]` (NO_ROUTE where not found), logr `[n, K]`) for host keys `[n]`."""
        sk, used, own, logr = self.cols[layer]
        if sk.numel() == 0:
            found = torch.zeros(len(keys), dtype=torch.bool)
            none = torch.full((len(keys), self.K), rt.NO_ROUTE, dtype=self.ids)
            return found, none, none, torch.zeros(len(keys), self.K)
        idx = torch.searchsorted(sk, keys).clamp_max(sk.numel() - 1)
        found = (sk[idx] == keys) & (keys >= 0)
        f = found.unsqueeze(1)
        no = torch.full((), rt.NO_ROUTE, dtype=self.ids)
        return found, torch.where(f, used[idx], no), torch.where(f, own[idx], no), logr[idx]

    def nbytes(self) -> int:
        return sum(c.nbytes for cols in self.cols.values() for c in cols)


def micro_batch_table_bytes(tokens: int, layers: int, K: int, E: int) -> int:
    """Upper bound of the replay tables one micro-batch allocates on a rank (what `peak_table_bytes`
    measures) for `tokens` router tokens over `layers` MoE layers: per (token, layer) the router logits
    (fp32 E), the replayed route and the own top-k (int64 K each), the old pass's values looked up or
    recorded (int64 K and fp32 K, twice), a consumption count and flags. For `tools/bench_rows.py`."""
    return tokens * layers * (4 * E + K * (8 + 8 + 2 * (8 + 4)) + 8)


def store_bytes_per_route(K: int) -> int:
    """Host bytes `_TokenStore` keeps per (token, layer) it holds: key, used route, own top-k, log r."""
    return 8 + K * (2 + 2 + 4)


class _Pass:
    """One hooked pass (the old-policy forward, one mini-batch's training step, or an RSPO pre-pass)."""

    def __init__(self, step: StepReplay, kind: str, mode: str, rows: Tensor) -> None:
        self.step, self.kind, self.mode = step, kind, mode  # mode: record | replay | observe
        self.rows = rows.to(device=step.device, dtype=torch.int64)  # [Bp] step row of each pass row
        self.rows_h = self.rows.cpu()
        Bp, T, L, dev = len(rows), step.T, step.L, step.device
        f64 = dict(dtype=torch.float64, device=dev)
        self.fallback = torch.zeros(Bp, T, dtype=torch.uint8, device=dev)
        self.unconsumed = self.reused = 0
        self.agree = torch.zeros(2, L, **f64)  # per layer: summed top-k overlap, token count
        self.agree_turns = torch.zeros(2, step.num_turns, **f64)  # per turn: overlap over (token, layer)
        if kind == "old":
            self.store: _TokenStore | None = _TokenStore(step.K, rt.route_dtype(step.E))
            self.n_layers = torch.zeros(Bp, T, dtype=torch.uint8, device=dev)  # layers routed, per token
            self.load = torch.zeros(L, step.E, **f64)  # own top-k slots per layer and expert
        else:
            self.d_tok = torch.zeros(Bp, T, dtype=torch.float32, device=dev)  # sum_l (1/K) sum_k |d log r|
            self.n_tok = torch.zeros(Bp, T, dtype=torch.uint8, device=dev)  # layers measured, per token
            self.dlayer = torch.zeros(2, L, **f64)  # per layer: summed |d log r| and count at pred tokens
        self.full: tuple[Tensor, Tensor] | None = None  # RSPO under PP: (d_tok, n_tok) over every stage
        self.ctx: _Ctx | None = None
        self.counts: dict[int, Tensor] = {}  # MoE layer -> [n] uint8 consumptions in this micro-batch
        self.expect: dict[int, Tensor] = {}  # MoE layer -> [n] bool, tokens that had a route to consume
        self.mb_bytes = 0
        self.by_data: dict[int, Any] = {}  # id(mb.data) -> mb, for token_weights
        self.backward = kind == "train"  # runs a backward (recompute replays); False for RSPO pre-passes
        self.leftover = 0  # recompute routes never consumed (set when the pass ends)
        self.ended = False

    def _note(self, *tensors: Tensor) -> None:
        self.mb_bytes += sum(t.nbytes for t in tensors)

    # -- ForwardHooks ------------------------------------------------------------------------------

    def before_forward(self, mb: Any, chunk: Any) -> None:
        from megatron.core import parallel_state

        from megagrpo.learner.layout import router_token_positions

        s = self.step
        s._activate(self)
        if mb.T != s.T:
            raise MegagrpoError(
                f"the learner batch has {mb.T} columns but the replay was set up for T={s.T}; pass the same "
                "batch (sliced by rows only) to StepReplay.for_step and the learner"
            )
        cfg = s.taps.config
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sp = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
        T_mb = None if mb.packed is not None else int(mb.input_ids.shape[1])
        sample, pos = router_token_positions(
            mb.seq_lens, T=T_mb, packed=mb.packed, tp_rank=tp_rank, sp_size=sp
        )
        sample, pos = sample.cpu().to(torch.int64), pos.cpu().to(torch.int64)
        valid = sample >= 0
        samples = mb.samples.cpu().to(torch.int64)
        prow = torch.where(valid, samples[sample.clamp_min(0)], torch.full_like(sample, -1))
        grow = torch.where(valid, self.rows_h[prow.clamp_min(0)], torch.full_like(sample, -1))
        lens = mb.seq_lens.cpu()[sample.clamp_min(0)]
        dev = s.device
        pred = valid & s.pred_mask_h[grow.clamp_min(0), pos]
        self.ctx = _Ctx(
            prow.to(dev), grow.to(dev), pos.to(dev), valid.to(dev), (valid & (pos == lens - 1)).to(dev),
            pred.to(dev), rt.token_keys(grow, pos, s.T), rt.filler_keys(grow, pos, s.T).to(dev), grow, pos,
            valid,
        )  # fmt: skip
        self.by_data[id(mb.data)] = mb
        self.counts.clear()
        self.expect.clear()
        self.mb_bytes = 0

    def after_forward(self, mb: Any, chunk: Any) -> None:
        s, c = self.step, self.ctx
        if self.mode == "replay":
            keep_queue = self.backward and s.recompute_routers
            for slot in s.taps.by_chunk.get(id(chunk), []):
                cnt = self.counts.get(slot.moe)
                if cnt is None:  # the router never ran in this forward: each route it had is unconsumed
                    _, missing = self._source(slot.moe)
                    self.unconsumed += int((c.valid & ~missing).sum())
                else:
                    self.unconsumed += int((self.expect[slot.moe] & (cnt == 0)).sum())
                    self.reused += int((cnt > 1).sum())
                if not keep_queue and slot.replay is not None:
                    # megatron queues every target for a recompute; no recompute will pop these
                    slot.pushes -= len(slot.replay.replay_backward_list)
                    slot.replay.replay_backward_list.clear()
        s.peak_table_bytes = max(s.peak_table_bytes, self.mb_bytes)
        self.counts.clear()
        self.expect.clear()
        self.ctx = None

    # -- RouterPass ----------------------------------------------------------------------------------

    def in_forward(self) -> bool:
        return self.ctx is not None

    def _source(self, layer: int) -> tuple[Tensor, Tensor]:
        """The routes to replay at `layer` for the current micro-batch: (int64 `[n, K]` on the device with
        fillers, bool `[n]` real tokens without a route)."""
        s, c = self.step, self.ctx
        if s.mode == "R3":
            got = s.sampler_routes[c.grow_h.clamp_min(0), c.pos_h, s._route_col[layer]]
        else:
            got = s.old.store.get(layer, c.keys)[1]
        return rt.with_fillers(got.to(s.device), c.valid, c.fill_keys, num_experts=s.E)

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
        src, missing = self._source(slot.moe)
        bad = missing & ~c.last
        if bad.any():
            self.fallback[c.prow[bad], c.pos[bad]] = 1
        rr.set_target_indices(src)
        slot.pushes += 1
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        has = c.valid & ~missing
        cnt = self.counts.get(slot.moe)
        if cnt is None:
            cnt = self.counts[slot.moe] = torch.zeros(n, dtype=torch.uint8, device=src.device)
            self.expect[slot.moe] = has
            self._note(src, cnt, has)
        cnt[has] = (cnt[has] + 1).clamp_max(3)  # only 0, 1 and "more than 1" are read

    def router_post(self, slot: RouterSlot, hidden: Tensor) -> None:
        c, s, layer = self.ctx, self.step, slot.moe
        v = c.valid
        logits = slot.logits(hidden)
        own = slot.own_topk(logits)
        self._note(logits, own)
        ov, lv = own[v], logits[v]
        if self.kind == "old":
            if self.mode == "record":
                used = slot.replay.get_recorded_indices()
            elif self.mode == "replay":
                used = slot.replay.target_topk_idx
            else:
                used = own
            uv = used.to(torch.int64)[v]
            logr = s._router_logp(lv, uv)
            self._note(logr)
            self.store.add(layer, c.keys[c.valid_h], uv, ov, logr)
            self.n_layers[c.prow[v], c.pos[v]] += 1
            self.load[layer] += torch.bincount(ov.reshape(-1), minlength=s.E).to(torch.float64)
            if s.sampler_routes is not None:
                sr = s.sampler_routes[c.grow_h[c.valid_h], c.pos_h[c.valid_h], s._route_col[layer]].to(
                    s.device, torch.int64
                )
                m = c.pred[v] & (sr[:, 0] != rt.NO_ROUTE)
                self._note(sr)
                overlap = stats.topk_overlap(sr[m], ov[m])
                self.agree[0, layer] += overlap.sum()
                self.agree[1, layer] += m.sum()
                if s.turns_pred is not None:
                    turn = s.turns_pred[c.grow_h[c.valid_h], c.pos_h[c.valid_h]].to(s.device)[m]
                    t = turn >= 0
                    self.agree_turns[0].index_add_(0, turn[t], overlap[t])
                    self.agree_turns[1].index_add_(0, turn[t], torch.ones_like(overlap[t]))
            return
        if s.old is None:
            return
        found, old_used, old_own, old_logr = s.old.store.get(layer, c.keys[c.valid_h])
        if not bool(found.all()):  # checked on the host: no device sync per router call
            raise RuntimeError(
                f"MoE layer {layer}: {int((~found).sum())} token(s) of this pass were not routed by the old "
                "pass on this rank; with StepReplay(sharded=True) every pass must run the old pass's "
                "micro-batches (megagrpo.learner.row_plan)"
            )
        old_used, old_own, old_logr = (t.to(s.device) for t in (old_used, old_own, old_logr))
        self._note(old_used, old_own, old_logr)
        d = (s._router_logp(lv, old_used) - old_logr).abs().mean(-1)  # (1/K) sum_k |d log r|, [n_valid]
        self.d_tok[c.prow[v], c.pos[v]] += d
        self.n_tok[c.prow[v], c.pos[v]] += 1
        pm = c.pred[v]
        self.dlayer[0, layer] += d[pm].to(torch.float64).sum()
        self.dlayer[1, layer] += pm.sum()
        if self.backward:  # training passes: learner-old vs current agreement
            self.agree[0, layer] += stats.topk_overlap(ov[pm], old_own[pm].to(torch.int64)).sum()
            self.agree[1, layer] += pm.sum()

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
        route_layers: list[int] | None = None,
        turns: Tensor | None = None,
        num_turns: int = 0,
    ) -> None:
        if mode not in MODES:
            raise MegagrpoError(f"replay={mode!r}; use one of {MODES}")
        if not 0.0 <= gamma_min <= 1.0:
            raise MegagrpoError(f"algo.router_shift_gamma_min={gamma_min} must be in [0, 1]")
        self.mode, self.taps, self.device, self.gamma_min = mode, taps, device, gamma_min
        self.pp, self.router_shift, self.learner = pipeline_parallel, router_shift, learner
        # sharded: `batch` is this DP rank's rows; per-token scalars merge over the ranks that share those
        # rows (`merge_group`, None = alone) and sums reduce over DP (`reducer`). Otherwise every rank holds
        # the global batch and merges go over WORLD.
        self.sharded, self.merge_group, self.reducer = sharded, merge_group, reducer
        if router_shift and pipeline_parallel > 1 and learner is None:
            raise MegagrpoError("RSPO with pipeline parallelism needs the learner (use StepReplay.for_step)")
        self._inputs = {k: batch[k] for k in ("input_ids", "seq_lens", "attention_mask") if k in batch}
        if "input_ids" not in batch or batch["input_ids"].dim() != 2:
            raise MegagrpoError("StepReplay.for_step needs the step's batch with 'input_ids' [B, T]")
        self.B, self.T = (int(x) for x in batch["input_ids"].shape)
        if "seq_lens" in batch:
            seq_lens = batch["seq_lens"].cpu().to(torch.int64)
        elif "attention_mask" in batch:
            seq_lens = batch["attention_mask"].cpu().bool().sum(-1).to(torch.int64)
        else:
            raise MegagrpoError("StepReplay.for_step needs 'seq_lens' [B] (or 'attention_mask') in the batch")
        self.L, self.K, self.E = len(taps.moe_layers), taps.topk, taps.num_experts
        real = rt.real_tokens(seq_lens, self.T)  # [B, T]
        lm = batch.get("loss_mask")
        lm = lm.cpu().bool() & real if lm is not None else real
        # Statistics are taken at the positions that PREDICT a loss token (logp[:, t] is computed at
        # position t - 1, whose routing is that of input token t - 1).
        pred = torch.zeros_like(lm)
        pred[:, :-1] = lm[:, 1:]
        self.real, self.pred_mask_h = real.to(device), pred
        # multi-turn rows: the model turn (0 .. num_turns - 1, else -1) of the token each position predicts,
        # so the rollout-vs-old agreement is also reported per turn (`moe/agreement_rollout_old/turn_<k>`)
        self.num_turns, self.turns_pred = num_turns, None
        if turns is not None and num_turns:
            self.turns_pred = torch.full(turns.shape, -1, dtype=torch.int64)
            self.turns_pred[:, :-1] = turns.cpu()[:, 1:].clamp(max=num_turns - 1)
        c = taps.config
        self.score_function = c.moe_router_score_function
        # megatron renormalises a sigmoid router's top-k > 1 always (a softmax router's r does not read it)
        self.renormalize = True
        self.recompute_routers = c.recompute_granularity == "full" or (
            c.recompute_granularity == "selective" and "moe" in (c.recompute_modules or [])
        )
        # the sampler's routes stay with the batch (host memory); each router call looks up its tokens
        self.sampler_routes: Tensor | None = None
        # route column of each MoE layer: every layer's, or (`route_layers`) only this stage's (trainer.rows)
        self._route_col = {m: j for j, m in enumerate(route_layers or range(self.L))}
        if "routes" in batch:
            self.sampler_routes = rt.validate_sampler_routes(
                batch["routes"].cpu(),
                seq_lens,
                T=self.T,
                moe_layers=taps.moe_layers,
                num_layers=c.num_layers,
                topk=self.K,
                num_experts=self.E,
                route_layers=route_layers,
            )
            missing = sorted({sl.moe for sl in taps.slots} - set(self._route_col))
            if missing:
                raise MegagrpoError(
                    f"batch['routes'] holds MoE layers {route_layers}; this rank's routers also need {missing}"
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
        self.n_old: Tensor | None = None  # [B, T] layers the old pass routed per token, over all ranks
        self.train: list[_Pass] = []
        self._prepasses: list[_Pass] = []  # RSPO under PP: forward-only passes that measure gamma
        self._old_metrics: dict[str, float] | None = None
        self.peak_table_bytes = 0  # the most replay-table bytes one micro-batch allocated on this rank

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
        route_layers: list[int] | None = None,
        turns: Tensor | None = None,
        num_turns: int = 0,
    ) -> StepReplay:
        """The step's replay: mode "R2", "R3" or "none" (statistics and RSPO weights only, no replay; works
        on a model built without routing replay). `batch` is the global batch (every rank the same) or,
        with `sharded`, this DP rank's rows, with `routes` int `[B, T, L, K]` when the sampler returned
        them (required for R3; L = every MoE layer, or the MoE layers `route_layers` of this rank's
        pipeline stage). Bad routes raise MegagrpoError here, before any pass. `router_shift` (RSPO)
        announces that the loss will call `token_weights`: under pipeline parallelism each mini-batch then
        gets a forward-only pre-pass that measures gamma over all stages (its layers live on other ranks
        than the loss). `turns` `[B, T]` (the model turn of each token of multi-turn rows, -1 elsewhere:
        `trainer.grpo.turn_index`) with `num_turns` adds the rollout-vs-old agreement per turn."""
        from megatron.core import parallel_state

        taps = router_taps(learner)
        device = next(learner.model[0].parameters()).device
        merge_group, reducer = _WORLD, None
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
            route_layers=route_layers,
            turns=turns,
            num_turns=num_turns,
        )

    # -- reductions over the ranks that share this batch ------------------------------------------------

    def _merge_sum(self, t: Tensor) -> Tensor:
        """Sum of a per-token tensor of the step's rows over the ranks that saw parts of those rows."""
        if self.merge_group is None:
            return t
        return rt.all_reduce_sum(t, group=None if self.merge_group is _WORLD else self.merge_group)

    def _sum_all(self, t: Tensor) -> Tensor:
        """Sum of a running total over every rank (the replica, then DP)."""
        t = self._merge_sum(t)
        return self.reducer.sum(t) if self.reducer is not None else t

    @property
    def store_bytes(self) -> int:
        """Host bytes of the old pass's per-token store on this rank (0 before the old pass ends)."""
        return self.old.store.nbytes() if self.old is not None and self.n_old is not None else 0

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
        """Hooks for the old-policy forward over the whole batch (the learner batch without `routes`,
        same rows): R2 records, R3 replays the sampler's routes, none observes."""
        if self.old is not None:
            raise RuntimeError("old_pass_hooks() is called once per step")
        mode = {"R2": "record", "R3": "replay", "none": "observe"}[self.mode]
        self.old = _Pass(self, "old", mode, torch.arange(self.B))
        return _Hooks(self.old)

    def _finish_old(self) -> None:
        if self.old is None or self.n_old is not None:
            return
        p = self.old
        p.end()
        p.store.finish(self.L, merge_group=None if self.sharded else _WORLD)
        self.n_old = self._merge_sum(p.n_layers)

    def old_routes(self) -> Tensor | None:
        """Collective (the first call after the old pass). `[B, T, L, K]` (`routes.route_dtype`, host): the
        routes the old pass used (R2: recorded, R3: the sampler's with fillers, none: the router's own), -1
        where none; None before the old pass. Sharded, only the entries this rank's routers saw. For tests
        and inspection: the passes themselves never build this table."""
        self._finish_old()
        if self.old is None:
            return None
        out = torch.full((self.B, self.T, self.L, self.K), rt.NO_ROUTE, dtype=rt.route_dtype(self.E))
        for layer, (keys, used, _own, _logr) in self.old.store.cols.items():
            out[keys // self.T, keys % self.T, layer] = used
        return out

    def train_hooks(self, rows: Tensor, *, num_micro_batches: int | None = None) -> _Hooks:
        """Hooks for the training step of the mini-batch made of the step's rows `rows` `[b]`, which the
        learner splits into `num_micro_batches` (the RSPO pre-pass under PP runs the same split)."""
        self._finish_old()
        if self.taps.active is not None:
            self.taps.active.end()
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= self.B:
            raise MegagrpoError(f"train_hooks(rows): rows must index the step's batch of {self.B} rows")
        if self.mode == "R2":
            if self.old is None:
                raise MegagrpoError(
                    "replay=R2 replays the routes recorded in the old-policy pass, which did not run; set "
                    "algo.old_logp=recompute or use replay=R3"
                )
            mode = "replay"
        else:
            mode = "replay" if self.mode == "R3" else "observe"
        full = None
        if self.router_shift and self.pp > 1 and self.old is not None:
            full = self._measure_shift(mode, rows, num_micro_batches)
        p = _Pass(self, "train", mode, rows)
        p.full = full
        self.train.append(p)
        return _Hooks(p)

    def _measure_shift(self, mode: str, rows: Tensor, num_micro_batches: int | None) -> tuple[Tensor, Tensor]:
        """Forward-only pass over the mini-batch with the same routes and micro-batches: per-token summed
        |d log r| and layer counts `[b, T]` over every stage's layers, for token_weights under PP."""
        from megagrpo.learner.forward import forward_logprobs

        pre = _Pass(self, "train", mode, rows)
        pre.backward = False
        self._prepasses.append(pre)
        sub = {k: v[rows.to(v.device)] for k, v in self._inputs.items()}
        opts = self.learner.run_options(
            with_entropy=False, num_micro_batches=num_micro_batches, local_rows=self.sharded
        )
        forward_logprobs(self.learner.model, sub, opts, hooks=_Hooks(pre))
        pre.end()
        return self._merge_sum(pre.d_tok), self._merge_sum(pre.n_tok)

    # -- RSPO ------------------------------------------------------------------------------------------

    def _router_logp(self, logits: Tensor, routes: Tensor) -> Tensor:
        """log r(e_k) `[n, K]` from the router's unbiased logits `[n, E]` (`stats.router_logp`: the softmax
        over all experts, or a sigmoid router's combine weights at `routes`)."""
        idx = routes.to(torch.int64).unsqueeze(1)  # gather wants int64; stores keep int16
        return stats.router_logp(
            logits.unsqueeze(1), idx, score_function=self.score_function, renormalize=self.renormalize
        )[:, 0]

    def _gamma_raw(self, d_tok: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(exp(-(1/L) sum_l (1/K) sum_k |d log r|) `[b, T]`, bool `[b, T]` tokens the old pass routed at
        every layer) for the step's rows `rows` whose summed |d log r| over all layers is `d_tok`."""
        have = self.real[rows] & (self.n_old[rows] == self.L)
        return torch.exp(-d_tok / self.L), have

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
        if self.old is None:
            raise MegagrpoError("algo.router_shift needs the old-policy pass: set algo.old_logp=recompute")
        mb = p.by_data[id(data)]
        rows = mb.samples.to(self.device)
        if p.full is not None:
            d = p.full[0][rows]  # measured by the pre-pass over every stage
        elif self.pp > 1:
            raise MegagrpoError(
                "algo.router_shift with mesh.pp > 1: create the step's replay with "
                "StepReplay.for_step(..., router_shift=True) so gamma is measured over every pipeline stage"
            )
        else:
            d = rt.all_reduce_sum(
                p.d_tok[rows], parallel_state.get_tensor_model_parallel_group()
            )  # SP slices
        g = p.rows[rows]
        gamma_raw, have = self._gamma_raw(d, g)
        gamma = torch.where(have, gamma_raw.clamp_min(self.gamma_min), torch.ones_like(gamma_raw))
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
        p = self.old
        if p is None:
            self._old_metrics = out
            return out
        if self.sampler_routes is not None:
            agree = self._sum_all(p.agree)
            out.update(stats.agreement_from_sums(agree[0], agree[1]).metrics("rollout_old"))
            if self.num_turns:
                by_turn = self._sum_all(p.agree_turns)
                for k in range(self.num_turns):
                    n = float(by_turn[1, k])
                    out[f"{stats.PREFIX}agreement_rollout_old/turn_{k}"] = (
                        float(by_turn[0, k]) / n if n else 1.0
                    )
        load = stats.load_distribution(self._sum_all(p.load))
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
        self._finish_old()
        out: dict[str, float] = {}
        if self.mode != "none":
            local = torch.zeros(2, dtype=torch.float64, device=self.device)
            fallback = torch.zeros(1, dtype=torch.float64, device=self.device)
            for p in ([self.old] if self.old is not None else []) + self._prepasses + self.train:
                if p.mode != "replay":
                    continue
                local += torch.tensor([p.unconsumed + p.leftover, p.reused], dtype=torch.float64).to(
                    self.device
                )
                fallback += (self._merge_sum(p.fallback) > 0).sum()
            totals = torch.cat([self._merge_sum(local), fallback])
            if self.reducer is not None:
                totals = self.reducer.sum(totals)
            out["moe/replay_unconsumed"] = float(totals[0])
            out["moe/replay_reused"] = float(totals[1])
            out["moe/replay_fallback_tokens"] = float(totals[2])
        if self.old is not None and self.train:
            for name, p in (("old_current_first", self.train[0]), ("old_current", self.train[-1])):
                agree = self._sum_all(p.agree)
                out.update(stats.agreement_from_sums(agree[0], agree[1]).metrics(name))
            layer = self._sum_all(sum(p.dlayer for p in self.train))
            gammas = []
            for p in self.train:
                gamma_raw, have = self._gamma_raw(self._merge_sum(p.d_tok), p.rows)
                gammas.append(gamma_raw[have & self.pred_mask_h[p.rows_h].to(self.device)])
            shift = stats.router_shift_summary(
                torch.cat(gammas), layer[0], layer[1], gamma_min=self.gamma_min, reducer=self.reducer
            )
            out.update(shift.metrics())
        return out
