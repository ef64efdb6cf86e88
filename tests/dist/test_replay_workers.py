"""Workers of test_replay.py (no tests here): issue 7 routing replay on CPU meshes, in ONE 2-process launch.

R2, per mesh (DP2 without model parallelism, EP2, TP2*EP2 with SP; plus full activation recompute):
record in the old pass, perturb the router weights so that routing changes, replay in a training
forward+backward. Checked: the routing megatron actually applied (the router's routing_map) equals the
recorded routes at every token; replay of unperturbed weights reproduces the old logprobs; replay vs no
replay logprobs differ after the perturbation; router weights get gradients; accounting is clean.

R3: a synthetic sampler route table (recorded from a differently perturbed copy, last token and padding
-1), replayed packed, padded, with 2 micro-batches in balanced (reordered) order, and on PP2: identical
logprobs; the applied routing equals the table; bad inputs raise MegagrpoError before any pass.
R3 and R2 on DeepSeek-V3's and GLM-4.5's router (sigmoid, correction bias, group-limited top-k, scaled): the
applied routing is the sampler's (recorded) table and the combine weights are the current unbiased sigmoid
scores at those experts, renormalised and scaled, against a hand computation at every router call; the
router weight gets gradients through them; RSPO's gamma equals the hand value from those weights; the
correction bias stays frozen, or with model.router_bias_update_rate moves by megatron's rule and is exported.
Each rank writes rank{r}.json.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.algo.aggregation import loss_normaliser
from megagrpo.algo.losses import policy_loss
from megagrpo.errors import MegagrpoError
from megagrpo.learner import forward as fwd
from megagrpo.learner import train_step as ts
from megagrpo.learner.learner import Learner, LearnerConfig
from megagrpo.learner.mesh import MeshConfig
from megagrpo.moe.replay import StepReplay
from megagrpo.moe.routers import router_taps
from megagrpo.trainer.rows import route_slices
from tests.dist._common import (
    TINY_DEEPSEEK_V3,
    TINY_GLM4_MOE,
    TINY_MOE,
    load_params,
    make_batch,
    randomise_expert_bias,
    save_params,
    write_json,
)

R2_MESHES = {
    "dp2": (MeshConfig(), None),
    "ep2": (MeshConfig(ep=2), None),
    "tp2_ep2_sp": (MeshConfig(tp=2, ep=2, sequence_parallel=True), None),
    "tp2_ep2_sp_recompute": (MeshConfig(tp=2, ep=2, sequence_parallel=True), "full"),
}


def _batch() -> dict[str, torch.Tensor]:
    b = make_batch(B=8, T=20, seed=3)
    b["row"] = torch.arange(8)
    return b


def _learner(mesh: MeshConfig, recompute: str | None = None, **kw: Any) -> Learner:
    cfg = LearnerConfig(mesh=mesh, routing_replay=True, recompute=recompute, seed=5, **kw)
    return Learner(TINY_MOE, cfg)


def _perturb_routers(learner: Learner, scale: float, seed: int) -> None:
    """Replicated router weights += noise, seeded per MoE layer (the same on every rank and mesh)."""
    for slot in router_taps(learner).slots:
        w = slot.module.weight
        g = torch.Generator().manual_seed(1000 * seed + slot.moe)
        noise = torch.randn(w.shape, generator=g) * scale
        with torch.no_grad():
            w.add_(noise.to(w.device, w.dtype))


class _Applied:
    """Test-side router hooks: the routing megatron applied (routing_map) vs the replay's table."""

    def __init__(self, learner: Learner) -> None:
        self.taps = router_taps(learner)
        self.table: torch.Tensor | None = None
        self.checked = self.mismatched = 0
        self.handles = [
            s.module.register_forward_hook(lambda m, a, out, s=s: self._post(s, out)) for s in self.taps.slots
        ]

    def _post(self, slot, out) -> None:
        p = self.taps.active
        if self.table is None or p is None or p.ctx is None:
            return
        _, routing_map = out
        c = p.ctx
        keep = c.valid & ~c.last
        want = self.table[c.grow[keep], c.pos[keep], slot.moe].long()  # [n, K]; tables keep int16
        onehot = torch.zeros_like(routing_map[keep], dtype=torch.bool).scatter_(1, want, True)
        self.checked += int(keep.sum())
        self.mismatched += int((onehot != routing_map[keep].bool()).any(-1).sum())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _loss_fn(norm: float, store: torch.Tensor, replay: StepReplay | None = None, gammas: list | None = None):
    def fn(logp, ent, data):
        tw = None
        if replay is not None and gammas is not None:
            tw = replay.token_weights(data)
            gammas.append((data["row"].clone(), tw.clone()))
        store[data["row"]] = logp.detach()
        return policy_loss(
            logp, data["old_logp"], data["advantages"], data["loss_mask"], variant="grpo", clip_low=0.2,
            clip_high=0.28, agg="token-mean", normaliser=norm, token_weights=tw,
        )  # fmt: skip

    return fn


def _gather_rows(x: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Rows filled on some ranks (identically where several did) -> the full tensor on every rank."""
    n = filled.to(x.dtype).clone()
    y = x * n.view(-1, *([1] * (x.dim() - 1)))
    dist.all_reduce(y)
    dist.all_reduce(n)
    return y / n.clamp_min(1).view(-1, *([1] * (x.dim() - 1)))


def _train_pass(learner: Learner, batch, replay: StepReplay | None, rows, *, gammas=None):
    """forward+backward of the mini-batch `rows` (hooks given to the schedule directly: Learner.train_step
    does not forward them yet). Returns the logprobs [b, T] (every rank)."""
    mb = {k: v[rows] for k, v in batch.items()}
    mb["row"] = torch.arange(len(rows))
    store = torch.zeros(len(rows), batch["input_ids"].shape[1])
    norm = loss_normaliser(mb["loss_mask"], "token-mean")
    hooks = replay.train_hooks(rows) if replay is not None else None
    n0 = len(gammas) if gammas is not None else 0
    ts.forward_backward(
        learner.model, mb, _loss_fn(norm, store, replay, gammas), learner.run_options(num_micro_batches=2),
        hooks=hooks,
    )  # fmt: skip
    if gammas is not None:
        gammas[n0:] = [(rows[r], g) for r, g in gammas[n0:]]
    filled = (store != 0).any(-1)
    return _gather_rows(store, filled)


def _router_grad_norm(learner: Learner) -> float:
    tot = 0.0
    for slot in router_taps(learner).slots:
        g = slot.module.weight.main_grad
        tot += float(g.float().pow(2).sum())
    return tot**0.5


def run_r2(name: str, mesh: MeshConfig, recompute: str | None) -> dict[str, Any]:
    learner = _learner(mesh, recompute, num_micro_batches=2)
    batch = _batch()
    applied = _Applied(learner)
    rows = torch.arange(8)
    out: dict[str, Any] = {}

    # 1. no perturbation: replaying the recorded routes reproduces the old pass
    rep = StepReplay.for_step("R2", learner, batch)
    old = learner.forward(batch, hooks=rep.old_pass_hooks())["logprobs"]
    rep.old_pass_metrics()
    applied.table = rep.old_routes()
    lp_same = _train_pass(learner, batch, rep, rows)
    m0 = rep.step_metrics()
    out["same_weights_max_diff"] = float((lp_same - old)[batch["loss_mask"]].abs().max())
    out["same_weights_agreement"] = m0["moe/agreement_old_current"]

    # 2. perturb the routers: routing changes, replay keeps the recorded experts
    rep = StepReplay.for_step("R2", learner, batch)
    old = learner.forward(batch, hooks=rep.old_pass_hooks())["logprobs"]
    rep.old_pass_metrics()
    applied.table = rep.old_routes()
    applied.checked = applied.mismatched = 0
    _perturb_routers(learner, 0.03, seed=1)
    gammas: list = []
    lp_replay = _train_pass(learner, batch, rep, torch.arange(4), gammas=gammas)
    lp_replay2 = _train_pass(learner, batch, rep, torch.arange(4, 8), gammas=gammas)
    m = rep.step_metrics()
    grad = _router_grad_norm(learner)
    applied.table = None
    lp_free = learner.forward(batch)["logprobs"]
    lp_replay = torch.cat([lp_replay, lp_replay2])
    mask = batch["loss_mask"]
    out["replay_logp_sum"] = float(lp_replay[mask].sum())
    out.update(
        applied_checked=applied.checked,
        applied_mismatched=applied.mismatched,
        replay_vs_free_max_diff=float((lp_replay - lp_free)[mask].abs().max()),
        replay_vs_old_max_diff=float((lp_replay - old)[mask].abs().max()),
        router_grad_norm=grad,
        metrics=m,
        gamma_min_seen=min(float(g.min()) for _, g in gammas),
        gamma_col0=max(float((g[:, 0] - 1).abs().max()) for _, g in gammas),
        gamma_lossmean=_gamma_mean(gammas, batch),
    )
    applied.remove()
    learner.close()
    return out


# Uneven pipeline stages (issue 37 section 4) on DeepSeek-V3's shape (a dense layer, then 3 MoE layers):
# the last stage holding one layer (stage 0: the dense layer and MoE layers 0-1; stage 1: MoE layer 2, where
# the even split gives 0 | 1-2), and the first stage holding only the dense layer (no router on stage 0).
UNEVEN = {
    "uneven_last1": MeshConfig(pp=2, last_stage_layers=1),
    "uneven_first1": MeshConfig(pp=2, first_stage_layers=1),
}


def run_r3_uneven(outdir: Path) -> dict[str, Any]:
    """R3 on uneven pipeline stages: sampler routes (of a perturbed copy) replayed by one stage, then by
    each layout of UNEVEN, each stage given only its own MoE layers' routes (`trainer.rows.RouteSlices`,
    read off megatron's global layer numbers; none for a stage of dense layers only). The logprobs must
    equal the single-stage pass on the same weights and routes."""
    batch = _batch()
    one = Learner(TINY_DEEPSEEK_V3, LearnerConfig(mesh=MeshConfig(), routing_replay=True, seed=5))
    randomise_expert_bias(one.chunks)
    ck = outdir / "r3_uneven_weights"
    routes, _ = _sampler_routes(one, batch, ck)
    lb = {k: v for k, v in batch.items() if k != "routes"}
    rep = StepReplay.for_step("R3", one, batch)
    lp_single = one.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    one.close()
    out: dict[str, Any] = {}
    for name, mesh in UNEVEN.items():
        pp = Learner(TINY_DEEPSEEK_V3, LearnerConfig(mesh=mesh, routing_replay=True, seed=5))
        load_params(pp.chunks, ck)
        mine = list(route_slices(pp).stage[dist.get_rank()])
        rep = StepReplay.for_step(
            "R3", pp, {**batch, "routes": routes[:, :, mine].to(torch.int32)}, route_layers=mine
        )
        lp = pp.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
        out[name] = {
            "stage_layers": mine,
            "vs_single": float((lp - lp_single)[batch["loss_mask"]].abs().max()),
            "metrics": {**rep.old_pass_metrics(), **rep.step_metrics()},
        }
        pp.close()
    return out


def _gamma_mean(gammas, batch) -> float:
    """Mean token weight over the loss tokens, over all ranks' micro-batches (each TP rank has a copy)."""
    s = torch.zeros(2, dtype=torch.float64)
    for r, g in gammas:
        sel = batch["loss_mask"][r][:, : g.shape[1]]
        s[0] += g[sel].double().sum()
        s[1] += sel.sum()
    dist.all_reduce(s)
    return float(s[0] / s[1])


def _sampler_routes(learner: Learner, batch, ck: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic sampler routes in batch["routes"]: those of a perturbed copy, last token and padding -1
    (the learner's weights saved to `ck` and restored). Returns (routes [B, T, L, K], real tokens [B, T])."""
    save_params(learner.chunks, ck)
    _perturb_routers(learner, 0.7, seed=2)
    rec = StepReplay.for_step("R2", learner, batch)
    learner.forward(batch, hooks=rec.old_pass_hooks())
    routes = rec.old_routes().clone()
    load_params(learner.chunks, ck)
    real = torch.arange(20).unsqueeze(0) < batch["seq_lens"].unsqueeze(1)
    last = torch.arange(20).unsqueeze(0) == (batch["seq_lens"] - 1).unsqueeze(1)
    routes[~real | last] = -1
    batch["routes"] = routes.to(torch.int32)
    return routes, real


def run_r3(outdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batch = _batch()
    base = _learner(MeshConfig(), num_micro_batches=2)
    ck = outdir / "r3_weights"
    routes, real = _sampler_routes(base, batch, ck)
    lb = {k: v for k, v in batch.items() if k != "routes"}

    results = {}
    applied = _Applied(base)
    for layout, opts in (
        ("packed", base.run_options()),
        ("padded", dataclasses.replace(base.run_options(), packed=False)),
        ("packed_1mb", base.run_options(num_micro_batches=1)),
    ):
        rep = StepReplay.for_step("R3", base, batch)
        applied.table = rep.sampler_routes
        results[layout] = fwd.forward_logprobs(base.model, lb, opts, hooks=rep.old_pass_hooks())["logprobs"]
        mets = {**rep.old_pass_metrics(), **rep.step_metrics()}
        out[f"metrics_{layout}"] = mets
    out["applied_checked"], out["applied_mismatched"] = applied.checked, applied.mismatched
    applied.remove()
    free = base.forward(lb)["logprobs"]
    mask = batch["loss_mask"]
    out["packed_vs_padded"] = float((results["packed"] - results["padded"])[mask].abs().max())
    out["packed_vs_1mb"] = float((results["packed"] - results["packed_1mb"])[mask].abs().max())
    out["r3_vs_free"] = float((results["packed"] - free)[mask].abs().max())

    # R3 training pass (replay in forward and backward) with RSPO weights: same weights -> gamma 1
    rep = StepReplay.for_step("R3", base, batch)
    old = base.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    rep.old_pass_metrics()
    gammas: list = []
    lb["old_logp"] = old
    lp_train = _train_pass(base, lb, rep, torch.arange(8), gammas=gammas)
    m = rep.step_metrics()
    out["r3_train_vs_old"] = float((lp_train - old)[mask].abs().max())
    out["r3_train_metrics"] = m
    out["r3_gamma_min_same_weights"] = min(float(g.min()) for _, g in gammas)

    # a route missing at a real, non-last token: counted as fallback, not silently replaced
    bad = dict(batch)
    bad["routes"] = batch["routes"].clone()
    bad["routes"][1, 3] = -1
    rep = StepReplay.for_step("R3", base, bad)
    base.forward(lb, hooks=rep.old_pass_hooks())
    out["fallback_metrics"] = rep.step_metrics()

    # bad input: clear errors at for_step, before any pass
    errors = {}
    cases = {
        "wrong_shape": batch["routes"][:, :10],
        "wrong_layers": batch["routes"][:, :, :3],
        "wrong_topk": batch["routes"][..., :1],
        "out_of_range": torch.where(
            real[..., None, None], torch.full_like(batch["routes"], 4), batch["routes"]
        ),
        "float": batch["routes"].float(),
        "partial": torch.where(
            torch.arange(2).view(1, 1, 1, 2) == 0, torch.full_like(batch["routes"], -1), batch["routes"]
        ),
    }
    for case, r in cases.items():
        try:
            StepReplay.for_step("R3", base, {**batch, "routes": r})
            errors[case] = None
        except MegagrpoError as e:
            errors[case] = str(e)
    try:
        StepReplay.for_step("R3", base, lb)
        errors["missing"] = None
    except MegagrpoError as e:
        errors["missing"] = str(e)
    out["errors"] = errors

    gamma_pp1 = _rspo_gamma(base, batch, ck)

    # stats-only mode ("none"): no replay, but agreement, load and RSPO weights
    rep = StepReplay.for_step("none", base, batch)
    lb["old_logp"] = base.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    m = rep.old_pass_metrics()
    _perturb_routers(base, 0.03, seed=4)
    gammas = []
    lp_none = _train_pass(base, lb, rep, torch.arange(8), gammas=gammas)
    m.update(rep.step_metrics())
    load_params(base.chunks, ck)
    out["none_metrics"] = m
    out["none_vs_free_perturbed"] = float((lp_none - _free_perturbed(base, lb, ck))[mask].abs().max())
    out["none_gamma_below_one"] = sum(int((g < 1).sum()) for _, g in gammas)
    base.close()

    # PP2: the same weights, the same routes -> the same logprobs
    pp = _learner(MeshConfig(pp=2), num_micro_batches=2)
    load_params(pp.chunks, ck)
    rep = StepReplay.for_step("R3", pp, batch)
    lp_pp = pp.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    out["metrics_pp2"] = {**rep.old_pass_metrics(), **rep.step_metrics()}
    out["pp2_vs_packed"] = float((lp_pp - results["packed"])[mask].abs().max())
    # each stage handed only its own MoE layers' routes (what trainer.rows sends): the same pass
    slices = route_slices(pp)
    mine, theirs = (list(slices.stage[r]) for r in (dist.get_rank(), 1 - dist.get_rank()))
    rep = StepReplay.for_step(
        "R3", pp, {**batch, "routes": routes[:, :, mine].to(torch.int32)}, route_layers=mine
    )
    lp_sliced = pp.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    out["metrics_pp2_sliced"] = {**rep.old_pass_metrics(), **rep.step_metrics()}
    out["pp2_sliced_vs_pp2"] = float((lp_sliced - lp_pp)[mask].abs().max())
    out["pp2_stage_layers"] = mine
    try:
        other = {**batch, "routes": routes[:, :, theirs].to(torch.int32)}
        StepReplay.for_step("R3", pp, other, route_layers=theirs)
        out["other_stage_error"] = None
    except MegagrpoError as e:
        out["other_stage_error"] = str(e)
    gamma_pp2 = _rspo_gamma(pp, batch, ck)
    out["rspo_pp2_vs_pp1"] = float((gamma_pp2 - gamma_pp1).abs().max())
    out["rspo_gamma_below_one"] = int((gamma_pp1 < 1).sum())
    pp.close()
    return out


class _SigmoidWeights(_Applied):
    """Also the combine weights each router applied, against the hand computation of DeepSeek-V3's rule
    (arXiv:2412.19437 eqs. 12-13 and 16 with the correction bias of section 2.1.2): at the replayed experts,
    sigmoid(logits) renormalised over them, times the scaling factor; the bias only in the selection.
    And, per token, RSPO's sum over layers of (1/K) sum_k |d log r| by hand: r the renormalised unbiased
    score at the applied experts (`d_weight`), and for contrast the per-expert sigmoid score (`d_score`)."""

    def __init__(self, learner: Learner, B: int = 8, T: int = 20) -> None:
        super().__init__(learner)
        for h in self.handles:
            h.remove()
        self.handles = [
            s.module.register_forward_hook(lambda m, a, out, s=s: self._weights(s, a[0], out))
            for s in self.taps.slots
        ]
        self.weight_err = 0.0
        self.bias_gap = 0.0
        K = learner.arch.moe_topk
        self.old_logr = {s.moe: torch.zeros(2, B, T, K) for s in self.taps.slots}
        self.d_weight, self.d_score = torch.zeros(B, T), torch.zeros(B, T)

    def share_old(self) -> None:
        """The old pass's log r on every rank: a later pass may hold a row on another DP rank."""
        for t in self.old_logr.values():
            dist.all_reduce(t)  # each (row, position) was routed on exactly one rank, zeros elsewhere

    def _weights(self, slot, hidden, out) -> None:
        self._post(slot, out)
        p = self.taps.active
        if p is None or p.ctx is None:
            return
        c = p.ctx
        cfg = slot.module.config
        scores = torch.sigmoid(slot.logits(hidden))
        v = c.valid
        applied = out[1][v].nonzero()[:, 1].view(-1, cfg.moe_router_topk)  # ascending ids per token
        s = scores[v].gather(1, applied)
        logr = torch.stack([(s / s.sum(-1, keepdim=True)).log(), s.log()])  # [2, n, K]
        at = (c.grow[v], c.pos[v])
        if p.kind == "old":
            self.old_logr[slot.moe][:, at[0], at[1]] = logr
        else:
            d = (logr - self.old_logr[slot.moe][:, at[0], at[1]]).abs().mean(-1)
            self.d_weight[at] += d[0]
            self.d_score[at] += d[1]
        if self.table is None:
            return
        keep = c.valid & ~c.last
        want = self.table[c.grow[keep], c.pos[keep], slot.moe].long()

        def combine(s: torch.Tensor) -> torch.Tensor:
            w = s.gather(1, want)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.moe_router_topk_scaling_factor
            return torch.zeros_like(s).scatter_(1, want, w)

        expected = combine(scores[keep])
        self.weight_err = max(self.weight_err, float((out[0][keep].float() - expected).abs().max()))
        biased = combine(scores[keep] + slot.module.expert_bias.float())
        self.bias_gap = max(self.bias_gap, float((biased - expected).abs().max()))


def _gamma_vs_hand(check: _SigmoidWeights, gammas: list, loss_mask: torch.Tensor, L: int) -> dict[str, Any]:
    """token_weights' gamma (floor 0) vs exp(-(1/L) sum_l (1/K) sum_k |d log r|) by hand, at the loss tokens
    (position t - 1 predicts token t), on this rank's rows."""
    out = {"gamma_err": 0.0, "gamma_vs_score_def": 0.0, "gamma_below_one": 0}
    for rows, tw in gammas:
        m = loss_mask[rows]
        for key, d in (("gamma_err", check.d_weight), ("gamma_vs_score_def", check.d_score)):
            ref = torch.ones_like(tw)
            ref[:, 1:] = torch.exp(-d[rows][:, :-1] / L)
            out[key] = max(out[key], float((tw - ref)[m].abs().max()))
        out["gamma_below_one"] += int((tw[m] < 0.999).sum())
    return out


def _expert_biases(learner: Learner) -> dict[int, torch.Tensor]:
    return {s.moe: s.module.expert_bias.detach().clone() for s in router_taps(learner).slots}


def _bias_update(arch, batch, rate: float, outdir: Path) -> dict[str, Any]:
    """One R3 training pass on a learner built with model.router_bias_update_rate: megatron's rule moves
    each expert's bias by exactly +-rate (or 0), the same on every DP rank, and the export carries it."""
    from megagrpo.bridge.export import export_tensors, iter_hf_buckets

    lrn = Learner(
        arch, LearnerConfig(mesh=MeshConfig(), routing_replay=True, seed=5, router_bias_update_rate=rate)
    )
    randomise_expert_bias(lrn.chunks)
    lb = {k: v for k, v in batch.items() if k != "routes"}
    rep = StepReplay.for_step("R3", lrn, batch)
    lb["old_logp"] = lrn.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    before = _expert_biases(lrn)
    _train_pass(lrn, lb, rep, torch.arange(8))
    after = _expert_biases(lrn)
    steps = torch.stack([after[k] - before[k] for k in sorted(before)])
    out: dict[str, Any] = {"bias_steps": sorted({round(float(x) / rate, 6) for x in steps.flatten()})}
    out["bias_moved"] = int((steps != 0).sum())
    same = torch.stack([after[k] for k in sorted(after)])
    other = same.clone()
    dist.broadcast(other, src=0)
    out["bias_rank_diff"] = float((same - other).abs().max())
    exported = {
        n: t for b in iter_hf_buckets(export_tensors(lrn.chunks[0]), arch, bucket_bytes=1 << 20) for n, t in b
    }
    layers = router_taps(lrn).moe_layers
    got = [exported[f"model.layers.{layers[k]}.mlp.gate.e_score_correction_bias"] for k in sorted(after)]
    out["export_eq_updated"] = all(torch.equal(g.float(), after[k]) for k, g in zip(sorted(after), got))
    lrn.close()
    return out


def run_r3_sigmoid(outdir: Path, arch) -> dict[str, Any]:
    """R3 and R2 on the sigmoid, bias-corrected, group-limited router (the tiny DeepSeek-V3 / GLM-4.5 shape)."""
    out: dict[str, Any] = {}
    batch = _batch()
    lrn = Learner(arch, LearnerConfig(mesh=MeshConfig(), routing_replay=True, seed=5))
    randomise_expert_bias(lrn.chunks)
    _sampler_routes(lrn, batch, outdir / f"r3_sigmoid_weights_{arch.family}")
    lb = {k: v for k, v in batch.items() if k != "routes"}
    check = _SigmoidWeights(lrn)
    rep = StepReplay.for_step("R3", lrn, batch)
    check.table = rep.sampler_routes
    lp = lrn.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    out["metrics"] = {**rep.old_pass_metrics(), **rep.step_metrics()}
    out["applied_checked"], out["applied_mismatched"] = check.checked, check.mismatched
    out["weight_err"], out["bias_gap"] = check.weight_err, check.bias_gap
    check.remove()
    free = lrn.forward(lb)["logprobs"]
    out["r3_vs_free"] = float((lp - free)[batch["loss_mask"]].abs().max())
    # R2: the learner's own bias-corrected, group-limited routes recorded, the routers perturbed, the
    # training pass (forward and backward) replays them with weights from the perturbed scores, and RSPO
    # weighs its tokens (floor 0, so that gamma is compared unclipped)
    check = _SigmoidWeights(lrn)
    rep = StepReplay.for_step("R2", lrn, lb, router_shift=True, gamma_min=0.0)
    lb["old_logp"] = lrn.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    rep.old_pass_metrics()
    check.table = rep.old_routes()
    check.share_old()
    bias0 = _expert_biases(lrn)
    _perturb_routers(lrn, 0.03, seed=1)
    gammas: list = []
    _train_pass(lrn, lb, rep, torch.arange(8), gammas=gammas)
    out["r2_metrics"] = rep.step_metrics()
    out["r2_checked"], out["r2_mismatched"] = check.checked, check.mismatched
    out["r2_weight_err"], out["r2_bias_gap"] = check.weight_err, check.bias_gap
    out["r2_router_grad_norm"] = _router_grad_norm(lrn)
    out.update(_gamma_vs_hand(check, gammas, lb["loss_mask"], len(router_taps(lrn).slots)))
    out["frozen_bias_moved"] = max(float((b - bias0[k]).abs().max()) for k, b in _expert_biases(lrn).items())
    check.remove()
    lrn.close()
    out["bias_update"] = _bias_update(arch, batch, 1e-2, outdir)
    return out


def _free_perturbed(learner: Learner, lb, ck: Path) -> torch.Tensor:
    _perturb_routers(learner, 0.03, seed=4)
    out = learner.forward(lb)["logprobs"]
    load_params(learner.chunks, ck)
    return out


def _rspo_gamma(learner: Learner, batch, ck: Path) -> torch.Tensor:
    """RSPO token weights [B, T] after an R3 old pass and a router perturbation (weights restored after)."""
    load_params(learner.chunks, ck)
    lb = {k: v for k, v in batch.items() if k != "routes"}
    rep = StepReplay.for_step("R3", learner, batch, router_shift=True)
    lb["old_logp"] = learner.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
    rep.old_pass_metrics()
    _perturb_routers(learner, 0.03, seed=4)
    gammas: list = []
    _train_pass(learner, lb, rep, torch.arange(8), gammas=gammas)
    rep.step_metrics()
    load_params(learner.chunks, ck)
    dense = torch.zeros(8, batch["input_ids"].shape[1])
    filled = torch.zeros(8, dtype=torch.bool)
    for r, g in gammas:
        dense[r] = g
        filled[r] = True
    return _gather_rows(dense, filled)


def main(rank: int, world: int, outdir: Path, only: str | None = None) -> None:
    res: dict[str, Any] = {}
    if not only or only == "r3_uneven":
        res["r3_uneven"] = run_r3_uneven(outdir)
    for name, (mesh, recompute) in R2_MESHES.items():
        if only and only != name:
            continue
        res[f"r2_{name}"] = run_r2(name, mesh, recompute)
    if not only or only == "r3":
        res["r3"] = run_r3(outdir)
    for arch in (TINY_DEEPSEEK_V3, TINY_GLM4_MOE):
        if not only or only == f"r3_sigmoid_{arch.family}":
            res[f"r3_sigmoid_{arch.family}"] = run_r3_sigmoid(outdir, arch)
    write_json(outdir / f"rank{rank}.json", res)
