"""The OpenAI-compatible agent endpoint (`rollout.agent_endpoint`, `rollout.agent_session`) against the
scripted fake engine of test_multi_turn, with agents written against the real `openai` client:

* the calculator agent records, token for token, the trajectory the built-in driver records for the same
  conversation (ids, masks, logprobs, versions, routes new-rows-only, seeds), streamed or not;
* an agent that rewrites its history opens a branch: the learner's row is ids the engine saw, with the loss
  on exactly the ids it generated; with on_departure=refuse the request is answered 409;
* faults: an agent that hangs, crashes, sends a malformed request, or sends no token ends its session
  within its budget, counted, and the rollout completes; a request after its session ended gets 410;
  a command agent runs with its base URL in its environment.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import httpx
import openai
import pytest
import torch

from megagrpo.envs.calculator import CalculatorEnv
from megagrpo.envs.calculator_agent import run as calculator_agent
from megagrpo.envs.calculator_agent import tool_schema
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.agent_endpoint import AgentRunner, EndpointOptions, rollout_sessions
from megagrpo.rollout.multi_turn import MultiTurnLimits, rollout_episodes
from megagrpo.trainer.batch import rollout_batch
from megagrpo.trainer.episodes import episode_completion
from tests.unit.rollout.test_multi_turn import Q1, SCRIPT1, SAMPLING, ScriptedEngine, _call

ROW = {"prompt": Q1, "answer": "97406785"}


@pytest.fixture(scope="module")
def tok():
    from megagrpo.tiny_model import train_tokenizer

    return train_tokenizer(1024)


def _sessions(tok, scripts, rows, agent, options=EndpointOptions(timeout_s=20), **kw):
    eng = ScriptedEngine(tok, scripts)
    try:
        runner = agent if isinstance(agent, AgentRunner) else AgentRunner(agent)
        groups, stats = rollout_sessions(eng, rows, runner, SAMPLING, MultiTurnLimits(), options=options, **kw)
    finally:
        eng.close()
    return eng, groups, stats


def _same_trajectory(a, b) -> None:
    assert torch.equal(a.ids, b.ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.versions, b.versions)
    assert torch.equal(a.routes, b.routes) and a.route_bytes_received == b.route_bytes_received


def _check_ids_are_the_engine_s(requests, t) -> None:
    """The row is the ids of the branch's last request and its output, and the loss is on exactly the ids
    the engine generated for that branch's requests."""
    for r in requests:
        assert r["ids"] == t.ids[: len(r["ids"])].tolist()
    assert t.ids[t.loss_mask].tolist() == [x for r in requests for x in r["out"]]
    assert t.ids.tolist() == requests[-1]["ids"] + requests[-1]["out"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_the_openai_calculator_agent_records_the_driver_s_trajectory(tok, stream):
    agent = functools.partial(calculator_agent, stream=stream)
    eng_a, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], agent, group_size=1, index_offset=5, version=3)
    eng_d, [[ref]], ref_stats = _run_driver(tok, [ROW], index_offset=5, version=3)
    assert (ep.done, ep.reward, ep.truncation, ep.agent_failure) == (True, 1.0, None, None)
    _same_trajectory(ep.trajectory, ref.trajectory)
    # the same requests: ids, new-rows-only starts and seeds (turn k of global index 5)
    strip = [{k: r[k] for k in ("ids", "start", "seed", "out")} for r in eng_a.requests]
    assert strip == [{k: r[k] for k in ("ids", "start", "seed", "out")} for r in eng_d.requests]
    assert stats.metrics() == ref_stats.metrics()
    assert ep.final_text == ref.final_text == "<answer>97406785</answer>"


def _run_driver(tok, rows, **kw):
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    try:
        groups, stats = rollout_episodes(eng, rows, CalculatorEnv, SAMPLING, MultiTurnLimits(), **kw)
    finally:
        eng.close()
    return eng, groups, stats


def test_a_group_of_sessions_runs_at_once_with_the_driver_s_seeds(tok):
    rows = [ROW, ROW]
    eng, groups, stats = _sessions(tok, {Q1: SCRIPT1}, rows, calculator_agent, group_size=2)
    assert [[e.reward for e in g] for g in groups] == [[1.0, 1.0], [1.0, 1.0]]
    assert [[(e.trajectory.prompt_index, e.trajectory.sample_index) for e in g] for g in groups] == [
        [(0, 0), (0, 1)],
        [(1, 0), (1, 1)],
    ]
    seeds = {r["seed"] for r in eng.requests}
    assert len(seeds) == 12  # 4 sessions x 3 turns, no two alike (turn_seed of index, turn)
    assert stats.metrics()["rollout/turns_mean"] == 3.0


# ------------------------------------------------------------------------------------------- branches


def _summarising_agent(base_url, row, *, edit: bool = False):
    """Turn 1 calls the calculator; then the agent rewrites its history (summarises the call as a user
    message, or edits the assistant's text) before asking again."""
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    tools = [tool_schema()]
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
    assert first.tool_calls and first.tool_calls[0].function.name == "calculator"
    if edit:
        said = first.model_dump(exclude_none=True)
        said["content"] = "Let me think."  # the model wrote something else
        call = said["tool_calls"][0]
        messages += [said, {"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": "97406784"}]
    else:
        messages += [{"role": "user", "content": "The calculator says 123456 * 789 = 97406784."}]
    second = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
    return 1.0 if second.content else 0.0


@pytest.mark.parametrize("edit", [False, True], ids=["summarised", "edited"])
def test_a_history_that_departs_opens_a_branch_and_the_learner_trains_on_the_engine_s_ids(tok, edit):
    script = {Q1: [SCRIPT1[0], "<answer>97406785</answer>", "<answer>97406785</answer>"]}
    eng, [[ep]], stats = _sessions(tok, script, [ROW], functools.partial(_summarising_agent, edit=edit))
    assert (ep.branches, ep.reward, stats.metrics()["rollout/branches"]) == (1, 1.0, 1.0)
    t = ep.trajectory
    # the row is the second branch: its prompt is the departing history as the engine got it
    first, second = eng.requests
    assert t.turns == 1 and t.prompt_ids.tolist() == second["ids"] and second["start"] == 0
    _check_ids_are_the_engine_s([second], t)
    text = tok.decode(second["ids"])
    assert ("The calculator says" in text) != edit and ("Let me think." in text) == edit
    # the learner's batch row: exactly those ids, the loss on exactly the ids the engine generated
    b = rollout_batch([[episode_completion(ep)]], torch.zeros(1), pad_id=0)
    assert b["input_ids"][0].tolist() == second["ids"] + second["out"]
    assert b["input_ids"][0][b["loss_mask"][0]].tolist() == second["out"]
    assert torch.equal(b["sampler_logp"][0][b["loss_mask"][0]], t.model_segments[0].logprobs)


def test_on_departure_refuse_answers_409_and_counts(tok):
    seen = []

    def agent(base_url, row):
        try:
            _summarising_agent(base_url, row)
        except openai.ConflictError as e:
            seen.append(e.status_code)
            raise

    opts = EndpointOptions(timeout_s=20, on_departure="refuse", on_failure="zero")
    eng, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], agent, options=opts)
    assert seen == [409] and len(eng.requests) == 1
    assert (ep.branch_refusals, ep.branches, ep.agent_failure, ep.reward, ep.dropped) == (1, 0, "error", 0.0, False)
    m = stats.metrics()
    assert (m["rollout/branch_refusals"], m["rollout/agent_errors"], m["rollout/agent_dropped_frac"]) == (1, 1, 0)
    # "zero": the row trains (its mask kept), scored 0
    assert episode_completion(ep).output_mask.any()
