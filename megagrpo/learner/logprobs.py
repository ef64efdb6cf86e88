"""Per-token log-probabilities and entropy of the taken tokens under a vocab-sharded output layer.

With tensor parallelism each rank holds the logits of one contiguous vocab slice
`[vocab_start, vocab_start + V_local)`. The full-vocab log-softmax is never materialised or gathered:
every rank reduces its slice to four numbers per token (local max, sum-exp, shifted first moment,
target logit), and those `[N]` vectors are combined across the TP group, the way megatron-core's
vocab-parallel cross-entropy combines max, sum-exp and target logit.

Memory: the work runs over blocks of `chunk_tokens` rows, so the extra memory is about two blocks of
fp32 logits plus a few `[N]` vectors, never a second `[N, V]` copy. Within a block, torch's fused
log-softmax kernel does the per-row work. The backward pass recomputes the
softmax block by block from the saved logits and the per-token `lse` and entropy, so it needs no
communication and the same small working set (plus the gradient itself, which autograd requires).

Formulas (z = logits / T, p = softmax(z), t = target):
  logp_t = z_t - lse,            lse = log sum_j exp(z_j)
  H      = lse - sum_j p_j z_j   (Shannon entropy of the sampling distribution)
  d logp_t / d z_j = 1[j = t] - p_j
  d H / d z_j      = -p_j (z_j - E_p[z]) = -p_j (log p_j + H)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["token_logprobs_and_entropy"]


def token_logprobs_and_entropy(
    logits_shard: Tensor,
    targets: Tensor,
    *,
    tp_group: Any = None,
    vocab_start: int = 0,
    chunk_tokens: int | None = None,
    with_entropy: bool = True,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each target token and the entropy of each token's distribution.

    Args:
        logits_shard: `[..., V_local]` logits of this rank's vocab slice (any float dtype; the math runs
            in fp32, or fp64 for fp64 input). Leading dims are flattened to N tokens.
        targets: `[...]` (same leading shape) int64 GLOBAL vocab ids in `[0, V_local * tp_size)`.
            Positions that will be masked out must still hold a valid id (e.g. 0).
        tp_group: the tensor-parallel process group sharding the vocab; None means unsharded.
        vocab_start: first global vocab id held by this rank (`rank_in_tp * V_local` for megatron).
        chunk_tokens: rows processed at once; the extra memory is ~2 * chunk_tokens * V_local fp32.
            None picks a block of ~1 MiB of fp32 logits on the CPU (it stays in L2 cache, which measured
            several times faster than larger blocks) and 1024 rows on a GPU.
        with_entropy: also compute the entropy (and its gradient); False returns None for it.
        temperature: the sampler's temperature T; logits are divided by T before the softmax.
        vocab_size: the real (unpadded) global vocab size. Columns of global id >= vocab_size (megatron
            pads the vocab to a multiple of TP) are excluded from the softmax and get zero gradient,
            without a masked copy of the logits. None: every column is a real token.

    Returns:
        (logp, entropy): each `[...]` in the compute dtype (fp32 for fp32/bf16/fp16 input), identical on
        every rank of `tp_group`. Both are differentiable w.r.t. `logits_shard`.
    """
    if logits_shard.dim() < 1:
        raise ValueError(f"logits_shard must be [..., V_local], got shape {tuple(logits_shard.shape)}")
    if tuple(targets.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits_shard's leading shape "
            f"{tuple(logits_shard.shape[:-1])}"
        )
    if chunk_tokens is None:
        chunk_tokens = _default_chunk_tokens(logits_shard)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor of vocab ids, got {targets.dtype}")
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    v_local = logits_shard.shape[-1]
    vocab_total = v_local * tp_size
    if vocab_size is None:
        vocab_size = vocab_total
    if not 0 < vocab_size <= vocab_total:
        raise ValueError(f"vocab_size must lie in [1, {vocab_total}] (V_local * tp_size), got {vocab_size}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(
            f"targets must lie in [0, {vocab_size}) (the vocab size); got range "
            f"[{int(targets.min())}, {int(targets.max())}]; give masked positions a valid id such as 0"
        )
    v_valid = max(0, min(v_local, vocab_size - vocab_start))  # real-token columns of this shard
    lead = logits_shard.shape[:-1]
    logits2d = logits_shard.reshape(-1, v_local)
    logp, entropy = _VocabParallelLogprobEntropy.apply(
        logits2d, targets.reshape(-1), tp_group, vocab_start, v_valid, chunk_tokens, 1.0 / temperature,
        with_entropy,
    )  # fmt: skip
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)


# Below this, exp() is exactly 0 in fp32 and fp64; clamping log p here changes no result but keeps
# p * log p finite for -inf logits.
_LOG_P_FLOOR = -1e4


def _default_chunk_tokens(logits: Tensor) -> int:
    if logits.device.type == "cpu":
        return max(1, (1 << 18) // max(1, logits.shape[-1]))
    return 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _local_target_index(targets: Tensor, vocab_start: int, v_local: int) -> tuple[Tensor, Tensor]:
    """`[n]` index of each target inside this shard (clamped) and `[n]` bool: target lives here."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < v_local)
    return local.clamp(0, v_local - 1), owned


def _run_blocks(n: int, chunk: int, block: Callable[[int, int], None], device: torch.device) -> None:
    """Call `block(lo, hi)` for every row block of `[0, n)`. Blocks write disjoint rows.

    On the CPU the blocks are spread over `torch.get_num_threads()` Python threads, each running torch
    single-threaded (OpenMP thread counts are per thread): a block is ~1 MiB, far too small to split
    across cores, and thousands of tiny OpenMP regions stall whenever another process holds a core
    (measured 20-70x slower on this shared 2-core machine). torch releases the GIL inside its kernels.
    """
    starts = range(0, n, chunk)
    workers = min(torch.get_num_threads(), len(starts)) if device.type == "cpu" else 1

    def run(first: int, step: int) -> None:
        if workers > 1:
            torch.set_num_threads(1)
        with torch.no_grad():  # grad mode is per thread: autograd must not record the blocks
            for lo in starts[first::step]:
                block(lo, min(lo + chunk, n))

    if workers <= 1:
        run(0, 1)
        return
    errors: list[BaseException] = []

    def guarded(first: int) -> None:
        try:
            run(first, workers)
        except BaseException as e:  # re-raised in the caller below
            errors.append(e)

    # All blocks run in new threads: set_num_threads(1) must not leak into the caller's thread.
    threads = [threading.Thread(target=guarded, args=(w,), daemon=True) for w in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,  # [N, V_local]
        targets: Tensor,  # [N] global ids
        tp_group: Any,
        vocab_start: int,
        v_valid: int,  # columns [0, v_valid) are real tokens; the rest is vocab padding
        chunk: int,
        inv_temp: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        cdt = _compute_dtype(logits.dtype)
        local_idx, owned = _local_target_index(targets, vocab_start, max(v_valid, 1))
        if v_valid == 0:
            owned = torch.zeros_like(owned)
        # Per token, this shard's own log-softmax statistics: lse_l = log sum_{j in shard} exp(z_j),
        # H_l = entropy of the shard-normalised distribution, and lsm_t = z_t - lse_l where owned.
        # torch's fused log_softmax does the per-row work in one cache-friendly kernel.
        lse_l = torch.empty(n, dtype=cdt, device=logits.device)
        h_l = torch.zeros(n, dtype=cdt, device=logits.device)
        lsm_t = torch.empty(n, dtype=cdt, device=logits.device)
        if v_valid == 0:  # a shard of padding only: no probability mass here
            lse_l.fill_(float("-inf"))

        def block(lo: int, hi: int) -> None:
            z = logits[lo:hi, :v_valid]
            if z.dtype != cdt or inv_temp != 1.0:
                z = z.to(cdt) * inv_temp
            lsm = torch.log_softmax(z, dim=-1)
            # lse_l = z_j - lsm_j at the argmax j, where lsm_j = -log(sum-exp) is small: no cancellation.
            zmax = torch.amax(z, dim=-1)
            empty = zmax == float("-inf")  # every token of this shard masked: no mass here (not nan)
            lse_l[lo:hi] = torch.where(empty, zmax, zmax - torch.amax(lsm, dim=-1))
            lsm_t[lo:hi] = lsm.gather(-1, local_idx[lo:hi].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                p = torch.exp(lsm)
                # -inf logits (masked tokens) have p = 0; clamping keeps 0 * log 0 at 0 instead of nan.
                h = torch.linalg.vecdot(p, lsm.clamp_min_(_LOG_P_FLOOR)).neg_()
                h_l[lo:hi] = torch.where(empty, 0.0, h)

        if v_valid:
            _run_blocks(n, chunk, block, logits.device)

        if tp_group is None:
            lse, entropy = lse_l, h_l
            logp = lsm_t
        else:
            # Shard l holds probability mass w_l = exp(lse_l - lse). With M = max_l lse_l, a_l =
            # exp(lse_l - M) and S = sum_l a_l: lse = M + log S, logp_t = lsm_t + (lse_l - M) - log S
            # on the owning shard, and H = sum_l w_l (H_l - log w_l)
            #   = (sum_l a_l H_l - sum_l a_l (lse_l - M)) / S + log S.
            big_m = lse_l.clone()
            dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
            rel = lse_l - big_m
            a = torch.exp(rel)
            a_rel = torch.where(a > 0, a * rel, 0.0)  # 0 * -inf for a padding-only shard
            stats = torch.stack([a, a * h_l - a_rel, torch.where(owned, lsm_t + rel, 0.0)])
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
            log_s = torch.log(stats[0])
            lse = big_m + log_s
            logp = stats[2] - log_s
            entropy = stats[1] / stats[0] + log_s
        if not with_entropy:
            entropy = torch.zeros_like(logp)

        ctx.save_for_backward(logits, local_idx, owned, lse, entropy)
        ctx.chunk, ctx.inv_temp, ctx.with_entropy, ctx.v_valid = chunk, inv_temp, with_entropy, v_valid
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None) -> tuple[Any, ...]:
        logits, local_idx, owned, lse, entropy = ctx.saved_tensors
        nones = (None,) * 7
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None, *nones)
        n, v_local = logits.shape
        v_valid = ctx.v_valid
        cdt = lse.dtype
        gl = grad_logp.to(cdt) if grad_logp is not None else torch.zeros_like(lse)
        # gl is also the coefficient of the one-hot term, added only where this shard owns the target.
        onehot_coef = torch.where(owned, gl, 0.0)
        grad = torch.empty_like(logits) if v_valid == v_local else torch.zeros_like(logits)
        inv_temp = ctx.inv_temp

        def block(lo: int, hi: int) -> None:
            logp_all = logits[lo:hi, :v_valid].to(cdt) * inv_temp
            logp_all.sub_(lse[lo:hi].unsqueeze(-1))  # log p_j
            p = torch.exp(logp_all)
            logp_all.clamp_min_(_LOG_P_FLOOR)  # where p underflows to 0, keep p * (log p + H) finite
            # dL/dz_j = gl (1[j=t] - p_j) - gh p_j (log p_j + H), built in the log-p buffer.
            if grad_entropy is not None:
                gh = grad_entropy[lo:hi].to(cdt).unsqueeze(-1)
                g = logp_all.add_(entropy[lo:hi].unsqueeze(-1)).mul_(gh).add_(gl[lo:hi].unsqueeze(-1))
                g.mul_(p).neg_()
            else:
                g = p.mul_(gl[lo:hi].unsqueeze(-1)).neg_()
            g.scatter_add_(-1, local_idx[lo:hi].unsqueeze(-1), onehot_coef[lo:hi].unsqueeze(-1))
            if inv_temp != 1.0:
                g.mul_(inv_temp)
            grad[lo:hi, :v_valid].copy_(g)

        if v_valid:
            _run_blocks(n, ctx.chunk, block, logits.device)
        return (grad, *nones)
