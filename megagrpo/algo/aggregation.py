"""Loss aggregation: how per-token losses `[B, T]` become one scalar, identically for any data split.

Notation for ONE global batch (all DP ranks, all micro-batches of one optimizer step):
`n_i` = number of loss tokens of sequence i (its `loss_mask` row sum), `N = sum_i n_i`, `S` = number of
sequences with `n_i > 0`, `C = agg_constant`. For a per-token loss `l[i, t]` the four modes are

| agg                       | loss                                  | `loss_normaliser` | per-token weight |
|---------------------------|---------------------------------------|-------------------|------------------|
| `token-mean`              | sum_{i,t} l / N                       | N                 | 1                |
| `seq-mean-token-mean`     | sum_i (sum_t l / n_i) / S             | S                 | 1 / n_i          |
| `seq-mean-token-sum`      | sum_i sum_t l / S                     | S                 | 1                |
| `seq-mean-token-sum-norm` | sum_i sum_t l / (S * C)   (Dr. GRPO)  | S * C             | 1                |

Distributed contract (what the learner relies on):

1. The trainer calls `loss_normaliser(global_loss_mask, agg, agg_constant)` ONCE per optimizer step on
   the mask of the whole global batch (or computes the same number from all-reduced token / sequence
   counts: N, S, S*C), and passes it as `normaliser=` to every `policy_loss` / `aggregate` call.
2. Each call returns `sum over ITS sequences of (per-token weight * l) / normaliser`. The per-token
   weight depends only on the sequence itself (`1/n_i` is local to the row), so micro-batches must hold
   whole sequences, which they always do here.
3. Therefore the sum of the micro-batch losses over all micro-batches and DP ranks equals the one-batch
   loss, for every mode, whatever the DP size, micro-batch split or PP schedule. With DP gradient
   averaging (megatron divides the all-reduced gradient by the DP size) multiply each micro-batch loss by
   the DP size, or all-reduce with SUM; that scaling is the learner's business, not this module's.
4. Without `normaliser` the normaliser is computed from the given (local) mask, i.e. the local batch is
   treated as the whole batch. `normaliser=1.0` returns the plain weighted sum ("the loss as a sum").
5. An all-zero (local) mask gives a loss of exactly 0 that still back-propagates (zero gradients).

`loss_normaliser` returns 0.0 for an all-zero global mask; passing `normaliser=0` is only accepted when
the local mask is empty too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagrpo.algo import _checks

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_agg(agg: str, agg_constant: float | None) -> None:
    _checks.choice("agg", agg, AGG_MODES)
    if agg == "seq-mean-token-sum-norm":
        _checks.positive("agg_constant", agg_constant)


def _normaliser_tensor(m: Tensor, agg: str, agg_constant: float | None) -> Tensor:
    """The normaliser of the table above for bool mask `m` [B, T], as a 0-dim float64 tensor (no sync)."""
    if agg == "token-mean":
        return m.sum().to(torch.float64)
    seqs = m.any(dim=-1).sum().to(torch.float64)
    if agg == "seq-mean-token-sum-norm":
        return seqs * float(agg_constant)
    return seqs


def loss_normaliser(loss_mask: Tensor, agg: str, agg_constant: float | None = None) -> float:
    """The global denominator for `agg` (see the module table): N, S, S or S*C. Computed once per step.

    loss_mask: `[B, T]` bool or 0/1 of the WHOLE global batch. Returns a python float (0.0 if empty).
    """
    _check_agg(agg, agg_constant)
    loss_mask = _checks.tensor("loss_mask", loss_mask)
    _checks.ndim("loss_mask", loss_mask, 2, "[B, T]")
    m = _checks.mask("loss_mask", loss_mask, loss_mask)
    return float(_normaliser_tensor(m, agg, agg_constant))


def loss_normaliser_tensor(loss_mask: Tensor, agg: str, agg_constant: float | None = None) -> Tensor:
    """`loss_normaliser` of one rank's rows as a 0-dim float64 tensor: every normaliser is a sum over
    rows, so the sum of this over the DP ranks (each holding different rows) is the global one."""
    _check_agg(agg, agg_constant)
    loss_mask = _checks.tensor("loss_mask", loss_mask)
    _checks.ndim("loss_mask", loss_mask, 2, "[B, T]")
    return _normaliser_tensor(_checks.mask("loss_mask", loss_mask, loss_mask), agg, agg_constant)


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    agg: str,
    *,
    agg_constant: float | None = None,
    normaliser: float | Tensor | None = None,
) -> Tensor:
    """Aggregates per-token `values` [B, T] into a scalar by `agg` (verl/ROLL modes; Dr. GRPO 2503.20783 Eq. 3).

    `values` may hold anything (even NaN) where `loss_mask` is false: those positions are excluded with
    `where`, never multiplied by 0. See the module docstring for the `normaliser` contract.
    """
    _check_agg(agg, agg_constant)
    values = _checks.floating("values", values)
    _checks.ndim("values", values, 2, "[B, T]")
    m = _checks.mask("loss_mask", loss_mask, values)
    return _aggregate(values, m, agg, agg_constant, normaliser)


def _check_normaliser(normaliser: float | Tensor, m: Tensor) -> Tensor | float:
    if isinstance(normaliser, Tensor):
        if normaliser.numel() != 1:
            raise ValueError(f"normaliser must be a scalar, got shape {tuple(normaliser.shape)}")
        return normaliser.reshape(())
    v = float(normaliser)
    if v != v or v < 0 or v == float("inf"):
        raise ValueError(f"normaliser={normaliser!r} must be a finite number >= 0 (from loss_normaliser)")
    if v == 0:
        if bool(m.any()):
            raise ValueError(
                "normaliser=0 but this micro-batch has loss tokens; compute it with loss_normaliser on the "
                "global batch mask that contains this micro-batch"
            )
        return 1.0
    return v


def _aggregate(
    values: Tensor,
    m: Tensor,
    agg: str,
    agg_constant: float | None,
    normaliser: float | Tensor | None,
    *,
    n: Tensor | None = None,
    per_seq: bool = False,
    row_scale: Tensor | None = None,
) -> Tensor:
    """Unchecked core. `values` [B, T] (anything at padding), or [B, 1] with `per_seq=True` (one value on
    every loss token of its sequence). `n` [B]: loss tokens per row (computed if None). `row_scale` [B]:
    a per-sequence factor (the advantage) applied to the row sums, which saves a full [B, T] multiply."""
    if per_seq:
        if n is None:
            n = m.sum(dim=-1)
        rows = values.squeeze(-1) * n.to(values.dtype)
    else:
        rows = torch.where(m, values, 0.0).sum(dim=-1)
    if agg == "seq-mean-token-mean":
        if n is None:
            n = m.sum(dim=-1)
        rows = rows / n.clamp_min(1).to(rows.dtype)
    if row_scale is not None:
        rows = rows * row_scale
    total = rows.sum()
    if normaliser is None:
        if n is None:
            denom = _normaliser_tensor(m, agg, agg_constant)
        else:
            denom = (n.sum() if agg == "token-mean" else (n > 0).sum()).to(torch.float64)
            if agg == "seq-mean-token-sum-norm":
                denom = denom * float(agg_constant)
        denom = denom.to(total.dtype)
        # An empty batch has total == 0 exactly; dividing by 1 keeps it 0 and differentiable.
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        return total / denom
    return total / _check_normaliser(normaliser, m)


def masked_mean(values: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean of `values` [B, T] over positions where `loss_mask` is true; 0 for an empty mask."""
    return aggregate(values, loss_mask, "token-mean")


def nll_loss(
    logp: Tensor,
    loss_mask: Tensor,
    *,
    agg: str = "token-mean",
    agg_constant: float | None = None,
    normaliser: float | Tensor | None = None,
) -> Tensor:
    """SFT negative log-likelihood of the target tokens, `logp` [B, T] = log p(target), aggregated by `agg`.

    Equals `policy_loss(variant="reinforce", advantages=1)` with the same `agg` and `normaliser`.
    """
    logp = _checks.floating("logp", logp)
    _checks.ndim("logp", logp, 2, "[B, T]")
    m = _checks.mask("loss_mask", loss_mask, logp)
    _check_agg(agg, agg_constant)
    _checks.finite_where("logp", logp.detach(), m)
    return _aggregate(-logp, m, agg, agg_constant, normaliser)
