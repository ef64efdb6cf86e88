"""Router statistics for MoE RL (`moe/` metrics): top-k agreement, RSPO router shift, expert load.

Tensors crossing this boundary (`*lead` is any leading token layout: [tokens] packed or [B, T] padded):
- routing indices `[*lead, L, K]` integer expert ids, the top-k chosen per token and MoE layer;
- router outputs `[*lead, L, E]` logits (pre-softmax) or probabilities (`scores="probs"`);
- `mask` `[*lead]` bool/0-1: tokens that count. Masked positions may hold anything (padding routes are
  often -1); they are neither validated nor counted, and per-token outputs are neutral (1.0) there.
L is the number of MoE layers this rank holds (under pipeline parallelism, a stage's own layers; pass
`layer_offset` when naming metrics), E the number of routed experts, K the top-k.

Bad input (wrong rank or shapes, layer count different from `n_layers`, expert ids outside [0, E) or
repeated within a token's top-k, non-finite router values at valid tokens) raises ValueError naming the
argument. Distributed: pass a reducer (e.g. `megagrpo.diagnostics.reduce.DistReducer(dp_group)`; any object
with `sum(x)` and `max(x)`) and the statistics cover the global batch: sums exactly, the gamma quantile from
a fixed-size histogram (`megagrpo.algo.quantiles`), so no rank receives per-token values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megagrpo.algo.quantiles import summarize

PREFIX = "moe/"

# RSPO floor gamma_min on the router-shift weight (arXiv 2510.23027, Sec. 3: gamma = max(gamma, gamma_min)).
# Same default as the config field `algo.router_shift_gamma_min`; see router_shift() for the provenance note.
DEFAULT_GAMMA_MIN = 0.8


class _LocalReducer:
    def sum(self, x):
        return x

    def max(self, x):
        return x


def _reducer(reducer):
    return reducer if reducer is not None else _LocalReducer()


def _valid_mask(mask: torch.Tensor, lead: torch.Size, name: str = "mask") -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != lead:
        raise ValueError(f"{name} shape {tuple(mask.shape)} must equal the token layout {tuple(lead)}")
    if mask.dtype == torch.bool:
        return mask
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{name} must be bool or hold only 0 and 1")
    return mask != 0


def check_routes(
    idx: torch.Tensor,
    valid: torch.Tensor,
    *,
    n_experts: int,
    name: str = "routes",
    n_layers: int | None = None,
    k: int | None = None,
) -> None:
    """Validate routing indices `[*lead, L, K]` at the valid tokens; raises ValueError naming `name`."""
    if not isinstance(idx, torch.Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor [*lead, L, K] of expert ids")
    if idx.dim() != valid.dim() + 2 or idx.shape[: valid.dim()] != valid.shape:
        raise ValueError(
            f"{name} must have shape [*lead, L, K] with lead={tuple(valid.shape)}, got {tuple(idx.shape)}"
        )
    L, K = idx.shape[-2], idx.shape[-1]
    if n_layers is not None and n_layers != L:
        raise ValueError(f"{name} has {L} MoE layers, expected {n_layers} (wrong layer count)")
    if k is not None and k != K:
        raise ValueError(f"{name} has top-k {K}, expected {k}")
    if K < 1 or n_experts < K:
        raise ValueError(f"{name}: top-k {K} must be in [1, n_experts={n_experts}]")
    sel = idx[valid]  # [n, L, K]
    if sel.numel() == 0:
        return
    lo, hi = int(sel.min()), int(sel.max())
    if lo < 0 or hi >= n_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds expert id {bad} outside [0, {n_experts}) at a valid token")
    srt = sel.sort(-1).values
    if K > 1 and (srt[..., 1:] == srt[..., :-1]).any():
        raise ValueError(f"{name} repeats an expert within one token's top-k at a valid token")


# ---------------------------------------------------------------- top-k agreement


@dataclass
class AgreementStats:
    """`per_token` [*lead]: mean over layers of |A∩B|/K (1.0 at masked tokens); `per_layer`: global mean
    over valid tokens per layer; `mean`: mean over layers (= over all valid token-layer pairs)."""

    per_token: torch.Tensor
    per_layer: list[float]
    mean: float
    n_tokens: int

    def metrics(self, pair: str, *, layer_offset: int = 0) -> dict[str, float]:
        """Keys `moe/agreement_{pair}` and `moe/agreement_{pair}/layer_{l}`; pair e.g. rollout_old."""
        out = {f"{PREFIX}agreement_{pair}": self.mean}
        for i, v in enumerate(self.per_layer):
            out[f"{PREFIX}agreement_{pair}/layer_{layer_offset + i}"] = v
        return out


def topk_agreement(
    routes_a: torch.Tensor,
    routes_b: torch.Tensor,
    mask: torch.Tensor,
    *,
    n_experts: int,
    n_layers: int | None = None,
    reducer=None,
) -> AgreementStats:
    """Top-k agreement |set(a) ∩ set(b)| / K per token and layer, between two routings `[*lead, L, K]`.

    With no valid token (globally) every agreement is defined as 1.0 and `n_tokens` is 0.
    """
    if not isinstance(routes_a, torch.Tensor) or routes_a.dim() < 3:
        raise ValueError("routes_a must be an integer tensor [*lead, L, K]")
    lead = routes_a.shape[:-2]
    valid = _valid_mask(mask, lead)
    check_routes(routes_a, valid, n_experts=n_experts, name="routes_a", n_layers=n_layers)
    L, K = routes_a.shape[-2:]
    check_routes(routes_b, valid, n_experts=n_experts, name="routes_b", n_layers=L, k=K)

    frac = topk_overlap(routes_a, routes_b)  # [*lead, L]
    per_token = torch.where(valid, frac.mean(-1), torch.ones((), dtype=torch.float64, device=frac.device))
    layer_sum = torch.where(valid[..., None], frac, torch.zeros((), dtype=frac.dtype, device=frac.device))
    layer_sum = layer_sum.reshape(-1, L).sum(0)
    n_valid = valid.sum().to(torch.float64)
    tot = _reducer(reducer).sum(torch.cat([layer_sum, n_valid.expand(L)]))
    return agreement_from_sums(tot[:L], tot[L:], per_token=per_token)


def topk_overlap(routes_a: torch.Tensor, routes_b: torch.Tensor) -> torch.Tensor:
    """|set(a) ∩ set(b)| / K `[*lead]` fp64 for two routings `[*lead, K]` (no validation)."""
    K = routes_a.shape[-1]
    overlap = torch.zeros(routes_a.shape[:-1], dtype=torch.float64, device=routes_a.device)
    for i in range(K):  # K x [*lead, K] compares instead of one [.., K, K] tensor: bounded memory
        overlap += (routes_a[..., i : i + 1] == routes_b).any(-1).to(torch.float64)
    return overlap / K


def agreement_from_sums(
    layer_sum: torch.Tensor, layer_count: torch.Tensor, *, per_token: torch.Tensor | None = None
) -> AgreementStats:
    """AgreementStats from global per-layer sums of the overlap fraction and per-layer token counts
    `[L]` (a layer without tokens agrees by definition: 1.0)."""
    n = [int(c) for c in layer_count.tolist()]
    per_layer = [float(s) / c if c else 1.0 for s, c in zip(layer_sum.tolist(), n, strict=True)]
    empty = torch.ones(0, dtype=torch.float64) if per_token is None else per_token
    mean = sum(per_layer) / len(per_layer) if per_layer else 1.0
    return AgreementStats(empty, per_layer, mean if max(n, default=0) else 1.0, max(n, default=0))


# ---------------------------------------------------------------- RSPO router shift


def gather_router_logp(
    router: torch.Tensor, routes: torch.Tensor, *, scores: str = "logits", normalize: str = "all"
) -> torch.Tensor:
    """log r^{(l)}(e_k) at the given experts: router `[*lead, L, E]`, routes `[*lead, L, K]` -> `[*lead, L, K]`.

    scores="logits": r = softmax over all E experts (normalize="all") or over the K given experts
    (normalize="topk"). scores="sigmoid": the router outputs are logits z of a sigmoid router, s = sigmoid(z)
    (DeepSeek-V3, arXiv:2412.19437 eq. 15); r = s per expert ("all") or s_k / sum_j s_j over the K given
    experts ("topk", eq. 13: the combine weight before the constant scaling factor), computed as
    logsigmoid(z_k) - logsumexp_j logsigmoid(z_j) so that saturated scores lose no precision.
    scores="probs": the router's probabilities as given, or renormalised over the K experts ("topk");
    values are floored at 1e-30 before the log. Computed in at least fp32, without autograd (the result is
    detached). Keeping only this `[*lead, L, K]` result of the old-policy pass is enough for
    `router_shift_from_logp`.
    """
    if scores not in ("logits", "probs", "sigmoid"):
        raise ValueError(f"scores must be 'logits', 'sigmoid' or 'probs', got {scores!r}")
    if normalize not in ("all", "topk"):
        raise ValueError(f"normalize must be 'all' or 'topk', got {normalize!r}")
    safe = routes.clamp(0, router.shape[-1] - 1)  # masked positions may hold -1; their values are unused
    with torch.no_grad():
        x = router.detach().to(torch.promote_types(router.dtype, torch.float32))
        if scores == "logits":
            if normalize == "all":
                return torch.log_softmax(x, -1).gather(-1, safe)
            return torch.log_softmax(x.gather(-1, safe), -1)
        if scores == "sigmoid":
            g = torch.nn.functional.logsigmoid(x.gather(-1, safe))
        else:
            g = x.clamp_min(1e-30).log().gather(-1, safe)
        if normalize == "all":
            return g
        return g - torch.logsumexp(g, -1, keepdim=True)


def router_logp(
    logits: torch.Tensor, routes: torch.Tensor, *, score_function: str, renormalize: bool
) -> torch.Tensor:
    """The router's log-probability of the given experts, log r^{(l)}(e_k), as RSPO's router shift reads
    it (arXiv 2510.23027, Sec. 3): logits `[*lead, L, E]` (pre-score-function, WITHOUT any correction
    bias), routes `[*lead, L, K]` -> `[*lead, L, K]` fp32+, detached.

    What r is, per router (see docs/metrics.md, "Sigmoid routers"):
    - softmax routers (Mixtral, Qwen-MoE): r = softmax over all E experts, the distribution the router
      defines (the paper's router scores; mass that moves to experts outside the old top-k lowers gamma).
    - sigmoid routers (DeepSeek-V3, arXiv:2412.19437 eqs. 12-16; GLM-4.5): the scores
      s_e = sigmoid(z_e) are E independent gates that do not sum to one, so there is no distribution over
      all experts. r is the combine weight the model applies to e_k: with `renormalize` (HF
      `norm_topk_prob`; megatron always renormalises a sigmoid top-k > 1) r(e_k) = s_k / sum_{j in S} s_j
      over the replayed set S (eq. 13), else r(e_k) = s_k. The scaling factor (`routed_scaling_factor`)
      cancels in log r_theta - log r_old, and the correction bias enters only the selection (section
      2.1.2), never r. With S held fixed (R2/R3, and RSPO's conditioning on the old experts), the router
      changes the token's likelihood, hence a GSPO/GRPO ratio, only through these weights: r is exactly
      the router's share of pi_theta / pi_old, and a change of the scores that leaves the weights
      unchanged (all s_k in S scaled alike) gives gamma = 1, as it changes no logprob.
    A top-1 router's renormalised weight is always 1: then r = s_k (what megatron combines with).
    """
    if score_function == "softmax":
        return gather_router_logp(logits, routes, scores="logits", normalize="all")
    if score_function == "sigmoid":
        norm = "topk" if renormalize and routes.shape[-1] > 1 else "all"
        return gather_router_logp(logits, routes, scores="sigmoid", normalize=norm)
    raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")


@dataclass
class RouterShift:
    """RSPO router-shift weights and their statistics.

    - `gamma` [*lead]: max(gamma_raw, gamma_min), detached, 1.0 at masked tokens: the `token_weights` hook.
    - `gamma_raw` [*lead]: exp(-mean_l mean_k |d log r|) before the floor (1.0 at masked tokens).
    - `per_layer_dlogr`: global mean over valid tokens of (1/K) sum_k |d log r| per layer.
    - `gamma_mean`, `gamma_p1`: mean and 1st percentile of gamma_raw over valid tokens (global); p1 from
      the histogram of `megagrpo.algo.quantiles`: never above the exact type-7 value, and at most 1.09% of
      gamma below the order statistic it brackets.
    - `floor_frac`: fraction of valid tokens with gamma_raw <= gamma_min (the floor is active).
    """

    gamma: torch.Tensor
    gamma_raw: torch.Tensor
    per_layer_dlogr: list[float]
    gamma_mean: float
    gamma_p1: float
    floor_frac: float
    gamma_min: float
    n_tokens: int

    def metrics(self, *, layer_offset: int = 0) -> dict[str, float]:
        out = {
            f"{PREFIX}router_shift_gamma_mean": self.gamma_mean,
            f"{PREFIX}router_shift_gamma_p1": self.gamma_p1,
            f"{PREFIX}router_shift_floor_frac": self.floor_frac,
            f"{PREFIX}router_shift_dlogr": (
                sum(self.per_layer_dlogr) / len(self.per_layer_dlogr) if self.per_layer_dlogr else 0.0
            ),
        }
        for i, v in enumerate(self.per_layer_dlogr):
            out[f"{PREFIX}router_shift_dlogr/layer_{layer_offset + i}"] = v
        return out


def router_shift_from_logp(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma_min: float = DEFAULT_GAMMA_MIN,
    reducer=None,
) -> RouterShift:
    """RSPO router shift (arXiv 2510.23027, Sec. 3) from log router scores at the old policy's top-k experts.

    new_logp, old_logp: `[*lead, L, K]` = log r_theta^{(l)}(e_k), log r_old^{(l)}(e_k) for the K experts the
    old policy activated (see `gather_router_logp`). gamma_{i,t} = exp(-(1/L) sum_l (1/K) sum_k |new - old|).
    With no valid token (globally) the statistics are gamma_mean = gamma_p1 = 1, floor_frac = 0.
    """
    if not 0.0 <= gamma_min <= 1.0:
        raise ValueError(f"gamma_min must be in [0, 1], got {gamma_min}")
    if not isinstance(new_logp, torch.Tensor) or new_logp.dim() < 3:
        raise ValueError("new_logp must be a tensor [*lead, L, K]")
    if not isinstance(old_logp, torch.Tensor) or old_logp.shape != new_logp.shape:
        got = tuple(old_logp.shape) if isinstance(old_logp, torch.Tensor) else type(old_logp).__name__
        raise ValueError(f"old_logp shape {got} must equal new_logp shape {tuple(new_logp.shape)}")
    lead = new_logp.shape[:-2]
    valid = _valid_mask(mask, lead)
    with torch.no_grad():
        dt = torch.promote_types(torch.promote_types(new_logp.dtype, old_logp.dtype), torch.float32)
        d = (new_logp.detach().to(dt) - old_logp.detach().to(dt)).abs().mean(-1)  # [*lead, L]
        if not torch.isfinite(d[valid]).all():
            raise ValueError("router log-scores are not finite at a valid token (new_logp/old_logp)")
        one = torch.ones((), dtype=dt, device=d.device)
        gamma_raw = torch.where(valid, torch.exp(-d.mean(-1)), one)
        gamma = torch.where(valid, gamma_raw.clamp_min(gamma_min), one)

        L = d.shape[-1]
        d_valid = torch.where(valid[..., None], d, torch.zeros((), dtype=dt, device=d.device)).reshape(-1, L)
        layer_dlogr = _reducer(reducer).sum(d_valid.sum(0).to(torch.float64))
        n_valid = _reducer(reducer).sum(valid.sum().to(torch.float64).reshape(1))
        return router_shift_summary(
            gamma_raw[valid], layer_dlogr, n_valid.expand(L), gamma_min=gamma_min, reducer=reducer,
            gamma=gamma, gamma_raw=gamma_raw,
        )  # fmt: skip


def router_shift_summary(
    gamma_valid: torch.Tensor,
    layer_dlogr_sum: torch.Tensor,
    layer_count: torch.Tensor,
    *,
    gamma_min: float,
    reducer=None,
    gamma: torch.Tensor | None = None,
    gamma_raw: torch.Tensor | None = None,
) -> RouterShift:
    """RSPO statistics (arXiv 2510.23027, Sec. 3) from this rank's share of the valid tokens' unfloored
    gammas `[n]` (each token on exactly one rank of the reducer) and the global per-layer sums of
    (1/K) sum_k |d log r| and token counts `[L]`. With no valid token: gamma_mean = gamma_p1 = 1.

    Per rank with a DP reducer, whatever B×T and the DP size: an all-reduce of 3 fp64 sums, then (with
    tokens) of one 41 KB gamma histogram and 2 fp64 extremes."""
    red = _reducer(reducer)
    g = gamma_valid.detach().to(torch.float64).reshape(-1)
    dev = g.device
    n_local = torch.tensor(float(g.numel()), dtype=torch.float64, device=dev)
    tot = red.sum(torch.stack([g.sum(), (g <= gamma_min).to(torch.float64).sum(), n_local]))
    counts = [int(c) for c in layer_count.tolist()]
    per_layer = [float(s) / c if c else 0.0 for s, c in zip(layer_dlogr_sum.tolist(), counts, strict=True)]
    empty = torch.ones(0, dtype=torch.float64)
    gamma = empty if gamma is None else gamma
    gamma_raw = empty if gamma_raw is None else gamma_raw
    n = int(tot[2])
    if n == 0:
        return RouterShift(gamma, gamma_raw, [0.0] * len(per_layer), 1.0, 1.0, 0.0, gamma_min, 0)
    (g_sum,) = summarize([g], red)
    return RouterShift(
        gamma=gamma,
        gamma_raw=gamma_raw,
        per_layer_dlogr=per_layer,
        gamma_mean=float(tot[0]) / n,
        gamma_p1=g_sum.quantile(0.01),
        floor_frac=float(tot[1]) / n,
        gamma_min=gamma_min,
        n_tokens=n,
    )


def router_shift(
    router_new: torch.Tensor,
    router_old: torch.Tensor,
    old_routes: torch.Tensor,
    mask: torch.Tensor,
    *,
    scores: str = "logits",
    normalize: str = "all",
    gamma_min: float = DEFAULT_GAMMA_MIN,
    n_layers: int | None = None,
    reducer=None,
) -> RouterShift:
    """RSPO router-shift weight gamma_{i,t} (arXiv 2510.23027, Sec. 3, the router shift ratio with floor).

    gamma_{i,t} = max(exp(-(1/L) sum_l (1/K) sum_k |log r_theta^{(l)}(e_k) - log r_old^{(l)}(e_k)|), gamma_min)
    over the K experts e_k that the old policy activated (`old_routes`), used under stop-gradient.

    router_new, router_old: `[*lead, L, E]` current and old router outputs; old_routes `[*lead, L, K]`.

    Choice of r (the paper's "router scores"): by default r is the router's softmax over all E experts
    (`normalize="all"`), the distribution the router itself defines, gathered at the old top-k; with it,
    probability mass that moves to experts outside the old top-k also lowers gamma. This matches the paper's
    description of gamma as computed from router logits/scores of the old-activated experts, and the one
    public implementation found (softmax over all experts, then gather). `normalize="topk"` renormalises
    over the old top-k instead (only relative weights inside the old set count). For sigmoid routers pass
    their logits with scores="sigmoid" (see `router_logp` for which normalisation is the model's).
    Provenance: the stored copies of the paper reachable from this project show the formula above, the
    old-top-k conditioning, stop-gradient and the floor, but not the Sec. 3 sentence on normalisation nor
    a numeric gamma_min; DEFAULT_GAMMA_MIN = 0.8 follows the config default `algo.router_shift_gamma_min`
    and should be checked against the paper's hyper-parameter table.
    """
    if not isinstance(router_new, torch.Tensor) or router_new.dim() < 3:
        raise ValueError("router_new must be a tensor [*lead, L, E]")
    if not isinstance(router_old, torch.Tensor) or router_old.shape != router_new.shape:
        got = tuple(router_old.shape) if isinstance(router_old, torch.Tensor) else type(router_old).__name__
        raise ValueError(f"router_old shape {got} must equal router_new shape {tuple(router_new.shape)}")
    if not router_new.is_floating_point() or not router_old.is_floating_point():
        raise ValueError("router_new and router_old must be floating tensors (logits or probabilities)")
    lead, (L, E) = router_new.shape[:-2], router_new.shape[-2:]
    valid = _valid_mask(mask, lead)
    if n_layers is not None and n_layers != L:
        raise ValueError(f"router_new has {L} MoE layers, expected {n_layers} (wrong layer count)")
    check_routes(old_routes, valid, n_experts=E, name="old_routes", n_layers=L)
    for name, t in (("router_new", router_new), ("router_old", router_old)):
        v = t[valid]
        if not torch.isfinite(v).all():
            raise ValueError(f"{name} is not finite at a valid token")
        if scores == "probs" and v.numel() and (v.min() < 0 or v.max() > 1):
            raise ValueError(f"{name} must hold probabilities in [0, 1] when scores='probs'")
    new_lp = gather_router_logp(router_new, old_routes, scores=scores, normalize=normalize)
    old_lp = gather_router_logp(router_old, old_routes, scores=scores, normalize=normalize)
    return router_shift_from_logp(new_lp, old_lp, mask, gamma_min=gamma_min, reducer=reducer)


# ---------------------------------------------------------------- expert load


def expert_counts(routes: torch.Tensor, mask: torch.Tensor, *, n_experts: int, reducer=None) -> torch.Tensor:
    """Routed-slot counts `[L, E]` fp64 over valid tokens (each token adds K slots per layer), global."""
    if not isinstance(routes, torch.Tensor) or routes.dim() < 3:
        raise ValueError("routes must be an integer tensor [*lead, L, K]")
    valid = _valid_mask(mask, routes.shape[:-2])
    check_routes(routes, valid, n_experts=n_experts, name="routes")
    L = routes.shape[-2]
    sel = routes[valid]  # [n, L, K]
    offs = torch.arange(L, device=routes.device).view(1, L, 1) * n_experts
    flat = (sel.to(torch.int64) + offs).reshape(-1)
    counts = torch.bincount(flat, minlength=L * n_experts).to(torch.float64).view(L, n_experts)
    return _reducer(reducer).sum(counts)


def load_distribution(counts: torch.Tensor) -> torch.Tensor:
    """Per-layer load distribution `[L, E]` (rows sum to 1); a layer with no tokens is all zeros."""
    tot = counts.sum(-1, keepdim=True)
    return torch.where(tot > 0, counts / tot.clamp_min(1e-300), torch.zeros_like(counts))


def load_entropy(load: torch.Tensor) -> torch.Tensor:
    """Normalised entropy per layer `[L]`: -sum_e p log p / log E, in [0, 1] (1 = perfectly balanced).

    0 log 0 = 0; an empty layer (all zeros) has entropy 0; with E = 1 the value is defined as 1.
    """
    E = load.shape[-1]
    h = -torch.where(load > 0, load * load.clamp_min(1e-300).log(), torch.zeros_like(load)).sum(-1)
    if E == 1:
        return torch.ones_like(h)
    return h / math.log(E)


def load_metrics(load: torch.Tensor, *, layer_offset: int = 0) -> dict[str, float]:
    """`moe/load_entropy` (mean over layers) and `moe/load_entropy/layer_{l}` from a `[L, E]` load."""
    ent = load_entropy(load).tolist()
    out = {f"{PREFIX}load_entropy": sum(ent) / len(ent) if ent else 0.0}
    for i, v in enumerate(ent):
        out[f"{PREFIX}load_entropy/layer_{layer_offset + i}"] = v
    return out


class LoadDriftTracker:
    """Load drift between consecutive steps: L1 distance sum_e |p_t(e) - p_{t-1}(e)| per layer, in [0, 2].

    `update(load)` with the step's `[L, E]` distribution returns `moe/load_drift` (mean over layers) and
    `moe/load_drift/layer_{l}`, or {} on the first step (nothing to compare). Empty layers (all-zero rows,
    no tokens) are skipped and do not replace the previous distribution. State is JSON-serialisable.
    """

    def __init__(self, *, layer_offset: int = 0):
        self.layer_offset = layer_offset
        self._prev: torch.Tensor | None = None

    def update(self, load: torch.Tensor) -> dict[str, float]:
        if not isinstance(load, torch.Tensor) or load.dim() != 2:
            raise ValueError("load must be a [L, E] tensor (see load_distribution)")
        load = load.detach().to(torch.float64).cpu()
        if self._prev is not None and self._prev.shape != load.shape:
            raise ValueError(
                f"load shape {tuple(load.shape)} differs from the previous step's {tuple(self._prev.shape)} "
                "(layer or expert count changed)"
            )
        present = load.sum(-1) > 0
        if self._prev is None:
            self._prev = load.clone()
            return {}
        prev_present = self._prev.sum(-1) > 0
        both = present & prev_present
        drift = (load - self._prev).abs().sum(-1)
        self._prev = torch.where(present[:, None], load, self._prev)
        out: dict[str, float] = {}
        vals = [float(drift[i]) for i in range(load.shape[0]) if both[i]]
        if not vals:
            return out
        out[f"{PREFIX}load_drift"] = sum(vals) / len(vals)
        for i in range(load.shape[0]):
            if both[i]:
                out[f"{PREFIX}load_drift/layer_{self.layer_offset + i}"] = float(drift[i])
        return out

    def state_dict(self) -> dict:
        return {"version": 1, "prev": None if self._prev is None else self._prev.tolist()}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("version") != 1 or "prev" not in state:
            raise ValueError("LoadDriftTracker.load_state_dict: not a LoadDriftTracker state (version 1)")
        prev = state["prev"]
        self._prev = None if prev is None else torch.tensor(prev, dtype=torch.float64)
