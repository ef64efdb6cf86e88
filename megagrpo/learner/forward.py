"""Forward (and forward+backward) over a global batch through megatron's pipeline schedule.

Every rank passes the SAME global batch, and the learner takes this rank's data-parallel shard (whole
sequences); or, with `RunOptions.local_rows`, each DP rank passes only its own rows (the trainer's
sharded data plane, `learner.row_plan`) and gets results for those rows. The rows are split into
micro-batches, runs `get_forward_backward_func()` (no pipelining, 1F1B or
interleaved, chosen by megatron from the PP/VPP sizes), and, for a forward-only pass, reassembles the
per-token results of every DP rank and pipeline stage into `[B, T]` in the original sample order, on
every rank.

Batch (a dict of tensors whose dim 0 is the sample):
  `input_ids [B, T]` int64, right-padded; `seq_lens [B]` int64 (or `attention_mask [B, T]` 0/1);
  anything else with leading dim B (`loss_mask [B, T]`, `advantages [B]`, `old_logp [B, T]`, ...) is
  sliced along with each micro-batch and handed to the loss callback.
Per-token outputs follow `layout`: `x[i, t]` is about token `input_ids[i, t]` (`logp[i, t] =
log p(x_t | x_<t)`); column 0 and padding are 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from megagrpo.errors import MegagrpoError
from megagrpo.learner import layout
from megagrpo.learner.logprobs import token_logprobs_and_entropy

# loss_fn(logp [b, T], entropy [b, T], micro_batch) -> (scalar loss, metrics): the loss of one
# micro-batch already divided by the GLOBAL normaliser, so the sum over micro-batches and DP ranks is
# the loss of the whole batch (megagrpo.algo.aggregation's distributed contract).
LossFn = Callable[[Tensor, Tensor | None, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


class ForwardHooks(Protocol):
    """Called around every model-chunk forward of every micro-batch (all PP stages, VPP chunks, and the
    recompute-free forward of training). Routing replay (issue 7) uses them to hand megatron's
    `RouterReplay` the routes of exactly this micro-batch and to collect the recorded ones; the
    micro-batch carries its layout (`samples`, `seq_lens`, `packed`, `input_ids` shape), from which
    `layout.router_token_positions` gives the router's token order on this TP rank."""

    def before_forward(self, mb: MicroBatch, chunk: Any) -> None: ...

    def after_forward(self, mb: MicroBatch, chunk: Any) -> None: ...


@dataclass(frozen=True)
class RunOptions:
    vocab_size: int  # real (unpadded) vocab: logits of padded rows are excluded from the softmax
    num_micro_batches: int = 1  # per DP rank; the same on every rank
    packed: bool = True  # THD packing (no compute on padding) or padded [b, T] micro-batches
    balance: bool = False  # token-balanced DP shards and micro-batches instead of contiguous runs
    temperature: float = 1.0  # the sampler's temperature (logits / T before the softmax)
    with_entropy: bool = True
    chunk_tokens: int = 1024  # logprob/entropy working-set bound (rows of logits at once)
    local_rows: bool = False  # the batch is this DP rank's rows only: no DP shard, no DP gather of results


@dataclass
class MicroBatch:
    index: int  # position among this rank's micro-batches
    samples: Tensor  # [b] indices into the GLOBAL batch
    data: dict[str, Tensor]  # the global batch's tensors sliced to these samples (dim 0 = b)
    input_ids: Tensor  # model input: [b, T_mb] padded or [1, N] packed
    position_ids: Tensor | None
    targets: Tensor  # next-token targets in the model-input layout ([b, T_mb] or [1, N])
    seq_lens: Tensor  # [b]
    packed: layout.Packed | None
    T: int  # global padded length (results are returned as [b, T])


def _seq_lens(batch: dict[str, Tensor]) -> Tensor:
    if "seq_lens" in batch:
        return batch["seq_lens"].to(torch.int64).cpu()
    if "attention_mask" in batch:
        return layout.seq_lens_from_mask(batch["attention_mask"]).cpu()
    raise MegagrpoError("the batch needs 'seq_lens' [B] or 'attention_mask' [B, T] next to 'input_ids'")


def _check_batch(batch: dict[str, Tensor]) -> tuple[int, int]:
    if "input_ids" not in batch or batch["input_ids"].dim() != 2:
        raise MegagrpoError("the batch needs 'input_ids' of shape [B, T]")
    B, T = batch["input_ids"].shape
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] != B:
            raise MegagrpoError(
                f"batch[{k!r}] has leading size {v.shape[0]}, expected B={B} (one row per sample)"
            )
    return B, T


def pad_multiples(config: Any) -> tuple[int, int]:
    """`(row, total)`: each packed sequence is padded to a multiple of `row`, and a micro-batch's token
    count N (packed) or padded length (padded layout) to a multiple of `total`.

    row: sequence parallelism splits the token stream evenly over TP; TE's context parallelism splits each
    sequence into 2*cp chunks. total: Transformer Engine's FP8 GEMMs assert that the token dimension on
    each rank is a multiple of 16 (32 for MXFP8; megatron's `get_fp8_align_size`), and a rank holds
    N / (tp_sp * cp) tokens. The FP8 padding goes onto the last sequence only, so it costs at most
    16 * tp_sp * cp - 1 tokens per micro-batch, not per sequence.
    """
    tp_sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cp = config.context_parallel_size
    row = tp_sp * (2 * cp if cp > 1 else 1)
    if not config.fp8:
        return row, row
    from megatron.core.fp8_utils import get_fp8_align_size

    return row, math.lcm(row, get_fp8_align_size(config.fp8_recipe) * tp_sp * cp)


def build_micro_batches(
    batch: dict[str, Tensor],
    opts: RunOptions,
    *,
    dp_rank: int,
    dp_size: int,
    pad_multiple: int,
    device: torch.device,
    total_multiple: int = 1,
    parts: list[Tensor] | None = None,
) -> list[MicroBatch]:
    """This DP rank's micro-batches (whole sequences) in the model-input layout; `pad_multiple` and
    `total_multiple` as `pad_multiples` returns them. `parts` (local rows only): the micro-batches as
    row indices, instead of `opts.num_micro_batches` cut by `layout.split_micro_batches`."""
    B, T = _check_batch(batch)
    lens = _seq_lens(batch)
    if opts.local_rows:
        shard = torch.arange(B)
        if parts is None and opts.num_micro_batches > B:
            raise MegagrpoError(
                f"this rank's {B} rows cannot fill {opts.num_micro_batches} micro-batches; use fewer "
                "micro-batches (raise schedule.micro_batch_size) or a larger batch"
            )
    else:
        if parts is not None:
            raise ValueError("explicit micro-batch rows need RunOptions.local_rows")
        if dp_size * opts.num_micro_batches > B:
            raise MegagrpoError(
                f"global batch of {B} sequences cannot fill {dp_size} data-parallel ranks x "
                f"{opts.num_micro_batches} micro-batches; use fewer micro-batches or a larger batch"
            )
        shard = layout.shard_for_data_parallel(lens, dp_rank, dp_size, balance=opts.balance)
    if parts is None:
        parts = layout.split_micro_batches(lens[shard], opts.num_micro_batches, balance=opts.balance)
    elif sorted(torch.cat(parts).tolist()) != list(range(B)):
        raise ValueError(f"micro-batch rows must cover the {B} rows exactly once")
    out = []
    for k, part in enumerate(parts):
        samples = shard[part]
        # Every per-sample field goes to the model's device: the loss reads old_logp, advantages and
        # masks next to the logprobs, and the trainer assembles the batch on the host.
        data = {
            key: (v[samples.to(v.device)].to(device) if torch.is_tensor(v) and v.dim() > 0 else v)
            for key, v in batch.items()
        }
        mlens = lens[samples]
        ids = data["input_ids"].to(device)
        tgt = layout.next_token_targets(ids, mlens)
        if opts.packed:
            p = layout.pack(ids, mlens, pad_multiple=pad_multiple, total_multiple=total_multiple)
            p = layout.Packed(
                p.input_ids.to(device), p.position_ids.to(device), p.cu_seqlens.to(device),
                p.cu_seqlens_padded.to(device), p.seq_lens, p.max_seqlen,
            )  # fmt: skip
            inp, pos = p.input_ids.unsqueeze(0), p.position_ids.unsqueeze(0)
            targets = layout.pack_values(tgt, p).unsqueeze(0)
        else:
            p = None
            T_mb = layout.round_up(int(mlens.max()), math.lcm(pad_multiple, total_multiple))
            inp = layout.pad_to_length(ids, T_mb)
            pos = torch.arange(T_mb, device=device).unsqueeze(0).expand(inp.shape[0], T_mb)
            targets = layout.pad_to_length(tgt, T_mb)
        out.append(MicroBatch(k, samples, data, inp, pos, targets, mlens, p, T))
    return out


def _mask_padded_vocab(logits: Tensor, vocab_size: int, vocab_start: int) -> Tensor:
    """Exclude padded vocab rows (ids >= vocab_size) from the softmax; finite so 0 * logit stays 0."""
    v_local = logits.shape[-1]
    if vocab_start + v_local <= vocab_size:
        return logits
    ids = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, -1e30)


def token_outputs(logits: Tensor, mb: MicroBatch, opts: RunOptions) -> tuple[Tensor, Tensor | None]:
    """Model output of one micro-batch -> (logp, entropy), each `[b, T]` token-aligned (see module doc).

    logits: `[b, T_mb, V/tp]` (padded) or `[1, N, V/tp]` (packed), vocab-sharded over TP.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    vocab_start = tp_rank * logits.shape[-1]
    logits = _mask_padded_vocab(logits, opts.vocab_size, vocab_start)
    logp, ent = token_logprobs_and_entropy(
        logits,
        mb.targets,
        tp_group=tp_group if dist.get_world_size(tp_group) > 1 else None,
        vocab_start=vocab_start,
        chunk_tokens=opts.chunk_tokens,
        with_entropy=opts.with_entropy,
        temperature=opts.temperature,
    )
    if mb.packed is not None:
        T_mb = int(mb.seq_lens.max())
        logp = layout.unpack_values(logp[0], mb.packed, T_mb)
        ent = layout.unpack_values(ent[0], mb.packed, T_mb) if ent is not None else None
    logp = layout.pad_to_length(layout.shift_to_tokens(logp, mb.seq_lens), mb.T)
    if ent is not None:
        ent = layout.pad_to_length(layout.shift_to_tokens(ent, mb.seq_lens), mb.T)
    return logp, ent


def _forward_step(
    opts: RunOptions,
    loss_fn: LossFn | None,
    hooks: ForwardHooks | None,
    data_iterator: Iterator[MicroBatch],
    model: Any,
):
    mb = next(data_iterator)
    params = mb.packed.packed_seq_params() if mb.packed is not None else None
    if hooks is not None:
        hooks.before_forward(mb, model)
    output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=params)
    if hooks is not None:
        hooks.after_forward(mb, model)
    return output, functools.partial(_loss, opts, loss_fn, mb)


def _loss(opts: RunOptions, loss_fn: LossFn | None, mb: MicroBatch, output: Tensor):
    logp, ent = token_outputs(output, mb, opts)
    if loss_fn is None:  # forward only: collect results
        return output.new_zeros(()), {"index": mb.index, "logp": logp.detach(), "entropy": ent}
    loss, metrics = loss_fn(logp, ent, mb.data)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
    n_tokens = torch.tensor(int(mb.seq_lens.sum()), dtype=torch.int)
    metrics = {k: (v.detach() if torch.is_tensor(v) else torch.tensor(float(v))) for k, v in metrics.items()}
    return loss, n_tokens, {"index": mb.index, "metrics": metrics, "n_tokens": int(mb.seq_lens.sum())}


def run_schedule(
    model: list[Any],
    batch: dict[str, Tensor],
    opts: RunOptions,
    *,
    loss_fn: LossFn | None,
    forward_only: bool | None = None,
    force_all_reduce: bool = False,
    hooks: ForwardHooks | None = None,
    parts: list[Tensor] | None = None,
) -> tuple[list[MicroBatch], list[dict[str, Any]]]:
    """One pass of megatron's schedule over this rank's micro-batches (`parts`: see `build_micro_batches`).

    Returns (micro-batches, per-micro-batch records) -- the records exist on the last pipeline stage only.
    `forward_only` defaults to `loss_fn is None`; otherwise forward+backward (grads accumulate in the
    DDP buffers and are finalised; no optimizer step). `force_all_reduce` all-reduces the DP grads even
    under the distributed optimizer (full grads on every rank, for inspection).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megagrpo.learner.model import model_config

    config = model_config(model)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    device = next(model[0].parameters()).device
    row, total = pad_multiples(config)
    mbs = build_micro_batches(
        batch, opts, dp_rank=dp_rank, dp_size=dp_size, pad_multiple=row, total_multiple=total, device=device,
        parts=parts,
    )  # fmt: skip
    iters: Any = [iter(mbs) for _ in model] if len(model) > 1 else iter(mbs)
    seq_len = max(int(mb.input_ids.shape[1]) for mb in mbs)
    mbs_size = max(int(mb.input_ids.shape[0]) for mb in mbs)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if len(model) > 1 and len(mbs) < pp:
        raise MegagrpoError(
            f"the interleaved pipeline schedule needs at least pp={pp} micro-batches per rank, got {len(mbs)}; "
            "raise the number of micro-batches or drop virtual pipeline stages (mesh.vpp)"
        )
    if forward_only is None:
        forward_only = loss_fn is None
    if not forward_only and loss_fn is None:
        raise ValueError("a backward pass needs a loss_fn")
    fwd_bwd = get_forward_backward_func()
    for chunk in model:
        chunk.train(not forward_only)
    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    with ctx:
        records = fwd_bwd(
            forward_step_func=functools.partial(_forward_step, opts, loss_fn, hooks),
            data_iterator=iters,
            model=model,
            num_microbatches=len(mbs),
            seq_length=seq_len,
            micro_batch_size=mbs_size,
            forward_only=forward_only,
            force_all_reduce=force_all_reduce,
        )
    return mbs, list(records or [])


def _gather_rows(full: Tensor, local_rows: bool) -> Tensor:
    """Sum a `[B, ...]` tensor that each (DP rank, last PP stage) filled for its own rows only; with
    `local_rows` the rows are this DP rank's alone and only the pipeline stages are summed."""
    from megatron.core import parallel_state

    if not local_rows and parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(full, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(full, group=parallel_state.get_pipeline_model_parallel_group())
    return full


def forward_logprobs(
    model: list[Any],
    batch: dict[str, Tensor],
    opts: RunOptions,
    *,
    hooks: ForwardHooks | None = None,
    parts: list[Tensor] | None = None,
) -> dict[str, Tensor]:
    """Forward-only pass: `{"logprobs": [B, T], "entropy": [B, T]}` (fp32, original order, on every rank
    of the batch's DP rank, or of every DP rank for a global batch).

    Entropy is omitted when `opts.with_entropy` is False.
    """
    B, T = _check_batch(batch)
    mbs, records = run_schedule(model, batch, opts, loss_fn=None, hooks=hooks, parts=parts)
    device = next(model[0].parameters()).device
    logp = torch.zeros(B, T, dtype=torch.float32, device=device)
    ent = torch.zeros(B, T, dtype=torch.float32, device=device)
    for rec in records:
        rows = mbs[rec["index"]].samples.to(device)
        logp[rows] = rec["logp"].float()
        if rec["entropy"] is not None:
            ent[rows] = rec["entropy"].float()
    out = {"logprobs": _gather_rows(logp, opts.local_rows)}
    if opts.with_entropy:
        out["entropy"] = _gather_rows(ent, opts.local_rows)
    return out
