"""The trainer's side of multi-turn rollouts (issue 26): trajectories from the turn driver become learner
rows whose environment tokens take no loss, their rewards and counters reach the step's metrics, and in
async mode no trained token is older than `max_staleness`, whatever version each turn was sampled with."""

from __future__ import annotations

import torch

from megagrpo.config import config_from_dict
from megagrpo.envs.calculator import CalculatorEnv
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits, MultiTurnStats, rollout_episodes
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer.batch import response_mask, rollout_batch, turn_index
from megagrpo.trainer.episodes import EpisodeSampler, episode_completion, multi_turn_metrics
from megagrpo.trainer.grpo import mask_stale_tokens, token_lags
from tests.unit.rollout.test_multi_turn import Q1, SAMPLING, SCRIPT1, ScriptedEngine, tok  # noqa: F401

Q2 = "What is 2 + 2?"
SCRIPT2 = ["<answer>5</answer>"]  # one turn, wrong


def _multi_turn(**over):
    mt = {"enabled": True, "environment": "calculator", **over}
    return config_from_dict({"model": {"hf_path": "m"}, "rollout": {"multi_turn": mt}}).rollout.multi_turn


def _groups(tok, **over):  # noqa: F811
    sampler = EpisodeSampler(_multi_turn(**over))
    eng = ScriptedEngine(tok, {Q1: SCRIPT1, Q2: SCRIPT2})
    prompts = [
        PromptGroup(input_ids=[1], sample={"prompt": Q1, "answer": "97406785"}),
        PromptGroup(input_ids=[1], sample={"prompt": Q2, "answer": "4"}),
    ]
    try:
        groups = sampler.generate(eng, prompts, SAMPLING, 2, index_offset=0, version=3)
    finally:
        eng.close()
    return sampler, prompts, groups


def test_trajectories_become_rows_with_environment_rewards_and_counters(tok):  # noqa: F811
    sampler, prompts, groups = _groups(tok)
    assert [len(g) for g in groups] == [2, 2]
    torch.testing.assert_close(sampler.environment_rewards(prompts), torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    c = groups[0][0]
    assert c.output_mask is not None and not bool(c.output_mask.all()), "tool results sit between turns"
    assert c.output_versions[c.output_mask].eq(3).all() and c.output_versions[~c.output_mask].eq(-1).all()
    assert c.text.endswith("<answer>97406785</answer>") and c.finish_reason == "stop"
    m = multi_turn_metrics(sampler.counts(prompts))
    assert m["rollout/turns_mean"] == (3 * 2 + 1 * 2) / 4
    assert m["rollout/tool_calls_per_traj"] == 1.0  # two calls in each Q1 trajectory
    assert 0 < m["rollout/env_token_frac"] < 1 and m["rollout/unscored_frac"] == 0.0

    batch = rollout_batch(groups, torch.zeros(4), pad_id=0)
    P = c.prompt_ids.numel()
    assert torch.equal(batch["loss_mask"][0, P : P + c.output_ids.numel()], c.output_mask)
    assert int(batch["loss_mask"][0].sum()) < int(batch["response_len"][0]), "env tokens take no loss"
    batch["loss_mask"][0] = False  # an overlong filter clears the row: the response stays the model's
    assert torch.equal(response_mask(batch), batch["model_mask"])
    assert int(response_mask(batch)[0].sum()) == int(c.output_mask.sum())
    turns = turn_index(batch["model_mask"])
    assert int(turns[0].max()) == 2 and int(turns[2].max()) == 0
    assert torch.equal(turns >= 0, batch["model_mask"])


def test_an_unscored_truncated_trajectory_gets_zero_and_is_counted(tok):  # noqa: F811
    sampler, prompts, groups = _groups(tok, max_turns=2)
    torch.testing.assert_close(sampler.environment_rewards(prompts)[0], torch.zeros(2))
    assert all(c.finish_reason == "length" for c in groups[0]), "a truncated trajectory is overlong"
    m = multi_turn_metrics(sampler.counts(prompts))
    assert m["rollout/truncated_max_turns_frac"] == 0.5 and m["rollout/unscored_frac"] == 0.5


def test_counters_add_up_over_engines():
    a, b = MultiTurnStats(trajectories=2, turns=5), MultiTurnStats(trajectories=2, turns=3, unscored=1)
    a.tools.tool_errors, b.tools.tool_errors = 1, 2
    summed = {k: a.counts()[k] + b.counts()[k] for k in a.counts()}
    got = MultiTurnStats.from_counts(summed)
    assert (got.trajectories, got.turns, got.unscored, got.tools.tool_errors) == (4, 8, 1, 3)
    assert multi_turn_metrics({}) == {}


def test_a_trajectory_spanning_a_weight_update_trains_no_token_older_than_the_bound(tok):  # noqa: F811
    """Async, max_staleness 1, at step 5: turn 1 was sampled by version 3 (lag 2), turns 2-3 by version 4
    after an update between turns. Every token records its version; the lag-2 tokens leave the loss."""
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    versions = iter([3, 4, 4])
    try:
        [[ep]], _ = rollout_episodes(
            eng, [{"prompt": Q1, "answer": "97406785"}], CalculatorEnv, SAMPLING, MultiTurnLimits(),
            version=lambda: next(versions),
        )  # fmt: skip
    finally:
        eng.close()
    c = episode_completion(ep)
    assert sorted(set(c.output_versions[c.output_mask].tolist())) == [3, 4]
    batch = rollout_batch([[c]], torch.zeros(1), pad_id=0)
    lags = token_lags(batch, 5, torch.tensor([1]))
    turn = turn_index(batch["model_mask"])
    assert lags[turn == 0].eq(2).all() and lags[turn > 0].eq(1).all()
    before = int(batch["loss_mask"].sum())
    masked = mask_stale_tokens(batch, lags, max_lag=1)
    assert masked == int((turn == 0).sum()) > 0 and int(batch["loss_mask"].sum()) == before - masked
    assert int(lags[batch["loss_mask"]].max()) <= 1
    # a single-turn batch keeps its rows' lags
    single = {"input_ids": torch.zeros(2, 3, dtype=torch.int64)}
    assert torch.equal(token_lags(single, 5, torch.tensor([0, 1])), torch.tensor([[0] * 3, [1] * 3]))


def test_bad_tool_traffic_is_answered_and_counted_and_the_batch_is_built(tok):  # noqa: F811
    """Malformed JSON, an unknown tool, a raising tool, a hanging tool and a 100 MB result, one per turn of
    one trajectory, through the trainer's sampling path: each is answered, each is counted, the trajectory
    reaches its answer and the step's rows are built."""
    import threading

    from megagrpo.envs.answer import AnswerToolEnv
    from megagrpo.envs.tools import Tool, ToolExecutor
    from tests.unit.rollout.test_multi_turn import _call

    release = threading.Event()
    params = {"type": "object", "properties": {}}

    def boom():
        raise RuntimeError("tool bug")

    tools = [
        Tool("boom", "raises", params, boom),
        Tool("hang", "never returns", params, lambda: release.wait(60), timeout_s=0.2),
        Tool("flood", "100 MB", params, lambda: "y" * 100_000_000),
    ]
    q = "Do it."
    script = [
        '<tool_call>\n{"name": "boom", "arguments": {\n</tool_call>',  # malformed JSON
        _call("weather", {}),
        _call("boom", {}),
        _call("hang", {}),
        _call("flood", {}),
        "<answer>ok</answer>",
    ]

    class Env(AnswerToolEnv):
        def __init__(self):
            super().__init__(ToolExecutor(tools, max_result_chars=2000), max_turns=8)

    sampler = EpisodeSampler(_multi_turn(max_turns=8, max_tokens=4096))
    sampler.env_cls = Env
    eng = ScriptedEngine(tok, {q: script})
    prompts = [PromptGroup(input_ids=[1], sample={"prompt": q, "answer": "ok"})]
    try:
        groups = sampler.generate(eng, prompts, SAMPLING, 1, index_offset=0, version=0)
    finally:
        release.set()
        eng.close()
    m = multi_turn_metrics(sampler.counts(prompts))
    assert m["rollout/turns_mean"] == 6 and m["rollout/tool_calls_per_traj"] == 5
    for k in ("malformed_calls", "unknown_tools", "tool_errors", "tool_timeouts", "oversize_results"):
        assert m[f"rollout/{k}"] == 1.0, k
    assert sampler.environment_rewards(prompts).tolist() == [[1.0]]
    batch = rollout_batch(groups, torch.zeros(1), pad_id=0)
    text = tok.decode(batch["input_ids"][0][~batch["model_mask"][0]])
    for answer in (
        "malformed",
        "unknown tool 'weather'",
        "RuntimeError: tool bug",
        "timed out",
        "[truncated",
    ):
        assert answer in text, answer
    assert int(batch["seq_lens"][0]) < 4096, "the 100 MB result reached the row at its size limit only"


def _calculator_env(fn):
    """CalculatorEnv with `fn(expression)` as its calculator, and the executor's own default bound (16)."""
    from megagrpo.envs.calculator import CALCULATOR_PARAMETERS
    from megagrpo.envs.tools import Tool, ToolExecutor

    class Env(CalculatorEnv):
        def __init__(self):
            super().__init__(executor=ToolExecutor([Tool("calculator", "slow", CALCULATOR_PARAMETERS, fn)]))

    return Env


def test_tool_calls_of_all_an_owners_trajectories_share_one_bound(tok):  # noqa: F811
    """16 trajectories on one owner, each with its own executor: never more than max_concurrent_tools=3
    tool calls at once (each executor alone would allow 16)."""
    import threading
    import time

    lock, running, peak = threading.Lock(), [0], [0]

    def slow(expression):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return "1"

    sampler = EpisodeSampler(_multi_turn(max_concurrent_tools=3))
    sampler.env_cls = _calculator_env(slow)
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    prompts = [PromptGroup(input_ids=[1], sample={"prompt": Q1, "answer": "97406785"}) for _ in range(8)]
    try:
        sampler.generate(eng, prompts, SAMPLING, 2, index_offset=0, version=0)
    finally:
        eng.close()
    m = multi_turn_metrics(sampler.counts(prompts))
    assert m["rollout/tool_calls_per_traj"] == 2.0 and m["rollout/tool_timeouts"] == 0.0
    assert 1 < peak[0] <= 3, f"{peak[0]} tool calls ran at once"


def test_an_interrupted_tool_call_drops_its_trajectory_and_is_counted(tok):  # noqa: F811
    """The first call of the step is killed from outside (`ToolInterrupted`): its trajectory ends there,
    unscored, and its row takes no loss; the other trajectory of the group trains as usual."""
    import threading

    from megagrpo.envs.tools import ToolInterrupted

    lock, calls = threading.Lock(), [0]

    def calc(expression):
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            raise ToolInterrupted("the sandbox's processes were killed from outside")
        return "1"

    sampler = EpisodeSampler(_multi_turn())
    sampler.env_cls = _calculator_env(calc)
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    prompts = [PromptGroup(input_ids=[1], sample={"prompt": Q1, "answer": "97406785"})]
    try:
        [group] = sampler.generate(eng, prompts, SAMPLING, 2, index_offset=0, version=0)
    finally:
        eng.close()
    dropped = [c for c in group if not bool(c.output_mask.any())]
    kept = [c for c in group if bool(c.output_mask.any())]
    assert len(dropped) == 1 and len(kept) == 1
    assert sorted(sampler.environment_rewards(prompts)[0].tolist()) == [0.0, 1.0]
    m = multi_turn_metrics(sampler.counts(prompts))
    assert m["rollout/tool_interrupted"] == 1.0 and m["rollout/unscored_frac"] == 0.5
    batch = rollout_batch([group], torch.zeros(2), pad_id=0)
    assert [bool(batch["loss_mask"][i].any()) for i in range(2)] == [c is kept[0] for c in group]
