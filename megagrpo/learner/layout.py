"""Token layouts: THE one module that converts per-token tensors between padded, packed and router order.

Conventions (B sequences, T padded length, N packed tokens):

* **Padded**: `input_ids [B, T]`, right-padded; `seq_lens [B]` real tokens per row; `loss_mask [B, T]`.
  A per-token result `x[i, t]` belongs to token `input_ids[i, t]`; for log-probabilities that is
  `log p(x_t | x_<t)`, so column 0 (no context) is 0 and never in the loss mask.
* **Packed (THD)**: the real tokens of all rows concatenated, each row padded to a multiple of
  `pad_multiple` (sequence parallel needs the stream split evenly over TP), as `[N]` with
  `cu_seqlens [B+1]` (real boundaries) and `cu_seqlens_padded [B+1]` (storage boundaries). megatron
  gets them as `PackedSeqParams(qkv_format="thd")` and `input_ids [1, N]`.
* **Next-token**: the model's output at a position predicts the NEXT token of the same sequence;
  `next_token_targets` builds those targets, and `shift_to_tokens` moves results from "predicting
  position" to "predicted token" (the padded convention above).
* **Micro-batches** hold whole sequences: `split_micro_batches` / `shard_for_data_parallel` return
  sample indices, `restore_order` puts per-sample results back in the original order.
* **Router order**: the order in which a MoE layer on one TP rank sees tokens (what megatron's
  `RouterReplay` records and replays): padded batches run as `[T, b]` flattened sequence-major,
  packed ones as `[N]`; under sequence parallelism each TP rank holds one contiguous 1/tp slice of
  that order. `router_token_positions` gives, for each router token of a rank, its (sample, position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Packed:
    """A packed (THD) micro-batch. Shapes: `input_ids [N]`, `position_ids [N]`, `cu_seqlens [B+1]`,
    `cu_seqlens_padded [B+1]` (int32), `seq_lens [B]` (int64). N = cu_seqlens_padded[-1]."""

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    seq_lens: Tensor
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_padded[-1])

    def packed_seq_params(self):  # -> megatron.core.packed_seq_params.PackedSeqParams
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def seq_lens_from_mask(attention_mask: Tensor) -> Tensor:
    """`[B, T]` 0/1 right-padding mask -> `[B]` int64 lengths (checks it really is right-padded)."""
    m = attention_mask.bool()
    lens = m.sum(-1)
    expect = torch.arange(m.shape[1], device=m.device).unsqueeze(0) < lens.unsqueeze(1)
    if not torch.equal(m, expect):
        raise ValueError("attention_mask must be right-padded (ones then zeros in every row)")
    return lens.to(torch.int64)


def _check_lens(seq_lens: Tensor, T: int) -> list[int]:
    lens = [int(x) for x in seq_lens.tolist()]
    if any(n < 1 or n > T for n in lens):
        raise ValueError(f"seq_lens must lie in [1, {T}], got {lens}")
    return lens


def pack(input_ids: Tensor, seq_lens: Tensor, *, pad_multiple: int = 1, total_multiple: int = 1) -> Packed:
    """Padded `[B, T]` ids -> packed THD; every row padded to a multiple of `pad_multiple`, and the last
    row further so that N is a multiple of `total_multiple` (FP8 GEMMs, see `forward.pad_multiples`)."""
    B, T = input_ids.shape
    lens = _check_lens(seq_lens, T)
    padded = [round_up(n, pad_multiple) for n in lens]
    padded[-1] += round_up(sum(padded), total_multiple) - sum(padded)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu_p = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    cu_p[1:] = torch.tensor(padded).cumsum(0)
    N = int(cu_p[-1])
    ids = input_ids.new_zeros(N)
    pos = torch.zeros(N, dtype=torch.int64, device=input_ids.device)
    for i, (n, p) in enumerate(zip(lens, padded)):
        lo = int(cu_p[i])
        ids[lo : lo + n] = input_ids[i, :n]
        pos[lo : lo + p] = torch.arange(p)
    return Packed(
        ids, pos, cu.to(input_ids.device), cu_p.to(input_ids.device), seq_lens.to(torch.int64), max(padded)
    )


def pack_values(values: Tensor, packed: Packed) -> Tensor:
    """Per-token `[B, T, ...]` (padded layout) -> `[N, ...]` in the packed layout (zeros in padding)."""
    out = values.new_zeros((packed.num_tokens, *values.shape[2:]))
    for i, n in enumerate(packed.seq_lens.tolist()):
        lo = int(packed.cu_seqlens_padded[i])
        out[lo : lo + n] = values[i, :n]
    return out


def unpack_values(values: Tensor, packed: Packed, T: int) -> Tensor:
    """Packed `[N, ...]` -> padded `[B, T, ...]` (zeros beyond each sequence). Differentiable."""
    rows = []
    for i, n in enumerate(packed.seq_lens.tolist()):
        lo = int(packed.cu_seqlens_padded[i])
        row = values[lo : lo + n]
        if n < T:
            row = torch.cat([row, row.new_zeros((T - n, *values.shape[1:]))], dim=0)
        rows.append(row)
    return torch.stack(rows, dim=0)


def next_token_targets(input_ids: Tensor, seq_lens: Tensor) -> Tensor:
    """Padded `[B, T]`: the token each position predicts (`input_ids[i, t+1]`), 0 where there is none."""
    B, T = input_ids.shape
    tgt = torch.zeros_like(input_ids)
    tgt[:, :-1] = input_ids[:, 1:]
    valid = torch.arange(T, device=input_ids.device).unsqueeze(0) < (
        seq_lens.to(input_ids.device) - 1
    ).unsqueeze(1)
    return torch.where(valid, tgt, torch.zeros_like(tgt))


def shift_to_tokens(per_position: Tensor, seq_lens: Tensor) -> Tensor:
    """`[B, T, ...]` results at the predicting position -> at the predicted token (column 0 becomes 0,
    and everything at or beyond each sequence's length is 0). Differentiable."""
    B, T = per_position.shape[:2]
    shifted = torch.cat(
        [per_position.new_zeros((B, 1, *per_position.shape[2:])), per_position[:, :-1]], dim=1
    )
    valid = torch.arange(T, device=per_position.device).unsqueeze(0) < seq_lens.to(
        per_position.device
    ).unsqueeze(1)
    valid = valid.view(B, T, *([1] * (per_position.dim() - 2)))
    return torch.where(valid, shifted, torch.zeros_like(shifted))


def pad_to_length(values: Tensor, T: int, value: float | int = 0) -> Tensor:
    """`[B, t, ...]` -> `[B, T, ...]` by right-padding (or truncating padding) along dim 1."""
    t = values.shape[1]
    if t == T:
        return values
    if t > T:
        return values[:, :T]
    pad = values.new_full((values.shape[0], T - t, *values.shape[2:]), value)
    return torch.cat([values, pad], dim=1)


# -- splitting whole sequences ------------------------------------------------------------------------


def _balanced_groups(lengths: Sequence[int], n_groups: int) -> list[list[int]]:
    """Longest-first greedy onto the lightest group (spread <= the longest sequence; the first n_groups
    sequences open one group each, so none is empty); indices inside a group stay sorted."""
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    loads = [0] * n_groups
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        g = min(range(n_groups), key=lambda g: (loads[g], len(groups[g]), g))
        groups[g].append(i)
        loads[g] += lengths[i]
    return [sorted(g) for g in groups]


def _contiguous_groups(n: int, n_groups: int) -> list[list[int]]:
    base, extra = divmod(n, n_groups)
    out, lo = [], 0
    for g in range(n_groups):
        hi = lo + base + (1 if g < extra else 0)
        out.append(list(range(lo, hi)))
        lo = hi
    return out


def split_micro_batches(seq_lens: Tensor, num_micro_batches: int, *, balance: bool = False) -> list[Tensor]:
    """Sample indices `[b_k]` (int64) of each micro-batch; whole sequences, none empty.

    balance=False keeps contiguous runs of the original order; True balances token counts
    (longest-first greedy), which evens out pipeline stages and DP ranks.
    """
    n = int(seq_lens.numel())
    if not 1 <= num_micro_batches <= n:
        raise ValueError(f"num_micro_batches={num_micro_batches} must be in [1, batch size {n}]")
    groups = (
        _balanced_groups([int(x) for x in seq_lens.tolist()], num_micro_batches)
        if balance
        else _contiguous_groups(n, num_micro_batches)
    )
    return [torch.tensor(g, dtype=torch.int64) for g in groups]


def shard_for_data_parallel(seq_lens: Tensor, dp_rank: int, dp_size: int, *, balance: bool = False) -> Tensor:
    """The sample indices this DP rank owns (whole sequences; every rank gets at least one)."""
    return split_micro_batches(seq_lens, dp_size, balance=balance)[dp_rank]


def restore_order(parts: Sequence[Tensor], indices: Sequence[Tensor]) -> Tensor:
    """Inverse of splitting: `parts[k]` `[b_k, ...]` holds samples `indices[k]`; returns `[B, ...]`."""
    idx = torch.cat([i.to(torch.int64) for i in indices])
    if idx.numel() != len(set(idx.tolist())):
        raise ValueError("indices overlap")
    out = torch.empty((idx.numel(), *parts[0].shape[1:]), dtype=parts[0].dtype, device=parts[0].device)
    out[idx.to(out.device)] = torch.cat(list(parts), dim=0)
    return out


# -- router order (for routing replay) -----------------------------------------------------------------


def router_token_positions(
    seq_lens: Tensor, *, T: int | None, packed: Packed | None, tp_rank: int = 0, sp_size: int = 1
) -> tuple[Tensor, Tensor]:
    """For each token a MoE router sees on this TP rank, its `(sample, position)` in the padded layout.

    Padded micro-batch of `[b, T]` (pass T, packed=None): megatron runs `[T, b]`, so router token k is
    (k % b, k // b). Packed (pass packed): router token k is packed slot k. With sequence parallelism
    (sp_size = tp) the rank sees slice `[rank * n / tp, (rank + 1) * n / tp)`.
    Returns `sample [n_local]` and `position [n_local]` (int64); padding slots get sample -1.
    """
    if packed is not None:
        n = packed.num_tokens
        sample = torch.full((n,), -1, dtype=torch.int64)
        position = torch.zeros(n, dtype=torch.int64)
        for i, ln in enumerate(packed.seq_lens.tolist()):
            lo = int(packed.cu_seqlens_padded[i])
            sample[lo : lo + ln] = i
            position[lo : lo + ln] = torch.arange(ln)
    else:
        if T is None:
            raise ValueError("pass T for a padded micro-batch")
        b = int(seq_lens.numel())
        k = torch.arange(T * b)
        sample, position = k % b, k // b
        sample = torch.where(position < seq_lens[sample].cpu(), sample, torch.full_like(sample, -1))
        n = T * b
    if n % sp_size:
        raise ValueError(f"{n} router tokens do not split over sequence-parallel size {sp_size}")
    lo, hi = tp_rank * n // sp_size, (tp_rank + 1) * n // sp_size
    return sample[lo:hi], position[lo:hi]
