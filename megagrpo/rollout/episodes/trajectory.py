"""A multi-turn trajectory: token ids as the engine saw them, never re-tokenised, with per-token loss mask,
sampler logprobs, policy versions and routes.

A `Trajectory` is the prompt's ids, then segments in order. Each turn appends an environment segment (the
ids inserted since the engine last generated: the template's closing glue after the model's turn, tool
results, user turns, the next generation prompt; empty on the first turn) and a model segment (the ids the
engine generated, with their sampler logprobs and the policy version that generated each). Only model
tokens take the loss. A single-turn `Completion` is the one-segment case (`Trajectory.from_completion`).

Per-token views, all `[T]` (or `[T, L, K]`) for T = `len(ids)`, column t = the value for token t given the
tokens before it, the layout `trainer.batch.rollout_batch` writes per row:
  ids        int64  the prompt, then each segment's ids
  loss_mask  bool   True on model tokens
  logprobs   float32 the sampler's log p of each model token, 0 elsewhere
  versions   int64  the policy version that generated each model token, -1 elsewhere
  routes     int8/int16/int32 `[T, L, K]`: row t = the experts each MoE layer chose for token t as an input
             (module doc of `rollout.completion`); the last row is NO_ROUTE (that token is never an input).

Routes across turns (SGLang 0.5.23, `sglang/srt/state_capturer/base.py: BaseTopkCapturer.get_topk`). The
engine records, at every forward pass, each input token's top-k experts per layer into a host table keyed by
the token's KV-cache slot, and a request with `return_routed_experts=True, routed_experts_start_len=s`
returns (base64 of int32, `meta_info["routed_experts"]`) the rows of sequence positions `[s, seqlen - 1)`:
shape `[seqlen - 1 - s, layers, topk]`, the first row being the route of token s. `s` must lie in
`[0, len(input_ids)]` (else the request is aborted), and it is ONE int for a whole batched call, so each
trajectory sends its own request. A token whose KV came from the prefix cache keeps the slot, so the row of
the forward pass that computed that KV.

Each turn sends the whole sequence so far (`ids` + the new environment ids) and asks only for the rows not
yet held: `s = routed_experts_start_len` = the number of route rows held, which is 0 before the first turn and
`len(ids) - 1` after it: the last generated token of turn k is never fed back at turn k (SGLang commits KV for
`P + O - 1` tokens), so its route comes from turn k+1's prefill, first row of that turn's answer. Hence:
  * turn 1 returns `P + O_1 - 1` rows: the prompt's prefill and the decode-time routes of its tokens;
  * turn k > 1 returns `E_k + O_k` rows: the previous turn's last token and the inserted tokens (the prefill
    that first consumed them), then the decode-time routes of this turn's tokens but its last;
  * rows are appended, never rewritten (while the prefix stays cached; below): the rows returned at turn k
    are rows `[s_k, s_k + n_k)` of the final table, byte for byte.
Rows received per trajectory: exactly `T - 1` whatever the number of turns, while no prefix is recomputed (a
resend-every-turn design receives the sum over turns of the sequence length - 1). The table holds T rows: the
received ones plus the final NO_ROUTE row, filled here, so its size is `T x layers x topk x itemsize` of the
stored dtype; the received ones (read-backs of recomputed prefixes included) are counted in
`route_rows_received` and `route_bytes_received` (the same dtype, as stored).
Routes are stored in the narrowest signed integer type that holds every expert index and NO_ROUTE
(`route_dtype`); the wire format is int32.

When the engine recomputed the prefix (R3's limit). All of the above holds while the prefix stays in SGLang's
radix cache between turns. When it was evicted (memory pressure, `flush_cache`, and every weight update,
which flushes the cache), turn k's prefill computes positions `[c, s)` again, `c` = the request's
`meta_info["cached_tokens"]`, possibly with other routes (prefill vs decode kernels, another batch, other
weights); the KV that turn k's tokens attend to is that recompute's. A row is an input token's experts in
one forward pass, and the learner's single forward over the row can replay only one row per position, so
the rows held from the earlier computation and the recomputed ones cannot both be honoured. The table takes
the recomputed ones: row t is the route of the LATEST forward pass the engine ran over token t, which is the
computation whose KV every later token of the trajectory attended to (this turn's tokens and, while the
cache then holds, every later turn's). That is also SGLang's own rule inside one request (a slot's row is
overwritten by each pass that writes it, e.g. a retracted request's re-prefill). What it costs: the tokens
generated before the recompute (positions in `(c, s]`) are replayed with routes other than the ones their
decode used where the two computations routed differently; their mismatch is measured per token by
`mismatch/` and weighted by TIS/MIS like any other. Keeping the old rows instead would make every token
from the recompute on inexact, the final turn's included, and silently so: the next turns hit the cache
of the recompute, so nothing would mark them.

The request of turn k cannot ask for rows it does not know it needs (`cached_tokens` is known only after
it ran), so `EngineRequests.generate_turn` reads them back at once with one more request over the prefix
(`PREFIX_REREAD`), which hits the KV the turn just cached; `add_engine_output` replaces rows `[c, s)` with
them and counts the turn (`prefix_recomputed_turns`, `prefix_recomputed_rows`). A read-back that finds the
prefix evicted again returns rows of its own prefill, not of the turn's: they are kept (the next turn
attends to that KV when the cache holds) and the turn is counted as inexact (`prefix_inexact_turns`).
Limits that remain: an engine that does not report `cached_tokens` (a test's fake) is taken as a full
cache hit; a request that SGLang retracts under memory pressure and prefills again does not change its
`cached_tokens`; and the radix cache shares a prefix between requests with the same tokens, so a row can
be another trajectory's computation of the same tokens under the same weights.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.completion import NO_ROUTE, Completion, finish_reason_of

PREFIX_REREAD = "megagrpo_prefix_reread"
"""The key under which `EngineRequests.generate_turn` adds, to SGLang's result, the route rows of a prefix that
the turn recomputed: `{"start": c, "routed_experts": base64 int32 rows of positions [c, s + 1),
"cached_tokens": the read-back request's own cache hit}` (module doc)."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest of int8/int16/int32 that holds expert indices 0 .. num_experts - 1 and NO_ROUTE (-1)."""
    if num_experts < 1:
        raise MegagrpoError(f"num_experts={num_experts}: an MoE model has at least one expert")
    for dt in (torch.int8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dt).max:
            return dt
    raise MegagrpoError(f"num_experts={num_experts} does not fit an int32 route table")


def route_rows_from_b64(encoded: str, num_rows: int, num_layers: int, topk: int) -> Tensor:
    """SGLang's base64 int32 `meta_info["routed_experts"]` -> int32 `[num_rows, layers, topk]` (no -1 row added,
    unlike `completion.decode_routes`: a turn's rows are a slice of the trajectory's table)."""
    raw = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if raw.size != num_rows * num_layers * topk:
        raise MegagrpoError(
            f"routed_experts holds {raw.size} values, expected rows*layers*topk = {num_rows}*{num_layers}*{topk}; "
            "the engine's model config does not match the layers/topk given to the rollout (check the model "
            "directory), or the request's routed_experts_start_len was not the trajectory's"
        )
    return torch.from_numpy(raw.copy()).view(num_rows, num_layers, topk)


@dataclass
class ModelSegment:
    """The ids the engine generated in one turn. These take the loss."""

    ids: Tensor  # int64 [n]
    logprobs: Tensor  # float32 [n]: sampler log p(ids[j]) at the sampling temperature
    versions: Tensor  # int64 [n]: policy version that generated ids[j]
    finish_reason: str  # "stop" | "length"


@dataclass
class EnvSegment:
    """Ids inserted between two model turns: template glue, tool results, user turns. No loss."""

    ids: Tensor  # int64 [n]


Segment = ModelSegment | EnvSegment


@dataclass(frozen=True)
class PrefixRecompute:
    """At one turn, the engine computed positions `[start, start + len(rows))` of the held prefix again (its
    cache held only `start` of them): `rows` int `[n, L, K]` are that recompute's routes, which replace the
    held ones (module doc). `exact` is False when they were read back after a second eviction, so they are
    the read-back's own prefill, not the turn's."""

    start: int
    rows: Tensor
    exact: bool = True


def _ids(x: Sequence[int] | Tensor) -> Tensor:
    return torch.as_tensor(x, dtype=torch.int64).reshape(-1)


@dataclass
class Trajectory:
    """Prompt ids, then environment and model segments in order (module doc). Build with `add_turn`.

    `num_layers`, `topk` and `num_experts` describe the MoE layers whose routes the engine returns; leave
    `num_experts` None for a dense model (no routes)."""

    prompt_ids: Tensor  # int64 [P]
    num_layers: int = 0
    topk: int = 0
    num_experts: int | None = None
    prompt_index: int = 0
    sample_index: int = 0
    segments: list[Segment] = field(default_factory=list)
    route_blocks: list[Tensor] = field(default_factory=list)  # the table's rows so far, in order
    route_rows_received: int = 0  # rows received over all turns (T - 1, plus the rows of prefix read-backs)
    route_bytes_received: int = 0  # those rows in the stored dtype
    route_rows_if_resent: int = 0  # rows a design resending the whole prefix every turn would receive
    prefix_recomputed_turns: int = 0  # turns whose held prefix the engine recomputed (module doc)
    prefix_recomputed_rows: int = 0  # held rows those turns replaced
    prefix_inexact_turns: int = 0  # of them, turns whose recomputed rows could not be read back as used

    def __post_init__(self) -> None:
        self.prompt_ids = _ids(self.prompt_ids)
        if self.prompt_ids.numel() == 0:
            raise MegagrpoError("a trajectory's prompt is empty; every prompt needs at least one token")
        if self.num_experts is not None:
            route_dtype(self.num_experts)  # validates

    @property
    def route_dtype(self) -> torch.dtype | None:
        """The stored routes' dtype (`route_dtype(num_experts)`); None for a dense model."""
        return None if self.num_experts is None else route_dtype(self.num_experts)

    # ---------------------------------------------------------------- building

    def snapshot(self) -> Trajectory:
        """A copy that later turns do not change (segments and route blocks are appended or replaced,
        never written in place), to take a turn back (`rollout.agents.session`)."""
        return dataclasses.replace(self, segments=list(self.segments), route_blocks=list(self.route_blocks))

    @property
    def num_tokens(self) -> int:
        return self.prompt_ids.numel() + sum(s.ids.numel() for s in self.segments)

    @property
    def routed_experts_start_len(self) -> int:
        """The `routed_experts_start_len` of the next turn's request: the route rows already held."""
        return self.num_tokens - 1 if self.segments else 0

    def next_input_ids(self, new_env_ids: Sequence[int] | Tensor = ()) -> list[int]:
        """The next turn's request ids: everything so far, then the ids to insert."""
        return [*self.ids.tolist(), *_ids(new_env_ids).tolist()]

    def add_turn(
        self,
        new_env_ids: Sequence[int] | Tensor,
        generated_ids: Sequence[int] | Tensor,
        logprobs: Sequence[float] | Tensor,
        version: int | Sequence[int] | Tensor,
        routes_rows: Tensor | None = None,
        finish_reason: str = "stop",
        recomputed: PrefixRecompute | None = None,
    ) -> None:
        """Append one turn: the ids inserted before it (empty on the first turn), then the generated ids.

        `routes_rows` int `[n, L, K]` are the rows the engine returned for a request of `next_input_ids(
        new_env_ids)` with `routed_experts_start_len` read BEFORE this call: n = tokens after the turn - 1 -
        that start. They are appended as they are. Earlier rows are touched only by `recomputed`: the rows
        of the held prefix that the engine computed again at this turn, ending at that start, which replace
        the held ones (module doc). `version` is the policy version that generated the turn (an int), or
        one per generated token."""
        env, gen = _ids(new_env_ids), _ids(generated_ids)
        if gen.numel() == 0:
            raise ValueError("a model turn has at least one generated token")
        if not self.segments and env.numel():
            raise ValueError("the first turn inserts nothing: put those ids in the prompt")
        lp = torch.as_tensor(logprobs, dtype=torch.float32).reshape(-1)
        if lp.numel() != gen.numel():
            raise ValueError(f"{lp.numel()} logprobs for {gen.numel()} generated tokens")
        versions = torch.as_tensor(version, dtype=torch.int64).reshape(-1)
        if versions.numel() not in (1, gen.numel()):
            raise ValueError(f"{versions.numel()} versions for {gen.numel()} generated tokens")
        versions = versions.expand(gen.numel()).clone()
        if finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason={finish_reason!r} is not 'stop' or 'length'")
        start = self.routed_experts_start_len
        tokens_after = self.num_tokens + env.numel() + gen.numel()
        block = self._check_rows(routes_rows, tokens_after - 1 - start)
        redo = None
        if recomputed is not None:
            if block is None:
                raise ValueError("recomputed prefix rows given for a trajectory without routes")
            if not 0 <= recomputed.start < start:
                raise ValueError(
                    f"a recomputed prefix starts at {recomputed.start}; it must lie in [0, {start}) (the rows held)"
                )
            redo = self._check_rows(recomputed.rows, start - recomputed.start)
        if env.numel():
            self.segments.append(EnvSegment(env))
        self.segments.append(ModelSegment(gen, lp, versions, finish_reason))
        if block is None:
            return
        if redo is not None:
            table = torch.cat(self.route_blocks)
            table[recomputed.start :] = redo
            self.route_blocks = [table]
            self._count_received(redo)
            self.prefix_recomputed_turns += 1
            self.prefix_recomputed_rows += redo.shape[0]
            self.prefix_inexact_turns += not recomputed.exact
        self.route_blocks.append(block)
        self._count_received(block)
        self.route_rows_if_resent += tokens_after - 1

    def _count_received(self, rows: Tensor) -> None:
        self.route_rows_received += int(rows.shape[0])
        self.route_bytes_received += rows.numel() * rows.element_size()

    def add_engine_output(self, out: dict, new_env_ids: Sequence[int] | Tensor = (), *, version: int) -> None:
        """`add_turn` from one result of `sglang.Engine.async_generate` (input_ids = `next_input_ids(
        new_env_ids)`, `return_logprob=True`, and with routes `routed_experts_start_len` as above), as
        `EngineRequests.generate_turn` returns it: when `meta_info["cached_tokens"]` says the engine recomputed
        part of the held prefix, the rows it read back (`PREFIX_REREAD`) replace the held ones."""
        meta = out["meta_info"]
        gen = out["output_ids"]
        lp = meta.get("output_token_logprobs")
        if lp is None or len(lp) != len(gen):
            raise RuntimeError(
                f"SGLang returned {0 if lp is None else len(lp)} logprobs for {len(gen)} output tokens"
            )
        rows = None
        if self.route_dtype is not None:
            if meta.get("routed_experts") is None:
                raise RuntimeError("the request returned no routed_experts; send return_routed_experts=True")
            n = self.num_tokens + len(_ids(new_env_ids)) + len(gen) - 1 - self.routed_experts_start_len
            rows = route_rows_from_b64(meta["routed_experts"], n, self.num_layers, self.topk)
        lps = [float(x[0]) for x in lp]
        redo = self._recomputed_prefix(out)
        self.add_turn(new_env_ids, gen, lps, version, rows, finish_reason_of(meta), redo)

    def _recomputed_prefix(self, out: dict) -> PrefixRecompute | None:
        """The rows of the held prefix that this turn's engine pass computed again, when it did (module doc)."""
        held, cached = self.routed_experts_start_len, out["meta_info"].get("cached_tokens")
        if self.route_dtype is None or cached is None or int(cached) >= held:
            return None
        got = out.get(PREFIX_REREAD)
        if got is None or int(got["start"]) != int(cached):
            raise RuntimeError(
                f"the engine recomputed positions [{int(cached)}, {held}) of the trajectory's prefix (its cache "
                f"held {int(cached)} tokens) and the result carries no read-back of their routes from "
                f"{int(cached)}; EngineRequests.generate_turn adds them under {PREFIX_REREAD!r}"
            )
        n = held + 1 - int(cached)  # the read-back's rows run to the prefix's next token, which it recomputes
        rows = route_rows_from_b64(got["routed_experts"], n, self.num_layers, self.topk)[: n - 1]
        return PrefixRecompute(int(cached), rows, exact=int(got["cached_tokens"]) >= held)

    def _check_rows(self, rows: Tensor | None, expect: int) -> Tensor | None:
        if self.route_dtype is None:
            if rows is not None:
                raise ValueError("routes given for a trajectory built without num_experts (a dense model)")
            return None
        if rows is None:
            raise ValueError("an MoE trajectory needs the routes of every turn")
        if tuple(rows.shape) != (expect, self.num_layers, self.topk):
            raise MegagrpoError(
                f"the engine returned routes of shape {tuple(rows.shape)}, expected "
                f"({expect}, {self.num_layers}, {self.topk}) = (new rows, layers, topk); check that the request "
                f"used routed_experts_start_len={self.routed_experts_start_len} and that the rollout's "
                "layers/topk match the served model"
            )
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.num_experts):
            raise MegagrpoError(
                f"the engine returned expert indices in [{int(rows.min())}, {int(rows.max())}]; the model has "
                f"{self.num_experts} experts (num_experts does not match the served model)"
            )
        return rows.to(self.route_dtype)

    @classmethod
    def from_completion(
        cls, c: Completion, *, num_experts: int | None = None, version: int = 0
    ) -> Trajectory:
        """The one-segment trajectory of a single-turn completion; its ids, routes and logprobs are the
        completion's (`routes` narrowed to `route_dtype(num_experts)`, same values)."""
        L, K = (0, 0) if c.routes is None else (int(c.routes.shape[1]), int(c.routes.shape[2]))
        if (c.routes is None) != (num_experts is None):
            raise ValueError("pass num_experts exactly when the completion has routes")
        t = cls(c.prompt_ids, L, K, num_experts, c.prompt_index, c.sample_index)
        rows = None if c.routes is None else c.routes[: c.num_tokens - 1]
        t.add_turn((), c.output_ids, c.logprobs, version, rows, c.finish_reason)
        return t

    def to_completion(self, text: str = "", finish_reason: str | None = None) -> Completion:
        """The trajectory as one learner row: output = every token after the prompt, `output_mask` its model
        tokens, `output_versions` their policy versions, `logprobs` 0 on environment tokens, routes in the
        stored dtype. `finish_reason` defaults to the last turn's ("length" marks a truncated trajectory)."""
        P = self.prompt_ids.numel()
        return Completion(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_ids=self.prompt_ids,
            output_ids=self.ids[P:],
            logprobs=self.logprobs[P:],
            finish_reason=finish_reason or self.finish_reason,
            text=text,
            routes=self.routes,
            output_mask=self.loss_mask[P:],
            output_versions=self.versions[P:],
        )

    # ---------------------------------------------------------------- per-token views

    @property
    def model_segments(self) -> list[ModelSegment]:
        return [s for s in self.segments if isinstance(s, ModelSegment)]

    @property
    def turns(self) -> int:
        return len(self.model_segments)

    @property
    def num_model_tokens(self) -> int:
        return sum(s.ids.numel() for s in self.model_segments)

    @property
    def finish_reason(self) -> str:
        """The last turn's finish reason ("length": the trajectory was cut by the token limit)."""
        return self.model_segments[-1].finish_reason

    @property
    def ids(self) -> Tensor:
        """int64 `[T]`: every token, in order."""
        return torch.cat([self.prompt_ids, *(s.ids for s in self.segments)])

    def _per_token(self, prompt_value, model_values, dtype: torch.dtype) -> Tensor:
        parts = [torch.full((self.prompt_ids.numel(),), prompt_value, dtype=dtype)]
        for s in self.segments:
            if isinstance(s, ModelSegment):
                parts.append(model_values(s).to(dtype))
            else:
                parts.append(torch.full((s.ids.numel(),), prompt_value, dtype=dtype))
        return torch.cat(parts)

    @property
    def loss_mask(self) -> Tensor:
        """bool `[T]`: True on model tokens."""
        return self._per_token(False, lambda s: torch.ones(s.ids.numel(), dtype=torch.bool), torch.bool)

    @property
    def logprobs(self) -> Tensor:
        """float32 `[T]`: the sampler's logprob of each model token, 0 elsewhere."""
        return self._per_token(0.0, lambda s: s.logprobs, torch.float32)

    @property
    def versions(self) -> Tensor:
        """int64 `[T]`: the policy version that generated each model token, -1 elsewhere."""
        return self._per_token(-1, lambda s: s.versions, torch.int64)

    @property
    def routes(self) -> Tensor | None:
        """`route_dtype` `[T, L, K]`: row t = the route the engine used for token t; the last row NO_ROUTE."""
        if self.route_dtype is None:
            return None
        last = torch.full((1, self.num_layers, self.topk), NO_ROUTE, dtype=self.route_dtype)
        return torch.cat([*self.route_blocks, last])
