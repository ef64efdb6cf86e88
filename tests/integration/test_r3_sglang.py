"""R3 end to end: the real SGLang engine's routes replayed in the megatron learner (tiny Qwen3-MoE, CPU fp32).

1. Same weights: the learner's own top-k agrees with the engine's routes (agreement 1.0), and replaying
   them changes nothing.
2. The sampler's router weights go through an fp8 (e4m3, per-tensor scale) round trip, so the sampler
   routes some tokens differently: the learner's R3 logprobs are at least as close to the sampler's as
   its logprobs without replay.
3. Across turns: 3-turn trajectories driven by `rollout.multi_turn` (an environment that inserts a tool
   message after each turn), each turn asking the engine for its new route rows only. With the same weights
   the R3 forward reproduces the sampler's logprobs on every model token; with the fp8 routers replay brings
   them closer than no replay; the rows returned at turn 1 are the final table's, and the route bytes are
   linear in the tokens.
4. A prefix evicted between turns: turn 1 of 3 under the fp8 routers, then the weights put back (a weight
   update flushes SGLang's radix cache; the test flushes it too), so turn 2 prefills every earlier token again
   under other routes. The engine reports it (`cached_tokens`), the recomputed rows are read back and replace
   turn 1's, and the turn is counted (`rollout/r3_prefix_recomputed`); turn 3 hits the cache and is not. The
   learner, with the weights that produced turns 2-3, then agrees with every row and reproduces the sampler
   on every token of those turns: it replays the routes that produced them, not turn 1's.

Generation runs here (the session engine); the learner runs in one forked process (tests/dist harness),
which keeps megatron's CPU patches out of the engine's process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist._harness import launch

PROMPTS = [[5, 17, 33, 2, 90, 14], [1, 307, 260, 202], [44, 45, 46, 47, 48, 49, 50, 51], [9, 8, 7]]


def _fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max().clamp_min(1e-12) / 448.0  # e4m3 max
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


MT_ROWS = [{"prompt": "What is 12 + 34?"}, {"prompt": "Add 7 and 5, then double it."}]
MT_TURNS, MT_G = 3, 2


class FixedToolEnv:
    """Answers every model turn with the same tool message; done after MT_TURNS turns (no tools parsed)."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, assistant_message):
        from megagrpo.envs.base import StepResult

        self.turns += 1
        if self.turns >= MT_TURNS:
            return StepResult([], True, 0.0)
        return StepResult([{"role": "tool", "name": "calculator", "content": "46"}], False)

    def tool_schemas(self):
        return []


class RecordingEngine:
    """The session engine, with each turn's request and SGLang's raw answer kept."""

    def __init__(self, engine) -> None:
        self.inner, self.requests = engine, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate_turn(self, input_ids, sampling, **kw):
        out = await self.inner.generate_turn(input_ids, sampling, **kw)
        self.requests.append((list(input_ids), kw["routed_experts_start_len"], out))
        return out


def _multi_turn_batch(engine, tmp: Path, name: str, seed: int) -> tuple[Path, dict]:
    """3-turn trajectories on the engine -> the learner batch (saved), and the routes facts checked here."""
    from megagrpo.rollout.config import SamplingConfig
    from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits, rollout_episodes
    from megagrpo.rollout.episodes.trajectory import route_rows_from_b64
    from megagrpo.trainer.batch import trajectory_batch

    rec = RecordingEngine(engine)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=seed)
    groups, stats = rollout_episodes(
        rec, MT_ROWS, FixedToolEnv, sampling, MultiTurnLimits(max_turns=MT_TURNS), group_size=MT_G
    )
    trajs = [e.trajectory for g in groups for e in g]
    facts = {
        "turns": [t.turns for t in trajs],
        "env_tokens": stats.env_tokens,
        "model_tokens": stats.model_tokens,
    }
    facts.update(turn1_rows_exact=[], every_turn_rows_exact=[], rows_on_the_wire=[], tokens=[], bytes=[])
    for t in trajs:
        ids = t.ids.tolist()
        mine = [
            (i, s, o)
            for i, s, o in rec.requests
            if ids[: len(i) + len(o["output_ids"])] == i + o["output_ids"]
        ]
        blocks = []
        for i, s, o in mine:
            n = len(i) + len(o["output_ids"]) - 1 - s
            rows = route_rows_from_b64(o["meta_info"]["routed_experts"], n, engine.num_layers, engine.topk)
            blocks.append((s, rows))
        table = t.routes.to(torch.int32)
        facts["turn1_rows_exact"].append(
            blocks[0][0] == 0 and torch.equal(table[: len(blocks[0][1])], blocks[0][1])
        )
        facts["every_turn_rows_exact"].append(all(torch.equal(table[s : s + len(r)], r) for s, r in blocks))
        facts["rows_on_the_wire"].append(sum(len(r) for _, r in blocks))
        facts["tokens"].append(t.num_tokens)
        facts["bytes"].append(t.route_bytes_received)
    facts["layers_topk_itemsize"] = [
        engine.num_layers,
        engine.topk,
        torch.empty(0, dtype=t.route_dtype).element_size(),
    ]
    batch = trajectory_batch([[e.trajectory for e in g] for g in groups], torch.zeros(len(trajs)), pad_id=0)
    path = tmp / f"{name}.pt"
    torch.save(batch, path)
    return path, facts


EVICT_ENV = [11, 12, 13]  # the ids inserted before turns 2 and 3


async def _turn(engine, trajs, sampling, turn: int, version: int) -> None:
    """One turn of every trajectory, concurrently, through `generate_turn` (the read-back included)."""
    import asyncio

    from megagrpo.rollout.episodes.multi_turn import turn_seed

    env = [] if turn == 0 else EVICT_ENV
    outs = await asyncio.gather(*(
        engine.generate_turn(t.next_input_ids(env), sampling, seed=turn_seed(sampling.seed, i, turn),
                             routed_experts_start_len=t.routed_experts_start_len)
        for i, t in enumerate(trajs)
    ))  # fmt: skip
    for t, out in zip(trajs, outs):
        t.add_engine_output(out, env, version=version)


def _flush(engine, timeout_s: float = 120.0) -> None:
    """Evict every prefix from the engine's radix cache (SGLang refuses while its last batch is in flight)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not engine.engine.flush_cache().success:
        assert time.monotonic() < deadline, "the engine did not become idle to flush its cache"
        time.sleep(0.02)


def _evicted_turn_one(engine):
    """Turn 1 of one trajectory per prompt, under the engine's current (fp8-router) weights: version 0."""
    from megagrpo.rollout.config import SamplingConfig
    from megagrpo.rollout.episodes.trajectory import Trajectory

    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=3)
    trajs = [
        Trajectory(p, engine.num_layers, engine.topk, engine.routes_num_experts, i)
        for i, p in enumerate(PROMPTS)
    ]
    engine.loop.run_until_complete(_turn(engine, trajs, sampling, 0, version=0))
    return trajs, sampling, [t.routes[:-1].clone() for t in trajs]


def _evicted_turns_two_three(engine, turn_one, tmp: Path) -> tuple[Path, dict]:
    """Turns 2 and 3 after the cache was flushed, under the restored weights (version 1): the batch and facts."""
    from megagrpo.rollout.episodes.multi_turn import Episode, MultiTurnStats
    from megagrpo.trainer.batch import trajectory_batch

    trajs, sampling, rows_one = turn_one
    _flush(engine)
    engine.loop.run_until_complete(_turn(engine, trajs, sampling, 1, version=1))
    engine.loop.run_until_complete(_turn(engine, trajs, sampling, 2, version=1))
    stats = MultiTurnStats()
    for t in trajs:
        stats.add(Episode(t))
    m = stats.metrics()
    facts = {
        "recomputed": m["rollout/r3_prefix_recomputed"],
        "recomputed_rows": m["rollout/r3_prefix_recomputed_rows"],
        "inexact": m["rollout/r3_prefix_inexact"],
        "rows_held_at_turn_two": [len(r) for r in rows_one],
        "turn_one_rows_replaced": [not torch.equal(t.routes[: len(r)], r) for t, r in zip(trajs, rows_one)],
    }
    batch = trajectory_batch([[t] for t in trajs], torch.zeros(len(trajs)), pad_id=0)
    path = tmp / "mt_evicted.pt"
    torch.save(batch, path)
    return path, facts


def _batch(engine, tmp: Path, name: str) -> Path:
    from megagrpo.rollout.config import SamplingConfig
    from megagrpo.trainer.batch import rollout_batch

    groups = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=12, temperature=1.0, ignore_eos=True), 2)
    assert all(c.routes is not None for g in groups for c in g), "the engine returned no routes"
    batch = rollout_batch(groups, torch.zeros(len(PROMPTS) * 2), pad_id=0)
    path = tmp / f"{name}.pt"
    torch.save(batch, path)
    return path


@pytest.fixture(scope="module")
def measured(sglang_engine, sglang_model_dir, hf_reference, tmp_path_factory):
    from megagrpo.sync import bucketize, sync_weights

    tmp = tmp_path_factory.mktemp("r3")
    same = _batch(sglang_engine, tmp, "same")
    mt_same, mt_same_facts = _multi_turn_batch(sglang_engine, tmp, "mt_same", seed=1)
    sd = hf_reference.state_dict()
    routers = [(n, t.detach().clone()) for n, t in sd.items() if n.endswith("mlp.gate.weight")]
    assert routers, "no router weights found in the HF model"
    try:
        sync_weights(sglang_engine, bucketize([(n, _fp8_round_trip(t)) for n, t in routers]), partial=True)
        noisy = _batch(sglang_engine, tmp, "noisy")
        mt_noisy, mt_noisy_facts = _multi_turn_batch(sglang_engine, tmp, "mt_noisy", seed=2)
        turn_one = _evicted_turn_one(sglang_engine)
    finally:
        sync_weights(sglang_engine, bucketize(routers), partial=True)
    mt_evicted, mt_evicted_facts = _evicted_turns_two_three(sglang_engine, turn_one, tmp)
    launch(
        "tests.integration.test_r3_sglang:worker", 1, tmp, timeout=900,
        model_dir=str(sglang_model_dir),
        batches={"same": str(same), "noisy": str(noisy), "mt_same": str(mt_same), "mt_noisy": str(mt_noisy),
                 "mt_evicted": str(mt_evicted)},
    )  # fmt: skip
    res = json.loads((tmp / "rank0.json").read_text())
    res["mt_same"]["engine"], res["mt_noisy"]["engine"] = mt_same_facts, mt_noisy_facts
    res["mt_evicted"]["engine"] = mt_evicted_facts
    print("R3 end to end (learner vs engine):", json.dumps(res, indent=1))  # the figures, with pytest -s
    return res


@pytest.mark.slow
def test_same_weights_engine_routes_agree_with_learner(measured):
    m = measured["same"]
    assert m["agreement_rollout_old"] == 1.0
    assert m["r3_vs_free_max"] < 1e-4  # replaying the learner's own choices changes nothing
    assert m["r3_vs_sampler_mean"] < 1e-3
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


@pytest.mark.slow
def test_r3_logprobs_are_at_least_as_close_to_the_sampler(measured):
    m = measured["noisy"]
    assert m["agreement_rollout_old"] < 1.0, "the fp8 round trip changed no route; the case is vacuous"
    assert m["r3_vs_sampler_mean"] <= m["free_vs_sampler_mean"] + 1e-7
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


@pytest.mark.slow
def test_multi_turn_r3_reproduces_the_sampler_on_every_model_token(measured):
    m, e = measured["mt_same"], measured["mt_same"]["engine"]
    assert e["turns"] == [MT_TURNS] * len(MT_ROWS) * MT_G and e["env_tokens"] > 0
    assert m["tokens"] == e["model_tokens"]  # the loss mask holds the model tokens, and only them
    assert m["agreement_rollout_old"] == 1.0  # every token's route (environment tokens too) is the engine's
    assert m["r3_vs_sampler_max"] < 1e-3  # the same-weights tolerance, on every model token (max, not mean)
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


@pytest.mark.slow
def test_multi_turn_routes_keep_turn_one_rows_and_the_payload_is_linear(measured):
    for case in ("mt_same", "mt_noisy"):
        e = measured[case]["engine"]
        assert all(e["turn1_rows_exact"]) and all(e["every_turn_rows_exact"]), case
        layers, topk, itemsize = e["layers_topk_itemsize"]
        assert e["rows_on_the_wire"] == [n - 1 for n in e["tokens"]], case  # new rows only, each turn
        assert e["bytes"] == [(n - 1) * layers * topk * itemsize for n in e["tokens"]], case


@pytest.mark.slow
def test_multi_turn_without_replay_the_noisy_sampler_is_not_reproduced(measured):
    m = measured["mt_noisy"]
    assert m["agreement_rollout_old"] < 1.0, "the fp8 round trip changed no route; the case is vacuous"
    assert m["r3_vs_sampler_mean"] < m["free_vs_sampler_mean"]
    assert m["r3_vs_sampler_max"] < m["free_vs_sampler_max"]
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


@pytest.mark.slow
def test_an_evicted_prefix_is_replayed_with_the_routes_that_produced_the_later_turns(measured):
    m, e = measured["mt_evicted"], measured["mt_evicted"]["engine"]
    n = len(PROMPTS)
    # turn 2 of every trajectory found its prefix evicted and took the recomputed rows; turn 3 hit the cache
    assert (e["recomputed"], e["inexact"]) == (n, 0)
    assert e["recomputed_rows"] == sum(e["rows_held_at_turn_two"])
    assert any(e["turn_one_rows_replaced"]), "the fp8 routers routed no prefix token differently; vacuous"
    # the learner has the weights of turns 2-3: every row of the table is its own route (turn 1's fp8-router
    # rows would not be), and its R3 logprobs reproduce the sampler on every token of those turns
    assert m["agreement_rollout_old"] == 1.0
    assert m["r3_vs_sampler_max_version_1"] < 1e-3
    assert m["replay_unconsumed"] == 0 and m["replay_fallback_tokens"] == 0


def worker(rank: int, world: int, outdir: Path, model_dir: str, batches: dict[str, str]) -> None:
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.moe.replay import StepReplay
    from megagrpo.trainer.weights import load_hf_into_learner

    learner = Learner(arch_from_hf(Path(model_dir) / "config.json"), LearnerConfig(routing_replay=True))
    load_hf_into_learner(learner, model_dir)
    out = {}
    for name, path in batches.items():
        batch = torch.load(path)
        lb = {k: v for k, v in batch.items() if k != "routes"}
        mask = batch["loss_mask"]
        rep = StepReplay.for_step("R3", learner, batch)
        r3 = learner.forward(lb, hooks=rep.old_pass_hooks())["logprobs"]
        m = {**rep.old_pass_metrics(), **rep.step_metrics()}
        free = learner.forward(lb)["logprobs"]
        sampler = batch["sampler_logp"]
        out[name] = {
            "agreement_rollout_old": m["moe/agreement_rollout_old"],
            "replay_unconsumed": m["moe/replay_unconsumed"],
            "replay_fallback_tokens": m["moe/replay_fallback_tokens"],
            "r3_vs_free_max": float((r3 - free)[mask].abs().max()),
            "r3_vs_sampler_mean": float((r3 - sampler)[mask].abs().mean()),
            "r3_vs_sampler_max": float((r3 - sampler)[mask].abs().max()),
            "free_vs_sampler_mean": float((free - sampler)[mask].abs().mean()),
            "free_vs_sampler_max": float((free - sampler)[mask].abs().max()),
            "tokens": int(mask.sum()),
        }
        if "versions" in batch:  # per policy version: the tokens generated under each weight set
            for v in batch["versions"][mask].unique().tolist():
                on = mask & (batch["versions"] == v)
                out[name][f"r3_vs_sampler_max_version_{v}"] = float((r3 - sampler)[on].abs().max())
    (outdir / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    learner.close(process_group=True)
