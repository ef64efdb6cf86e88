"""Trajectory: per-token views, route dtype narrowing, single-turn equivalence with Completion, and routes
turn by turn against a fake engine that keeps SGLang's `routed_experts_start_len` contract."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.completion import NO_ROUTE, completion_from_output
from megagrpo.rollout.episodes.trajectory import PrefixRecompute, Trajectory, route_dtype

L, K, E = 3, 2, 8


def _b64(a) -> str:
    return base64.b64encode(np.asarray(a, dtype=np.int32).tobytes()).decode()


class FakeEngine:
    """One sequence's engine side, as SGLang 0.5.23 does it: a route table keyed by position, written by the
    forward pass that computes a token as an input, and `routes[start_len : seqlen - 1]` returned.

    With `evict=True` the prefix cache is dropped between requests, so each request's prefill computes every
    earlier token again, under that turn's weights/batch: a different route than the one that generated it.
    The engine then reports what it recomputed (`PrefixRecompute` of the held positions), as
    `RolloutEngine.generate_turn` reads it back. `first` keeps each position's first route."""

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
        redo = None
        if self.evict and start_len > 0:  # the whole held prefix was computed again
            redo = PrefixRecompute(
                0, torch.from_numpy(np.stack([self.table[p] for p in range(start_len)])).int()
            )
        return gen, logprobs, torch.from_numpy(rows).int(), redo


def _run(turns: int, *, evict: bool = True, env_len: int = 4, gen_len: int = 5):
    eng = FakeEngine(evict)
    t = Trajectory(list(range(1, 8)), num_layers=L, topk=K, num_experts=E)
    returned = []
    for k in range(turns):
        env = [] if k == 0 else [200 + k] * env_len
        start = t.routed_experts_start_len
        gen, lp, rows, redo = eng.generate(t.next_input_ids(env), start, gen_len)
        t.add_turn(env, gen, lp, version=k // 2, routes_rows=rows, finish_reason="stop", recomputed=redo)
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
def test_routes_across_turns_are_the_latest_computed_rows_and_the_payload_is_linear(turns):
    t, eng, returned = _run(turns)
    T = t.num_tokens
    routes = t.routes
    assert routes.dtype == torch.int8 and routes.shape == (T, L, K)
    # the engine recomputed the whole prefix at every turn after the first: each token's row is the route
    # of the LAST forward pass over it, whose KV the last turn's tokens attended to (not the first pass's)
    want = torch.from_numpy(np.stack([eng.table[p] for p in range(T - 1)])).to(torch.int8)
    assert torch.equal(routes[:-1], want) and bool((routes[-1] == NO_ROUTE).all())
    first = torch.from_numpy(np.stack([eng.first[p] for p in range(T - 1)])).to(torch.int8)
    assert turns == 1 or not torch.equal(routes[:-1], first)  # the case is not vacuous
    # the rows returned at turn k are rows [start_k, start_k + n_k) of the final table at the last turn only
    start, rows = returned[-1]
    assert torch.equal(routes[start : start + rows.shape[0]], rows.to(torch.int8))
    assert returned[0][0] == 0 and returned[0][1].shape[0] == 7 + 5 - 1
    # counted: every later turn replaced all the rows it held
    held = sum(s for s, _ in returned[1:])
    assert (t.prefix_recomputed_turns, t.prefix_recomputed_rows, t.prefix_inexact_turns) == (
        turns - 1,
        held,
        0,
    )
    # payload: T - 1 new rows whatever the turns, plus the recomputed rows read back
    assert t.route_rows_received == T - 1 + held
    assert t.route_bytes_received == (T - 1 + held) * L * K * 1
    assert routes.numel() * routes.element_size() == T * L * K * 1
    resent = sum(start + rows.shape[0] for start, rows in returned)  # rows = seqlen_k - 1 each turn
    assert t.route_rows_if_resent == resent
    assert t.turns == turns == eng.calls


def test_without_eviction_the_engine_table_and_the_trajectory_agree():
    t, eng, returned = _run(3, evict=False)
    want = torch.from_numpy(np.stack([eng.table[p] for p in range(t.num_tokens - 1)])).to(torch.int8)
    assert torch.equal(t.routes[:-1], want)
    for start, rows in returned:  # rows are appended, never rewritten
        assert torch.equal(t.routes[start : start + rows.shape[0]], rows.to(torch.int8))
    assert (t.prefix_recomputed_turns, t.prefix_recomputed_rows, t.route_rows_received) == (
        0,
        0,
        t.num_tokens - 1,
    )


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


class SlotSGLang:
    """SGLang 0.5.23's side of a request, with its radix cache (page size 1): a request reuses the KV slots of
    its longest cached prefix (at most all its tokens but the last: `cached_tokens`), computes new slots for
    the rest (prefill, then one per decode step), writes each computed slot's route (a fresh draw: another
    pass routes differently) and returns the rows of `[routed_experts_start_len, seqlen - 1)` by slot; a
    finished request's tokens but the last enter the cache. `flush_before` lists the request numbers
    before which the cache is dropped. `used[i]` = the rows of every input position of request i: the
    routes that produced its tokens."""

    def __init__(self, flush_before=()) -> None:
        self.tree: dict[tuple[int, ...], int] = {}  # a prefix's last token -> its KV slot
        self.host: dict[int, np.ndarray] = {}  # slot -> the route of the pass that computed it
        self.flush_before, self.rng = set(flush_before), np.random.default_rng(3)
        self.requests: list[dict] = []
        self.used: list[np.ndarray] = []

    def _compute(self) -> int:
        slot = len(self.host)
        self.host[slot] = self.rng.integers(0, E, (L, K))
        return slot

    def request(self, *, input_ids, sampling_params, return_routed_experts, routed_experts_start_len, **_):
        if len(self.requests) in self.flush_before:
            self.tree.clear()
        self.requests.append(
            dict(ids=list(input_ids), start=routed_experts_start_len, params=sampling_params)
        )
        ids = list(input_ids)
        cached = 0
        while cached < len(ids) - 1 and tuple(ids[: cached + 1]) in self.tree:
            cached += 1
        slots = [self.tree[tuple(ids[: p + 1])] for p in range(cached)]
        slots += [self._compute() for _ in range(cached, len(ids))]  # prefill
        n = sampling_params["max_new_tokens"]
        gen = [int(x) for x in self.rng.integers(10, 100, n)]
        slots += [self._compute() for _ in range(n - 1)]  # each decode step consumes the previous token
        seq = ids + gen
        for p, slot in enumerate(slots):
            self.tree.setdefault(tuple(seq[: p + 1]), slot)
        self.used.append(np.stack([self.host[s] for s in slots]))
        rows = self.used[-1][routed_experts_start_len:] if return_routed_experts else None
        return {
            "output_ids": gen,
            "meta_info": {
                "output_token_logprobs": [(-0.5, g, None) for g in gen],
                "finish_reason": {"type": "length"},
                "cached_tokens": cached,
                "routed_experts": None if rows is None else _b64(rows),
            },
        }


@pytest.fixture
def slot_engine(tmp_path):
    """`RolloutEngine.generate_turn` over `SlotSGLang` (the engine's transport replaced, as RemoteEngine does)."""
    import asyncio
    import json

    from megagrpo.rollout import RolloutConfig
    from megagrpo.rollout.engines.engine import RolloutEngine

    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": K}))

    class SlotEngine(RolloutEngine):
        routes_num_experts = E

        async def _request(self, **request):
            return self.sgl.request(**request)

    def make(flush_before=()):
        eng = SlotEngine(RolloutConfig(str(tmp_path)))
        eng.num_layers, eng.topk, eng.num_experts, eng.context_len = L, K, E, 4096
        eng.sgl = SlotSGLang(flush_before)
        return eng

    def drive(eng, turns: int) -> Trajectory:
        from megagrpo.rollout.config import SamplingConfig

        t = Trajectory(list(range(1, 8)), num_layers=L, topk=K, num_experts=E)
        for k in range(turns):
            env = [] if k == 0 else [200 + k] * 3
            out = asyncio.run(
                eng.generate_turn(t.next_input_ids(env), SamplingConfig(max_new_tokens=4), seed=k,
                                  routed_experts_start_len=t.routed_experts_start_len)
            )  # fmt: skip
            t.add_engine_output(out, env, version=k)
        return t

    return make, drive


def test_an_evicted_prefix_is_read_back_and_replayed_as_the_last_turn_computed_it(slot_engine):
    make, drive = slot_engine
    # the cache is dropped before turns 2 and 3 (requests 1 and 3: request 2 is turn 2's read-back)
    eng = make(flush_before={1, 3})
    t = drive(eng, 3)
    reqs = [(len(r["ids"]), r["start"], r["params"]["max_new_tokens"]) for r in eng.sgl.requests]
    held2, held3 = 7 + 4 - 1, 7 + 4 + 3 + 4 - 1
    # turn, read-back of [0, held) over the prefix + 1 token (greedy, one new token), turn, read-back
    assert reqs == [
        (7, 0, 4),
        (held2 + 3 + 1, held2, 4),
        (held2 + 1, 0, 1),
        (held3 + 4, held3, 4),
        (held3 + 1, 0, 1),
    ]
    assert [r["params"].get("temperature") for r in eng.sgl.requests[2::2]] == [0.0, 0.0]
    # the table is, at every position, the route of the pass that produced the last turn's tokens
    last = torch.from_numpy(eng.sgl.used[3]).to(torch.int8)
    assert torch.equal(t.routes[:-1], last)
    assert not torch.equal(t.routes[:held2], torch.from_numpy(eng.sgl.used[0][:held2]).to(torch.int8))
    assert (t.prefix_recomputed_turns, t.prefix_recomputed_rows, t.prefix_inexact_turns) == (
        2,
        held2 + held3,
        0,
    )
    assert t.route_rows_received == t.num_tokens - 1 + held2 + held3


def test_a_cached_prefix_sends_no_read_back_and_keeps_every_turns_rows(slot_engine):
    make, drive = slot_engine
    eng = make()
    t = drive(eng, 3)
    assert [r["start"] for r in eng.sgl.requests] == [0, 10, 17]  # three turns, nothing else
    for used in eng.sgl.used:  # every turn attended to the rows the trajectory holds
        assert torch.equal(t.routes[: len(used)], torch.from_numpy(used).to(torch.int8))
    assert (t.prefix_recomputed_turns, t.route_rows_received) == (0, t.num_tokens - 1)


def test_a_read_back_that_finds_the_prefix_evicted_again_is_counted_inexact(slot_engine):
    make, drive = slot_engine
    eng = make(flush_before={1, 2})  # evicted before turn 2, and again before its read-back
    t = drive(eng, 2)
    assert eng.sgl.requests[2]["start"] == 0 and len(eng.sgl.requests) == 3
    # the read-back's own prefill: what the next turn would attend to from the cache, kept and counted
    assert torch.equal(t.routes[:10], torch.from_numpy(eng.sgl.used[2][:10]).to(torch.int8))
    assert (t.prefix_recomputed_turns, t.prefix_inexact_turns) == (1, 1)


def test_a_recomputed_prefix_without_its_read_back_is_refused():
    t = Trajectory([1, 2, 3], num_layers=L, topk=K, num_experts=E)
    meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [(-0.5, 0, None)] * 2}
    t.add_engine_output({"output_ids": [9, 9], "meta_info": {**meta, "routed_experts": _b64(np.ones((4, L, K)))}},
                        version=0)  # fmt: skip
    out = {
        "output_ids": [8, 8],
        "meta_info": {**meta, "cached_tokens": 2, "routed_experts": _b64(np.ones((3, L, K)))},
    }
    with pytest.raises(RuntimeError, match=r"recomputed positions \[2, 4\)"):
        t.add_engine_output(out, [7], version=1)
    assert t.turns == 1
    dense = Trajectory([1, 2, 3])  # no routes: a recompute changes nothing to replay
    one = {**meta, "output_token_logprobs": [(-0.5, 0, None)]}
    dense.add_engine_output({"output_ids": [9], "meta_info": one}, version=0)
    dense.add_engine_output({"output_ids": [9], "meta_info": {**one, "cached_tokens": 0}}, [4], version=0)
    assert dense.prefix_recomputed_turns == 0
