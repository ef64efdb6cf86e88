"""One sampled completion and the decoding of SGLang's per-request output into it.

Routes (MoE). SGLang records, for every forward pass, the top-k experts each layer chose for each INPUT
token, and returns `meta_info["routed_experts"]`: base64 of int32 `[P + O - 1, layers, topk]` for a prompt of
P tokens and O generated tokens. Row t is the route of sequence token t (prompt tokens first, then output
tokens) at the forward pass where token t was the input. The last generated token is never fed back, so
it has no route: that is the engine's `tokens - 1` convention. Here it is made explicit:

* `routes`         int32 `[P + O, layers, topk]`: row t = route of sequence token t as an input; the final
                   row (the last output token) is filled with -1.
* `output_routes`  int32 `[O, layers, topk]` = `routes[P:]`: row j = route of output token j as an input
                   (it was computed one step AFTER token j was sampled); the last row is -1.

A learner that replays routes (R3) over the full sequence `prompt + output` uses `routes` directly: its
forward pass feeds the same P + O tokens, and the -1 row is the position whose prediction is never used.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

from megagrpo.errors import MegagrpoError

NO_ROUTE = -1


@dataclass
class Completion:
    """One completion of one prompt, or one multi-turn trajectory (`output_mask`). Tensors are on the CPU."""

    prompt_index: int  # index of the prompt in the request batch
    sample_index: int  # 0 .. G-1 within the prompt's group
    prompt_ids: torch.Tensor  # int64 [P]
    output_ids: torch.Tensor  # int64 [O]
    logprobs: torch.Tensor  # float32 [O]: sampler log p(output_ids[j]) at temperature T (greedy: T=1)
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens reached)
    text: str  # decoded output
    routes: torch.Tensor | None = None  # int [P + O, layers, topk]; last row NO_ROUTE (see module doc)
    # A multi-turn trajectory as one row (`Trajectory.to_completion`): the output is everything after the
    # prompt, the environment's tokens between model turns included, and these say which tokens are whose.
    output_mask: torch.Tensor | None = None  # bool [O]: True on tokens the model generated; None: all
    output_versions: torch.Tensor | None = None  # int64 [O]: policy version per model token, -1 elsewhere

    @property
    def model_mask(self) -> torch.Tensor:
        """bool `[O]`: the output tokens that take the loss (all of a single-turn completion's)."""
        if self.output_mask is not None:
            return self.output_mask
        return torch.ones(self.output_ids.numel(), dtype=torch.bool)

    @property
    def output_routes(self) -> torch.Tensor | None:
        """int32 `[O, layers, topk]`: the route of each output token as an input; last row NO_ROUTE."""
        if self.routes is None:
            return None
        return self.routes[self.prompt_ids.numel() :]

    @property
    def num_tokens(self) -> int:
        return self.prompt_ids.numel() + self.output_ids.numel()


def decode_routes(encoded: str, num_tokens: int, num_layers: int, topk: int) -> torch.Tensor:
    """SGLang's base64 int32 `[num_tokens - 1, layers, topk]` -> int32 `[num_tokens, layers, topk]`, last row -1."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    expect = (num_tokens - 1) * num_layers * topk
    if raw.size != expect:
        raise MegagrpoError(
            f"routed_experts holds {raw.size} values, expected (tokens-1)*layers*topk = "
            f"({num_tokens}-1)*{num_layers}*{topk} = {expect}; the engine's model config does not match "
            "the layers/topk given to the rollout (check the model directory)"
        )
    routes = torch.full((num_tokens, num_layers, topk), NO_ROUTE, dtype=torch.int32)
    routes[: num_tokens - 1] = torch.from_numpy(raw.copy()).view(num_tokens - 1, num_layers, topk)
    return routes


def finish_reason_of(meta_info: dict) -> str:
    """SGLang's finish_reason dict -> "stop" | "length" (an abort is an engine error, raised)."""
    fr = meta_info.get("finish_reason") or {}
    kind = fr.get("type")
    if kind == "length":
        return "length"
    if kind == "stop":
        return "stop"
    raise RuntimeError(f"SGLang request ended with finish_reason={fr!r}; see the engine log above")


def completion_from_output(
    out: dict,
    *,
    prompt_index: int,
    sample_index: int,
    prompt_ids: list[int],
    num_layers: int,
    topk: int,
) -> Completion:
    """Build a `Completion` from one entry of `sglang.Engine.async_generate`'s result list."""
    meta = out["meta_info"]
    output_ids = torch.tensor(out["output_ids"], dtype=torch.int64)
    lp = meta.get("output_token_logprobs")
    if lp is None or len(lp) != output_ids.numel():
        raise RuntimeError(
            f"SGLang returned {0 if lp is None else len(lp)} logprobs for {output_ids.numel()} output tokens"
        )
    logprobs = torch.tensor([float(x[0]) for x in lp], dtype=torch.float32)
    prompt = torch.tensor(prompt_ids, dtype=torch.int64)
    routes = None
    if meta.get("routed_experts") is not None:
        routes = decode_routes(meta["routed_experts"], prompt.numel() + output_ids.numel(), num_layers, topk)
    return Completion(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=prompt,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish_reason_of(meta),
        text=out.get("text", ""),
        routes=routes,
    )
