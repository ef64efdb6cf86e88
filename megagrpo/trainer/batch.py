"""Rollout groups -> the learner's padded batch (the `[B, T]` token-aligned layout of `learner.layout`).

Row i is completion i in group-major order (prompt i // G). Every per-token tensor is aligned to the
token it scores: column t holds the value for `input_ids[i, t]` given the tokens before it, so the
output tokens of a completion with a P-token prompt and O output tokens sit in columns P .. P+O-1.

Keys (B rows, T = longest prompt + output):
  input_ids     int64   [B, T]   prompt + output, right-padded with `pad_id`
  seq_lens      int64   [B]      P + O
  loss_mask     bool    [B, T]   the output tokens (cleared for filtered rows, see `overlong_filter`)
  sampler_logp  float32 [B, T]   the sampler's log p of each output token (0 elsewhere)
  advantages    float32 [B]      one advantage per row: its session's (an agent session that branched has
                                  a row per branch, `trainer.rows`: rows and sessions)
  rewards       float32 [B]      when given: each row's session's reward, the advantages' source
                                  (algo.kl.placement=reward sums them back per session, `trainer.rows.
                                  StepRows.session`, to recompute advantages after the KL penalty)
  routes        int32   [B, T, L, K]  MoE only: the sampler's route of each token as an input
                                  (-1 for padding and the last token, see rollout.completion)
  response_len  int64   [B]      O
  truncated     bool    [B]      finish_reason == "length"

A multi-turn trajectory is one row (`Trajectory.to_completion`): its output is every token after the
prompt, so O counts the environment's tokens between model turns too, and with any such row in the batch:
  model_mask    bool    [B, T]   the tokens the model generated (loss_mask before any filter clears it)
  versions      int64   [B, T]   the policy version of each model token, -1 elsewhere
loss_mask then covers model tokens only, and routes keep the rows' stored dtype (`route_dtype`, int8 for up
to 128 experts) when they all share it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagrpo.rollout.completion import NO_ROUTE, Completion
from megagrpo.rollout.episodes.trajectory import Trajectory


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
        dtypes = {c.routes.dtype for c in comps}
        routes = torch.full((B, T, L, K), NO_ROUTE, dtype=dtypes.pop() if len(dtypes) == 1 else torch.int32)
    multi_turn = any(c.output_mask is not None for c in comps)
    versions = torch.full((B, T), -1, dtype=torch.int64) if multi_turn else None
    for i, c in enumerate(comps):
        P, n_out = c.prompt_ids.numel(), c.output_ids.numel()
        input_ids[i, :P] = c.prompt_ids
        input_ids[i, P : P + n_out] = c.output_ids
        loss_mask[i, P : P + n_out] = c.model_mask
        sampler_logp[i, P : P + n_out] = c.logprobs
        if versions is not None and c.output_versions is not None:
            versions[i, P : P + n_out] = c.output_versions
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
    if multi_turn:
        batch["model_mask"] = loss_mask.clone()
        batch["versions"] = versions
    if rewards is not None:
        if rewards.numel() != B:
            raise ValueError(f"rewards has {rewards.numel()} entries for {B} completions")
        batch["rewards"] = rewards.reshape(B).to(torch.float32)
    return batch


def trajectory_batch(
    groups: list[list[Trajectory]],
    advantages: Tensor,
    *,
    pad_id: int,
    rewards: Tensor | None = None,
    truncated: Tensor | None = None,
) -> dict[str, Tensor]:
    """Trajectories -> the learner's padded batch: `trainer.batch.rollout_batch` of their one-row completions
    (`Trajectory.to_completion`; its module doc lists the multi-turn keys). `truncated` (`Episode.truncated`)
    marks rows as cut ("length"); by default a row is cut when its last turn stopped at its length."""
    flat = [t for g in groups for t in g]
    cut = [None] * len(flat) if truncated is None else ["length" if x else "stop" for x in truncated.tolist()]
    comps = [t.to_completion(finish_reason=c) for t, c in zip(flat, cut, strict=True)]
    return rollout_batch([comps], advantages, pad_id=pad_id, rewards=rewards)


def response_mask(batch: dict[str, Tensor]) -> Tensor:
    """bool `[B, T]`: the tokens each row's model generated, whatever `loss_mask` has since cleared (overlong
    filtering): the output columns seq_lens - response_len .. seq_lens - 1, or a multi-turn batch's
    `model_mask` (its outputs hold environment tokens too)."""
    if "model_mask" in batch:
        return batch["model_mask"]
    cols = torch.arange(batch["input_ids"].shape[1], device=batch["seq_lens"].device)
    end = batch["seq_lens"][:, None]
    return (cols >= end - batch["response_len"][:, None]) & (cols < end)


def turn_index(model_mask: torch.Tensor) -> torch.Tensor:
    """int64 `[b, T]`: the model turn (0, 1, ..) of each model token of a trajectory row, -1 elsewhere: a
    turn is a maximal run of model tokens (environment tokens always sit between two turns)."""
    starts = model_mask.clone()
    starts[:, 1:] &= ~model_mask[:, :-1]
    turn = starts.to(torch.int64).cumsum(1) - 1
    return torch.where(model_mask, turn, -1)


def select_rows(batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The sub-batch of `rows` (a mini-batch), every tensor sliced along dim 0."""
    return {k: v[rows] for k, v in batch.items()}


def sft_batch(
    examples: list[tuple[list[int], list[int]]],
    *,
    pad_id: int,
    completion_masks: list[list[bool]] | None = None,
) -> dict[str, Tensor]:
    """(prompt_ids, completion_ids) pairs -> input_ids/seq_lens/loss_mask over the completion tokens, or,
    with `completion_masks` (one per example, as long as its completion), over the completion tokens marked
    True: a multi-turn trace, whose completion holds environment tokens too."""
    B = len(examples)
    lens = [len(p) + len(c) for p, c in examples]
    T = max(lens)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (p, c) in enumerate(examples):
        input_ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.int64)
        if completion_masks is None:
            loss_mask[i, len(p) : len(p) + len(c)] = True
        elif len(completion_masks[i]) != len(c):
            raise ValueError(f"example {i}: a mask of {len(completion_masks[i])} for {len(c)} completion ids")
        else:
            loss_mask[i, len(p) : len(p) + len(c)] = torch.tensor(completion_masks[i], dtype=torch.bool)
    return {"input_ids": input_ids, "seq_lens": torch.tensor(lens, dtype=torch.int64), "loss_mask": loss_mask}
