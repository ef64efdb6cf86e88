"""The multi-turn driver against a scripted fake engine that keeps SGLang's routes contract: a 3-turn
calculator episode (tool results as environment segments, loss on model tokens only, routes new-rows-only),
bad tool traffic answered and counted, max_turns/max_tokens truncation, concurrency across trajectories,
seeds that do not depend on the engine split, and the learner batch of trajectories; with Qwen3's chat
template (thinking on and off) and its reasoning parser: reasoning split off before tool calls and answers,
turns cut inside <think>, and a template that cannot append a step ending one trajectory, counted."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import time

import numpy as np
import pytest
import torch

from megagrpo.envs.base import StepResult
from megagrpo.envs.calculator import CalculatorEnv, calculator_tool
from megagrpo.envs.tools import Tool, ToolExecutor
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.completion import NO_ROUTE, completion_from_output
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits, MultiTurnStats, rollout_episodes, turn_seed
from megagrpo.rollout.episodes.trajectory import PREFIX_REREAD, EnvSegment, ModelSegment, Trajectory
from megagrpo.trainer.batch import rollout_batch, trajectory_batch
from tests.fixtures.qwen3 import qwen3_tokenizer

L, K, E = 3, 2, 8
SAMPLING = SamplingConfig(max_new_tokens=256, seed=11)


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def tok():
    from megagrpo.tiny_model import train_tokenizer

    return train_tokenizer(1024)


class ScriptedEngine:
    """SGLang's side of a turn, faked: the output is the script's text for the request's question and turn
    (encoded, then the end-of-turn token unless cut at `max_new_tokens`); each request computes a fresh route
    for every input position (as if the prefix cache were evicted, so a re-read prefix would differ) and
    returns the rows `[routed_experts_start_len, seqlen - 1)` as base64 int32, as SGLang 0.5.23 does. With
    `evicted=True` it also says so, as `RolloutEngine.generate_turn` does: `cached_tokens` 0 and the
    recomputed prefix's rows read back (`PREFIX_REREAD`)."""

    num_layers, topk, routes_num_experts, context_len = L, K, E, 4096

    def __init__(self, tok, scripts: dict[str, list[str]], evicted: bool = False) -> None:
        self.tokenizer, self.scripts, self.evicted = tok, scripts, evicted
        self.loop = asyncio.new_event_loop()
        self.rng = np.random.default_rng(0)
        self.requests: list[dict] = []  # per request: question, turn, ids, start, seed, output ids, rows

    async def generate_turn(
        self, input_ids, sampling, *, seed, routed_experts_start_len=0, max_new_tokens=None
    ):
        await asyncio.sleep(0.001)  # a real engine yields to the loop while it decodes
        ids = list(input_ids)
        text = self.tokenizer.decode(ids)
        question = next(q for q in self.scripts if q in text)
        turn = text.count("<|im_start|>assistant") - 1
        gen = self.tokenizer(self.scripts[question][turn], add_special_tokens=False)["input_ids"]
        gen = [*gen, self.tokenizer.eos_token_id]
        n = max_new_tokens or sampling.max_new_tokens
        finish = "length" if len(gen) > n else "stop"
        gen = gen[:n]
        seqlen = len(ids) + len(gen)
        assert 0 <= routed_experts_start_len <= len(ids), "SGLang aborts this request"
        table = self.rng.integers(0, E, (seqlen - 1, L, K))  # every input position, computed afresh
        rows = table[routed_experts_start_len:]
        self.requests.append(
            dict(question=question, turn=turn, ids=ids, start=routed_experts_start_len, seed=seed,
                 out=gen, rows=torch.from_numpy(rows).to(torch.int32), table=list(table))
        )  # fmt: skip
        lps = (-self.rng.random(len(gen))).astype(np.float32)
        out = {
            "output_ids": gen,
            "meta_info": {
                "output_token_logprobs": [(float(lp), t, None) for lp, t in zip(lps, gen)],
                "finish_reason": {"type": finish},
                "routed_experts": _b64(rows),
            },
        }
        if self.evicted:
            out["meta_info"]["cached_tokens"] = 0
            if routed_experts_start_len:  # the read-back runs to the held prefix's next token
                reread = _b64(table[: routed_experts_start_len + 1])
                out[PREFIX_REREAD] = {"start": 0, "routed_experts": reread, "cached_tokens": len(ids) - 1}
        return out

    def close(self) -> None:
        self.loop.close()


def _b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, np.int32).tobytes()).decode()


def _run(tok, scripts, rows, make_env, limits=None, evicted=False, sampling=SAMPLING, **kw):
    eng = ScriptedEngine(tok, scripts, evicted)
    try:
        groups, stats = rollout_episodes(eng, rows, make_env, sampling, limits or MultiTurnLimits(), **kw)
    finally:
        eng.close()
    return eng, groups, stats


Q1 = "What is 123456 * 789 + 1?"
SCRIPT1 = [
    "I will multiply first.\n" + _call("calculator", {"expression": "123456 * 789"}),
    _call("calculator", {"expression": "97406784 + 1"}),
    "<answer>97406785</answer>",
]


def test_three_turn_calculator_episode(tok):
    eng, [[ep]], stats = _run(tok, {Q1: SCRIPT1}, [{"prompt": Q1, "answer": "97406785"}], CalculatorEnv)
    t = ep.trajectory
    assert (ep.done, ep.reward, ep.truncation, t.turns) == (True, 1.0, None, 3)
    assert ep.tools.as_dict() == dict(tool_calls=2, tool_errors=0, tool_timeouts=0, malformed_calls=0,
                                      unknown_tools=0, oversize_results=0, interrupted_calls=0,
                                      unisolated_calls=0, refused_calls=0)  # fmt: skip
    # segments: model, env (the tool's result in the template), model, env, model
    kinds = [type(s) for s in t.segments]
    assert kinds == [ModelSegment, EnvSegment, ModelSegment, EnvSegment, ModelSegment]
    env_text = [tok.decode(s.ids) for s in t.segments if isinstance(s, EnvSegment)]
    assert env_text == [
        "\n<|im_start|>tool\n97406784<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>tool\n97406785<|im_end|>\n<|im_start|>assistant\n",
    ]
    # the loss is on the ids the engine generated, and on nothing else
    assert t.ids[t.loss_mask].tolist() == [x for r in eng.requests for x in r["out"]]
    env_ids = [s.ids for s in t.segments if isinstance(s, EnvSegment)]
    assert t.loss_mask.sum() == t.num_model_tokens and ep.env_tokens == sum(x.numel() for x in env_ids)
    # each request re-sends the ids so far and asks for the rows not yet held
    for k, r in enumerate(eng.requests):
        assert r["ids"] == t.ids[: len(r["ids"])].tolist()
        assert r["start"] == (
            0 if k == 0 else len(eng.requests[k - 1]["ids"]) + len(eng.requests[k - 1]["out"]) - 1
        )
    # routes: the rows returned at each turn are the final table's rows there, turn 1's included
    routes = t.routes
    first = eng.requests[0]["rows"]
    assert torch.equal(routes[: first.shape[0]].to(torch.int32), first)
    assert torch.equal(routes[:-1].to(torch.int32), torch.cat([r["rows"] for r in eng.requests]))
    assert bool((routes[-1] == NO_ROUTE).all()) and routes.dtype == torch.int8
    # payload linear in the tokens: T - 1 rows of L x K int8, not the sum over turns of the prefix
    assert t.route_bytes_received == (t.num_tokens - 1) * L * K * 1
    assert t.route_rows_if_resent == sum(len(r["ids"]) + len(r["out"]) - 1 for r in eng.requests)
    assert t.route_rows_if_resent > t.route_rows_received
    m = stats.metrics()
    assert m["rollout/turns_mean"] == 3 and m["rollout/tool_calls_per_traj"] == 2
    assert m["rollout/env_token_frac"] == pytest.approx(ep.env_tokens / (ep.env_tokens + t.num_model_tokens))


def test_an_evicted_prefix_takes_the_recomputed_rows_and_is_counted(tok):
    rows = [{"prompt": Q1, "answer": "97406785"}]
    eng, [[ep]], stats = _run(tok, {Q1: SCRIPT1}, rows, CalculatorEnv, evicted=True)
    t, last = ep.trajectory, eng.requests[-1]
    # the whole table, as the last turn's pass computed it (it recomputed the prefix), not as turn 1 did
    want = torch.cat([torch.from_numpy(np.stack(last["table"][: last["start"]])).int(), last["rows"]])
    assert t.turns == 3 and torch.equal(t.routes[:-1].to(torch.int32), want)
    assert not torch.equal(t.routes[: len(eng.requests[0]["rows"])].to(torch.int32), eng.requests[0]["rows"])
    held = sum(r["start"] for r in eng.requests)
    assert (t.prefix_recomputed_turns, t.prefix_recomputed_rows) == (2, held)
    m = stats.metrics()
    assert (m["rollout/r3_prefix_recomputed"], m["rollout/r3_prefix_recomputed_rows"]) == (2.0, float(held))
    assert m["rollout/r3_prefix_inexact"] == 0.0
    # the counters add up over engines like the others
    assert MultiTurnStats.from_counts(stats.counts()).r3_prefix_recomputed_rows == held


def test_malformed_call_and_unknown_tool_are_answered_counted_and_the_trajectory_goes_on(tok):
    q = "What is 2 + 2?"
    script = [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}\n</tool_call>',  # one brace short
        _call("weather", {"city": "Paris"}),
        "<answer>4</answer>",
    ]
    _, [[ep]], stats = _run(tok, {q: script}, [{"prompt": q, "answer": "4"}], CalculatorEnv)
    t = ep.trajectory
    assert (ep.done, ep.reward, t.turns) == (True, 1.0, 3)
    assert (ep.tools.tool_calls, ep.tools.malformed_calls, ep.tools.unknown_tools) == (2, 1, 1)
    env_text = [tok.decode(s.ids) for s in t.segments if isinstance(s, EnvSegment)]
    assert "Error: malformed tool call" in env_text[0]
    assert "Error: unknown tool 'weather'; available: calculator" in env_text[1]
    m = stats.metrics()
    assert (m["rollout/malformed_calls"], m["rollout/unknown_tools"]) == (1.0, 1.0)


def test_max_turns_truncation_is_counted(tok):
    q = "What is 3 * 3?"
    script = [_call("calculator", {"expression": "3*3"})] * 5
    _, [[ep]], stats = _run(
        tok, {q: script}, [{"prompt": q, "answer": "9"}], lambda: CalculatorEnv(max_turns=10),
        MultiTurnLimits(max_turns=2),
    )  # fmt: skip
    assert (ep.done, ep.truncation, ep.reward, ep.trajectory.turns) == (False, "max_turns", None, 2)
    assert isinstance(ep.trajectory.segments[-1], ModelSegment)  # the dropped tool result is not appended
    assert stats.metrics()["rollout/truncated_max_turns_frac"] == 1.0


def test_max_tokens_truncation_cuts_a_turn_or_drops_an_insertion(tok):
    row = [{"prompt": Q1, "answer": "97406785"}]
    eng, [[full]], _ = _run(tok, {Q1: SCRIPT1}, row, CalculatorEnv)
    out0, env1 = len(eng.requests[0]["out"]), full.trajectory.segments[1].ids.numel()
    # the budget runs out two tokens into turn 2: that turn is cut, not sent to the environment
    _, [[cut]], stats = _run(
        tok, {Q1: SCRIPT1}, row, CalculatorEnv, MultiTurnLimits(max_tokens=out0 + env1 + 2)
    )
    t = cut.trajectory
    assert (cut.truncation, cut.done, cut.reward, t.turns, t.finish_reason) == (
        "max_tokens",
        False,
        None,
        2,
        "length",
    )
    assert t.model_segments[1].ids.numel() == 2 and t.num_tokens - t.prompt_ids.numel() == out0 + env1 + 2
    assert stats.metrics()["rollout/truncated_max_tokens_frac"] == 1.0
    # the tool result would leave no token for the model: it is not appended
    _, [[full_env]], _ = _run(tok, {Q1: SCRIPT1}, row, CalculatorEnv, MultiTurnLimits(max_tokens=out0 + env1))
    t = full_env.trajectory
    assert (full_env.truncation, t.turns, len(t.segments)) == ("max_tokens", 1, 1)


def test_trajectories_run_concurrently_while_tools_wait(tok):
    slow = Tool("calculator", "sleeps, then adds", calculator_tool().parameters,
                lambda expression: (time.sleep(0.3), "2")[1])  # fmt: skip
    qs = ["What is 1 + 1?", "What is 0 + 2?"]
    scripts = {q: [_call("calculator", {"expression": "1+1"}), "<answer>2</answer>"] for q in qs}
    start = time.monotonic()
    _, groups, stats = _run(
        tok, scripts, [{"prompt": q, "answer": "2"} for q in qs],
        lambda: CalculatorEnv(executor=ToolExecutor([slow])),
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert [e.reward for g in groups for e in g] == [1.0, 1.0] and stats.tools.tool_calls == 2
    assert seconds < 0.5, f"two 0.3 s tools took {seconds:.2f} s: the trajectories did not overlap"


def test_seeds_come_from_the_global_index_and_turn_whatever_the_engine_split(tok):
    qs = [f"What is {i} + {i}?" for i in range(3)]
    scripts = {q: [_call("calculator", {"expression": "1"}), "<answer>1</answer>"] for q in qs}
    rows = [{"prompt": q, "answer": "1"} for q in qs]
    one, _, _ = _run(tok, scripts, rows, CalculatorEnv, group_size=2)
    a, _, _ = _run(tok, scripts, rows[:1], CalculatorEnv, group_size=2)
    b, _, _ = _run(tok, scripts, rows[1:], CalculatorEnv, group_size=2, index_offset=2)

    def seeds(eng):
        return sorted((r["question"], r["turn"], r["seed"]) for r in eng.requests)

    assert seeds(one) == sorted(seeds(a) + seeds(b))
    assert len({s for *_, s in seeds(one)}) == 12  # 3 rows x 2 samples x 2 turns, no seed shared
    assert turn_seed(None, 0, 0) is None


class _SilentEnv(CalculatorEnv):
    async def step(self, assistant_message):
        return StepResult([], False)


def test_an_environment_that_breaks_the_protocol_is_named(tok):
    with pytest.raises(MegagrpoError, match="_SilentEnv returned no message and done=False"):
        _run(tok, {Q1: SCRIPT1}, [{"prompt": Q1, "answer": "1"}], _SilentEnv)


def test_trajectory_batch_of_one_turn_trajectories_is_rollout_batch(tok):
    rng = np.random.default_rng(3)
    comps = []
    for i, (P, n_out) in enumerate([(4, 3), (6, 2)]):
        rows = rng.integers(0, E, (P + n_out - 1, L, K)).astype(np.int32)
        out = {
            "output_ids": list(range(40, 40 + n_out)),
            "meta_info": {
                "output_token_logprobs": [(-0.5 * (j + 1), 40 + j, None) for j in range(n_out)],
                "finish_reason": {"type": "length" if i else "stop"},
                "routed_experts": base64.b64encode(rows.tobytes()).decode(),
            },
        }
        comps.append(completion_from_output(out, prompt_index=i, sample_index=0,
                                            prompt_ids=list(range(1, P + 1)), num_layers=L, topk=K))  # fmt: skip
    groups = [[c] for c in comps]
    adv, rew = torch.tensor([0.5, -0.5]), torch.tensor([1.0, 0.0])
    want = rollout_batch(groups, adv, pad_id=0, rewards=rew)
    got = trajectory_batch(
        [[Trajectory.from_completion(c, num_experts=E, version=2)] for c in comps], adv, pad_id=0, rewards=rew
    )
    assert set(got) == set(want) | {"versions", "model_mask"}
    for k, v in want.items():
        assert got[k].dtype == v.dtype or k == "routes", k
        assert torch.equal(got[k].to(v.dtype), v), k
    assert got["routes"].dtype == torch.int8
    assert torch.equal(got["versions"], torch.where(want["loss_mask"], 2, -1))


def test_trajectory_batch_masks_environment_tokens(tok):
    eng, [[ep]], _ = _run(tok, {Q1: SCRIPT1}, [{"prompt": Q1, "answer": "97406785"}], CalculatorEnv)
    t = ep.trajectory
    b = trajectory_batch([[t]], torch.zeros(1), pad_id=0, truncated=torch.tensor([ep.truncated]))
    assert torch.equal(b["loss_mask"][0], t.loss_mask) and torch.equal(b["input_ids"][0], t.ids)
    assert torch.equal(b["sampler_logp"][0][t.loss_mask], torch.cat([s.logprobs for s in t.model_segments]))
    assert (
        torch.equal(b["routes"][0], t.routes)
        and b["response_len"].item() == t.num_tokens - t.prompt_ids.numel()
    )
    assert not b["truncated"].item()


def test_a_prompt_that_fills_the_context_is_a_user_error(tok, monkeypatch):
    monkeypatch.setattr(ScriptedEngine, "context_len", 8)
    with pytest.raises(MegagrpoError, match=r"data row 0: its prompt has \d+ tokens.*context of 8 tokens"):
        _run(tok, {Q1: SCRIPT1}, [{"prompt": Q1, "answer": "1"}], CalculatorEnv)


# ------------------------------------------------------------------- Qwen3's template and reasoning parser


@pytest.fixture(scope="module")
def qtok():
    from megagrpo.tiny_model import train_tokenizer

    return qwen3_tokenizer(train_tokenizer(1024))


QWEN3 = dict(reasoning_parser="qwen3", template_kwargs={"enable_thinking": True})
Q2 = "What is 2 + 2?"


def _env_text(tok, t) -> list[str]:
    return [tok.decode(s.ids) for s in t.segments if isinstance(s, EnvSegment)]


def _check_ids_are_the_engine_s(eng, t) -> None:
    """Each request sent the trajectory's ids so far, and the model segments are the engine's outputs."""
    for r in eng.requests:
        assert r["ids"] == t.ids[: len(r["ids"])].tolist()
    assert t.ids[t.loss_mask].tolist() == [x for r in eng.requests for x in r["out"]]
    last = eng.requests[-1]
    assert t.ids.tolist() == last["ids"] + last["out"]


def test_an_answer_or_a_tool_call_inside_think_is_neither_scored_nor_run(qtok):
    script = [
        "<think>\nIt is <answer>5</answer>, or I call "
        + _call("calculator", {"expression": "9*9"})
        + "\n</think>\n\n"
        + _call("calculator", {"expression": "2+2"}),
        "<think>\nThe tool says 4.\n</think>\n\n<answer>4</answer>",
    ]
    eng, [[ep]], stats = _run(qtok, {Q2: script}, [{"prompt": Q2, "answer": "5"}], CalculatorEnv, **QWEN3)
    t = ep.trajectory
    # turn 0's <answer>5</answer> sat in its reasoning: not scored, the episode went on to turn 1's answer
    assert (ep.done, ep.reward, t.turns, ep.info["finish"]) == (True, 0.0, 2, "answer")
    assert ep.tools.tool_calls == 1  # 2+2 ran; the 9*9 inside <think> did not
    [env] = _env_text(qtok, t)
    assert (
        env == "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ep.final_text == "\n\n<answer>4</answer>"  # the content: what rewards.functions would score
    _check_ids_are_the_engine_s(eng, t)
    assert stats.metrics()["rollout/cut_turns_frac"] == 0.0


def test_a_turn_cut_inside_think_is_all_reasoning_and_is_counted(qtok):
    think = "<think>\nI will call " + _call("calculator", {"expression": "2+2"})
    n = len(qtok(think, add_special_tokens=False)["input_ids"])
    script = [think + " and then answer <answer>4</answer>\n</think>\n\n<answer>4</answer>"]
    sampling = SamplingConfig(max_new_tokens=n + 2, seed=11)  # the call is complete, </think> never comes
    eng, [[ep]], stats = _run(
        qtok, {Q2: script}, [{"prompt": Q2, "answer": "4"}], CalculatorEnv, sampling=sampling, **QWEN3
    )
    t = ep.trajectory
    assert eng.requests[0]["out"][-1] != qtok.eos_token_id and t.finish_reason == "length"
    # SGLang's parser alone would end the reasoning at <tool_call> and run it; a cut turn never does
    assert (ep.tools.tool_calls, ep.done, ep.reward, ep.info["finish"]) == (0, True, 0.0, "no_answer")
    assert (ep.cut_turns, ep.cut_in_reasoning, ep.truncation, ep.final_text) == (1, 1, None, "")
    m = stats.metrics()
    assert (m["rollout/cut_turns_frac"], m["rollout/cut_in_reasoning_frac"]) == (1.0, 1.0)
    _check_ids_are_the_engine_s(eng, t)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
def test_qwen3_tool_episode_thinking_on_and_off(qtok, thinking):
    think = "<think>\nLet me compute.\n</think>\n\n" if thinking else ""
    script = [think + _call("calculator", {"expression": "2+2"}), think + "<answer>4</answer>"]
    kw = dict(reasoning_parser="qwen3", template_kwargs={"enable_thinking": thinking})
    eng, [[ep]], _ = _run(qtok, {Q2: script}, [{"prompt": Q2, "answer": "4"}], CalculatorEnv, **kw)
    t = ep.trajectory
    assert (ep.done, ep.reward, t.turns, ep.tools.tool_calls) == (True, 1.0, 2, 1)
    empty_think = "" if thinking else "<think>\n\n</think>\n\n"
    assert qtok.decode(eng.requests[0]["ids"]).endswith("<|im_start|>assistant\n" + empty_think)
    assert _env_text(qtok, t) == [
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        + empty_think
    ]
    _check_ids_are_the_engine_s(eng, t)


def test_a_template_that_cannot_append_a_step_ends_that_trajectory_counted(tok, monkeypatch):
    counting = copy.deepcopy(tok)  # the system turn counts the messages: each step rewrites the start
    counting.chat_template = (
        "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + tok.chat_template
    )
    _, [[ep]], stats = _run(counting, {Q1: SCRIPT1}, [{"prompt": Q1, "answer": "97406785"}], CalculatorEnv)
    t = ep.trajectory
    assert (ep.truncation, ep.done, ep.reward, t.turns, len(t.segments)) == ("template", False, None, 1, 1)
    assert ep.tools.tool_calls == 1  # the environment answered the turn; its result could not be inserted
    assert stats.metrics()["rollout/template_breaks"] == 1.0
