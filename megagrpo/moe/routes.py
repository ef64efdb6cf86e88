"""Routes for routing replay: validation of the sampler's route table, lookup in router order, token keys
and filler routes. Pure torch (+ torch.distributed for a sum).

A route table is int `[B, T, L, K]` in the learner's padded layout (`megagrpo.learner.layout`):
`table[i, t, l]` holds the K expert ids (global ids in [0, E)) that MoE layer l (0-based among the MoE
layers) used for token `input_ids[i, t]` as an input, or -1 (NO_ROUTE) where there is none (padding, the
last token of a sampled sequence). Replay keeps what outlives a pass per token, keyed by `token_keys`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megagrpo.errors import MegagrpoError
from megagrpo.moe.stats import check_routes

NO_ROUTE = -1


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype route tables are kept in: int16 while expert ids fit (every MoE released so far), which is
    a quarter of int64; lookups widen the few rows a router call needs."""
    return torch.int16 if num_experts < 2**15 else torch.int32


def real_tokens(seq_lens: Tensor, T: int) -> Tensor:
    """`[B, T]` bool: positions inside each sequence."""
    return torch.arange(T, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)


def validate_sampler_routes(
    routes: Tensor,
    seq_lens: Tensor,
    *,
    T: int,
    moe_layers: list[int],
    num_layers: int,
    topk: int,
    num_experts: int,
    route_layers: list[int] | None = None,
) -> Tensor:
    """Check the batch's `routes` (R3 input) and return them as `[B, T, L_moe, K]` in `route_dtype`.

    routes: int `[B, T, L, K]`, L = the number of MoE layers, or the total layer count (then the rows of
    the MoE layers `moe_layers` are taken); with `route_layers` (MoE-layer indices: a pipeline stage's
    layers, `trainer.rows`) exactly those, `L_moe` = len(route_layers). At a real token a row is either complete (K ids in [0, E), no
    repeats) or entirely -1 (no route: the last token, or a route the sampler did not return; such tokens
    are replayed with a filler route and counted as fallback). Raises MegagrpoError naming the problem.
    """
    B = int(seq_lens.numel())
    if not isinstance(routes, Tensor) or routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise MegagrpoError(
            "batch['routes'] must be an integer tensor [B, T, layers, topk] of expert ids (from the "
            "sampler's routed_experts); got " + (str(routes.dtype) if isinstance(routes, Tensor) else "none")
        )
    if routes.dim() != 4 or tuple(routes.shape[:2]) != (B, T):
        raise MegagrpoError(
            f"batch['routes'] has shape {tuple(routes.shape)}; expected [B, T, layers, topk] with "
            f"B={B}, T={T} (the input_ids shape); rebuild the batch from the rollout's routes"
        )
    L, K = int(routes.shape[2]), int(routes.shape[3])
    if route_layers is not None:
        if len(route_layers) != L:
            raise MegagrpoError(
                f"batch['routes'] has {L} layers; it should hold this stage's MoE layers {route_layers} "
                "(trainer.rows.RouteSlices): the rows were sliced for another pipeline stage"
            )
        r = routes
    elif len(moe_layers) == L:
        r = routes
    elif num_layers == L:
        r = routes[:, :, moe_layers]
    else:
        raise MegagrpoError(
            f"batch['routes'] has {L} layers; the learner's model has {len(moe_layers)} MoE layers "
            f"({num_layers} layers in all): the sampler and the learner run different models (check "
            "model.path and the engine's model directory)"
        )
    if topk != K:
        raise MegagrpoError(
            f"batch['routes'] has top-k {K}; the learner's model routes to moe_topk={topk} experts: the "
            "sampler and the learner run different models"
        )
    real = real_tokens(seq_lens.to(r.device), T)
    sel = r[real]  # [n, L, K]
    if sel.numel() and int(sel.min()) < NO_ROUTE:
        raise MegagrpoError(
            f"batch['routes'] holds expert id {int(sel.min())}; ids must be in [0, {num_experts})"
        )
    missing = sel == NO_ROUTE
    partial = missing.any(-1).any(-1) & ~missing.all(-1).all(-1)
    if partial.any():
        raise MegagrpoError(
            f"batch['routes'] has {int(partial.sum())} token(s) whose route is missing in some layers or "
            "slots but not all; a token's route must be complete or entirely -1"
        )
    present = real.clone()
    present[real] = ~missing.all(-1).all(-1)
    try:
        check_routes(r, present, n_experts=num_experts, name="batch['routes']", k=topk)
    except ValueError as e:
        raise MegagrpoError(f"{e}; the routes do not come from this model (num_experts={num_experts})") from e
    return r.to(route_dtype(num_experts))


def filler_routes(keys: Tensor, k: int, num_experts: int) -> Tensor:
    """int64 `[n, k]`: distinct experts (key + j) mod E for a token with int64 key `[n]` -- a valid route for
    tokens that have none (padding, a last token). Keyed by the token (not by its slot in a micro-batch),
    so every layout and mesh gives a token the same filler; rotating spreads fillers over the experts."""
    return (keys.unsqueeze(1) + torch.arange(k, device=keys.device).unsqueeze(0)) % num_experts


def lookup(
    table: Tensor, rows: Tensor, pos: Tensor, layer: int, *, num_experts: int
) -> tuple[Tensor, Tensor]:
    """Routes of router tokens: `table [B, T, L, K]`, `rows [n]` global rows (-1 = padding slot),
    `pos [n]` positions. Returns (int64 `[n, K]` routes with fillers where there is none, bool `[n]` True
    where the token is real but the table has no route)."""
    valid = rows >= 0
    got = table[rows.clamp_min(0), pos, layer]
    return with_fillers(got, valid, filler_keys(rows, pos, table.shape[1]), num_experts=num_experts)


def token_keys(rows: Tensor, pos: Tensor, T: int) -> Tensor:
    """int64 `[n]` key row * T + pos of each token (-1 at a padding slot, row -1): replay's per-token
    stores are keyed by it."""
    keys = rows.to(torch.int64) * T + pos
    return torch.where(rows >= 0, keys, torch.full_like(keys, -1))


def filler_keys(rows: Tensor, pos: Tensor, T: int) -> Tensor:
    """The key a token's filler route derives from: its token key, or its position at a padding slot."""
    return torch.where(rows >= 0, rows.to(torch.int64) * T + pos, pos.to(torch.int64))


def with_fillers(got: Tensor, valid: Tensor, keys: Tensor, *, num_experts: int) -> tuple[Tensor, Tensor]:
    """(int64 `[n, K]`: the routes `got` with a filler route wherever there is none, bool `[n]`: True where
    the token is real (`valid`) but `got` has no route). `keys`: `filler_keys` of the tokens."""
    got = got.to(torch.int64)
    missing = valid & (got[:, 0] == NO_ROUTE)
    fill = ~valid | missing
    if fill.any():
        got = torch.where(fill.unsqueeze(1), filler_routes(keys, got.shape[-1], num_experts), got)
    return got, missing


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """Sum over ranks (a copy); the identity without torch.distributed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y
