"""Rollout groups -> the learner's padded batch (the `[B, T]` token-aligned layout of `learner.layout`).

Row i is completion i in group-major order (prompt i // G). Every per-token tensor is aligned to the
token it scores: column t holds the value for `input_ids[i, t]` given the tokens before it, so the
output tokens of a completion with a P-token prompt and O output tokens sit in columns P .. P+O-1.

Keys (B rows, T = longest prompt + output):
  input_ids     int64   [B, T]   prompt + output, right-padded with `pad_id`
  seq_lens      int64   [B]      P + O
  loss_mask     bool    [B, T]   the output tokens (cleared for filtered rows, see `overlong_filter`)
  sampler_logp  float32 [B, T]   the sampler's log p of each output token (0 elsewhere)
  advantages    float32 [B]      one advantage per completion
  rewards       float32 [B]      when given: the sequence rewards the advantages came from (rows of one
                                  prompt group are G consecutive rows; algo.kl.placement=reward reshapes
                                  them to [B / G, G] to recompute advantages after the KL penalty)
  routes        int32   [B, T, L, K]  MoE only: the sampler's route of each token as an input
                                  (-1 for padding and the last token, see rollout.completion)
  response_len  int64   [B]      O
  truncated     bool    [B]      finish_reason == "length"
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagrpo.rollout.completion import NO_ROUTE, Completion


def rollout_batch(
    groups: list[list[Completion]], advantages: Tensor, *, pad_id: int, rewards: Tensor | None = None
) -> dict[str, Tensor]:
    comps = [c for g in groups for c in g]
    B = len(comps)
    if advantages.numel() != B:
        raise ValueError(f"advantages has {advantages.numel()} entries for {B} completions")
    lens = [c.num_tokens for c in comps]
    T = max(lens)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    sampler_logp = torch.zeros(B, T, dtype=torch.float32)
    with_routes = all(c.routes is not None for c in comps)
    routes = None
    if with_routes:
        L, K = comps[0].routes.shape[1:]
        routes = torch.full((B, T, L, K), NO_ROUTE, dtype=torch.int32)
    for i, c in enumerate(comps):
        P, n_out = c.prompt_ids.numel(), c.output_ids.numel()
        input_ids[i, :P] = c.prompt_ids
        input_ids[i, P : P + n_out] = c.output_ids
        loss_mask[i, P : P + n_out] = True
        sampler_logp[i, P : P + n_out] = c.logprobs
        if routes is not None:
            routes[i, : P + n_out] = c.routes
    batch = {
        "input_ids": input_ids,
        "seq_lens": torch.tensor(lens, dtype=torch.int64),
        "loss_mask": loss_mask,
        "sampler_logp": sampler_logp,
        "advantages": advantages.reshape(B).to(torch.float32),
        "response_len": torch.tensor([c.output_ids.numel() for c in comps], dtype=torch.int64),
        "truncated": torch.tensor([c.finish_reason == "length" for c in comps], dtype=torch.bool),
    }
    if routes is not None:
        batch["routes"] = routes
    if rewards is not None:
        if rewards.numel() != B:
            raise ValueError(f"rewards has {rewards.numel()} entries for {B} completions")
        batch["rewards"] = rewards.reshape(B).to(torch.float32)
    return batch


def response_mask(batch: dict[str, Tensor]) -> Tensor:
    """bool `[B, T]`: the output tokens of each row (columns seq_lens - response_len .. seq_lens - 1),
    whatever `loss_mask` has since cleared (overlong filtering)."""
    cols = torch.arange(batch["input_ids"].shape[1], device=batch["seq_lens"].device)
    end = batch["seq_lens"][:, None]
    return (cols >= end - batch["response_len"][:, None]) & (cols < end)


def select_rows(batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The sub-batch of `rows` (a mini-batch), every tensor sliced along dim 0."""
    return {k: v[rows] for k, v in batch.items()}


def sft_batch(examples: list[tuple[list[int], list[int]]], *, pad_id: int) -> dict[str, Tensor]:
    """(prompt_ids, completion_ids) pairs -> input_ids/seq_lens/loss_mask over the completion tokens."""
    B = len(examples)
    lens = [len(p) + len(c) for p, c in examples]
    T = max(lens)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (p, c) in enumerate(examples):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.int64)
        loss_mask[i, len(p) : len(p) + len(c)] = True
    return {"input_ids": input_ids, "seq_lens": torch.tensor(lens, dtype=torch.int64), "loss_mask": loss_mask}
