"""Trajectory: per-token views, route dtype narrowing, single-turn equivalence with Completion, and routes
turn by turn against a fake engine that keeps SGLang's `routed_experts_start_len` contract."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.completion import NO_ROUTE, completion_from_output
from megagrpo.rollout.trajectory import Trajectory, route_dtype

L, K, E = 3, 2, 8


def _b64(a) -> str:
    return base64.b64encode(np.asarray(a, dtype=np.int32).tobytes()).decode()


class FakeEngine:
    """One sequence's engine side, as SGLang 0.5.23 does it: a route table keyed by position, written by the
    forward pass that computes a token as an input, and `routes[start_len : seqlen - 1]` returned.

    With `evict=True` the prefix cache is dropped between requests, so each request's prefill computes every
    earlier token again, under that turn's weights/batch: a different route than the one that generated it
    (the case where re-reading the prefix's routes is wrong). `first` keeps each position's first route."""

    def __init__(self, evict: bool) -> None:
        self.evict = evict
        self.table: dict[int, np.ndarray] = {}
        self.first: dict[int, np.ndarray] = {}
        self.calls = 0
        self.rng = np.random.default_rng(0)

    def generate(self, input_ids: list[int], start_len: int, n_new: int):
        assert 0 <= start_len <= len(input_ids), "SGLang aborts this request"
        self.calls += 1
        if self.evict:
            self.table.clear()
        gen = [int(x) for x in self.rng.integers(10, 100, n_new)]
        seqlen = len(input_ids) + n_new
        for pos in range(seqlen - 1):  # every token but the last is an input of some forward pass
            if pos not in self.table:
                self.table[pos] = self.rng.integers(0, E, (L, K))
                self.first.setdefault(pos, self.table[pos])
        rows = np.stack([self.table[p] for p in range(start_len, seqlen - 1)])
        logprobs = (-self.rng.random(n_new)).astype(np.float32)
        return gen, logprobs, torch.from_numpy(rows).int()


def _run(turns: int, *, evict: bool = True, env_len: int = 4, gen_len: int = 5):
    eng = FakeEngine(evict)
    t = Trajectory(list(range(1, 8)), num_layers=L, topk=K, num_experts=E)
    returned = []
    for k in range(turns):
        env = [] if k == 0 else [200 + k] * env_len
        start = t.routed_experts_start_len
        gen, lp, rows = eng.generate(t.next_input_ids(env), start, gen_len)
        t.add_turn(env, gen, lp, version=k // 2, routes_rows=rows, finish_reason="stop")
        returned.append((start, rows))
    return t, eng, returned


@pytest.mark.parametrize(
    "experts,dtype",
    [(1, torch.int8), (8, torch.int8), (128, torch.int8), (129, torch.int16), (200, torch.int16),
     (256, torch.int16), (32768, torch.int16), (32769, torch.int32)],
)  # fmt: skip
def test_route_dtype_is_the_narrowest_that_holds_every_expert_and_no_route(experts, dtype):
    assert route_dtype(experts) == dtype
    info = torch.iinfo(dtype)
    assert info.min <= NO_ROUTE and experts - 1 <= info.max


def test_route_dtype_rejects_no_experts():
    with pytest.raises(MegagrpoError, match="num_experts=0"):
        route_dtype(0)


@pytest.mark.parametrize("turns", [1, 2, 3, 5])
def test_routes_across_turns_are_the_first_computed_rows_and_the_payload_is_linear(turns):
    t, eng, returned = _run(turns)
    T = t.num_tokens
    routes = t.routes
    assert routes.dtype == torch.int8 and routes.shape == (T, L, K)
    # each token's row is the route of the forward pass that first consumed it (decode-time for model
    # tokens, the inserting turn's prefill for environment tokens), though the engine recomputed the prefix
    want = torch.from_numpy(np.stack([eng.first[p] for p in range(T - 1)])).to(torch.int8)
    assert torch.equal(routes[:-1], want) and bool((routes[-1] == NO_ROUTE).all())
    # the rows returned at turn k are rows [start_k, start_k + n_k) of the final table, untouched
    for start, rows in returned:
        assert torch.equal(routes[start : start + rows.shape[0]], rows.to(torch.int8))
    assert returned[0][0] == 0 and returned[0][1].shape[0] == 7 + 5 - 1
    # payload: T - 1 rows received whatever the turns; the table adds the final NO_ROUTE row
    assert t.route_rows_received == T - 1
    assert t.route_bytes_received == (T - 1) * L * K * 1
    assert routes.numel() * routes.element_size() == T * L * K * 1
    resent = sum(start + rows.shape[0] for start, rows in returned)  # rows = seqlen_k - 1 each turn
    assert t.route_rows_if_resent == resent
    assert t.turns == turns == eng.calls


def test_without_eviction_the_engine_table_and_the_trajectory_agree():
    t, eng, _ = _run(3, evict=False)
    want = torch.from_numpy(np.stack([eng.table[p] for p in range(t.num_tokens - 1)])).to(torch.int8)
    assert torch.equal(t.routes[:-1], want)


def test_loss_mask_logprobs_and_versions_per_token():
    t = Trajectory([1, 2, 3])
    t.add_turn([], [10, 11], [-0.5, -0.25], version=3)
    t.add_turn([20, 21, 22], [12], [-1.0], version=4, finish_reason="length")
    t.add_turn([23], [13, 14, 15], [-0.1, -0.2, -0.3], version=[4, 4, 5])
    assert t.ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 22, 12, 23, 13, 14, 15]
    assert t.loss_mask.tolist() == [False] * 3 + [True] * 2 + [False] * 3 + [True] + [False] + [True] * 3
    want = torch.tensor([0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0, 0, -0.1, -0.2, -0.3], dtype=torch.float32)
    assert torch.equal(t.logprobs, want)
    assert t.logprobs.dtype == torch.float32
    assert t.versions.tolist() == [-1, -1, -1, 3, 3, -1, -1, -1, 4, -1, 4, 4, 5]
    assert (t.turns, t.num_model_tokens, t.finish_reason) == (3, 6, "stop")
    assert t.routes is None and t.route_bytes_received == 0
    assert t.model_segments[1].finish_reason == "length"


def test_single_turn_trajectory_equals_its_completion():
    P, n_out = 4, 3
    rows = np.random.default_rng(1).integers(0, E, (P + n_out - 1, L, K))
    out = {
        "output_ids": [40, 41, 42],
        "text": "",
        "meta_info": {
            "output_token_logprobs": [(-0.5, 40, None), (-1.5, 41, None), (-0.125, 42, None)],
            "finish_reason": {"type": "stop"},
            "routed_experts": _b64(rows),
        },
    }
    c = completion_from_output(
        out, prompt_index=2, sample_index=1, prompt_ids=[5, 6, 7, 8], num_layers=L, topk=K
    )
    t = Trajectory.from_completion(c, num_experts=E, version=7)
    assert torch.equal(t.ids, torch.cat([c.prompt_ids, c.output_ids]))
    assert t.routes.dtype == torch.int8 and torch.equal(t.routes.to(torch.int32), c.routes)
    assert torch.equal(t.logprobs[P:], c.logprobs) and not t.logprobs[:P].any()
    assert t.loss_mask.tolist() == [False] * P + [True] * n_out
    assert t.versions.tolist() == [-1] * P + [7] * n_out
    assert (t.prompt_index, t.sample_index, t.turns, t.num_model_tokens) == (2, 1, 1, n_out)
    assert t.finish_reason == c.finish_reason and t.num_tokens == c.num_tokens
    dense = Trajectory.from_completion(completion_from_output(
        {**out, "meta_info": {**out["meta_info"], "routed_experts": None}},
        prompt_index=0, sample_index=0, prompt_ids=[5, 6, 7, 8], num_layers=L, topk=K,
    ))  # fmt: skip
    assert dense.routes is None and torch.equal(dense.ids, t.ids)


def test_add_engine_output_decodes_only_the_new_rows():
    t = Trajectory([1, 2, 3], num_layers=L, topk=K, num_experts=E)
    r1 = np.full((3 + 2 - 1, L, K), 1)
    meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.5, 0, None)] * 2}
    t.add_engine_output({"output_ids": [9, 9], "meta_info": {**meta, "routed_experts": _b64(r1)}}, version=0)
    assert t.routed_experts_start_len == 4
    r2 = np.full(
        (1 + 1 + 1, L, K), 2
    )  # the previous last token, 1 inserted token, 2 generated (last: no row)
    t.add_engine_output(
        {"output_ids": [8, 8], "meta_info": {**meta, "routed_experts": _b64(r2)}}, [7], version=1
    )
    assert t.routes[:, 0, 0].tolist() == [1] * 4 + [2] * 3 + [NO_ROUTE]
    with pytest.raises(MegagrpoError, match="routed_experts_start_len"):
        bad = np.full((8, L, K), 2)  # the whole prefix again: the request ignored the start
        t.add_engine_output({"output_ids": [8], "meta_info": {**meta, "output_token_logprobs": [(-1.0, 0, None)],
                                                              "routed_experts": _b64(bad)}}, [7], version=1)  # fmt: skip
    assert t.turns == 2  # a rejected turn appends nothing


def test_rows_that_do_not_fit_the_model_are_refused():
    t = Trajectory([1, 2], num_layers=L, topk=K, num_experts=E)
    with pytest.raises(MegagrpoError, match="8 experts"):
        t.add_turn([], [3, 4], [0.0, 0.0], 0, torch.full((3, L, K), E))
    with pytest.raises(MegagrpoError, match=r"\(3, 3, 2\)"):
        t.add_turn([], [3, 4], [0.0, 0.0], 0, torch.zeros(3, L, K + 1))
    assert t.turns == 0
