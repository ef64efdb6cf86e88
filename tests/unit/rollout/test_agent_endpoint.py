"""The OpenAI-compatible agent endpoint (`rollout.agents.endpoint`, `rollout.agents.session`) against the
scripted fake engine of test_multi_turn, with agents written against the real `openai` client:

* the calculator agent records, token for token, the trajectory the built-in driver records for the same
  conversation (ids, masks, logprobs, versions, routes new-rows-only, seeds), streamed or not;
* an agent that rewrites its history opens a branch: the learner's row is ids the engine saw, with the loss
  on exactly the ids it generated; every branch trains, with its session's advantage; with
  on_departure=refuse the request is answered 409;
* faults: an agent that hangs, crashes, sends a malformed request, or sends no token ends its session
  within its budget, counted, and the rollout completes; a request after its session ended gets 410;
  a command agent runs with its base URL in its environment.
"""

from __future__ import annotations

import functools
import sys
import time

import httpx
import openai
import pytest
import torch

from megagrpo.envs.calculator import DEFAULT_SYSTEM_PROMPT, CalculatorEnv
from megagrpo.envs.calculator_agent import run as calculator_agent
from megagrpo.envs.calculator_agent import tool_schema
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.agents.endpoint import AgentRunner, EndpointOptions, rollout_sessions
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits, rollout_episodes
from megagrpo.trainer.batch import rollout_batch
from megagrpo.trainer.episodes import episode_completion
from tests.unit.rollout.test_multi_turn import Q1, SAMPLING, SCRIPT1, ScriptedEngine, _call

ROW = {"prompt": Q1, "answer": "97406785"}


@pytest.fixture(scope="module")
def tok():
    from megagrpo.tiny_model import train_tokenizer

    return train_tokenizer(1024)


OPTS = EndpointOptions(timeout_s=300)  # only the hang tests time out


def _sessions(tok, scripts, rows, agent, options=OPTS, **kw):
    eng = ScriptedEngine(tok, scripts)
    try:
        runner = agent if isinstance(agent, AgentRunner) else AgentRunner(agent)
        groups, stats = rollout_sessions(
            eng, rows, runner, SAMPLING, MultiTurnLimits(), options=options, **kw
        )
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
    eng_a, [[ep]], stats = _sessions(
        tok, {Q1: SCRIPT1}, [ROW], agent, group_size=1, index_offset=5, version=3
    )
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
        messages += [
            said,
            {"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": "97406784"},
        ]
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


def _answers_zero(base_url, row):
    _one_request(base_url, row)
    return 0.0


def test_every_branch_of_a_session_trains_with_the_session_s_advantage(tok):
    """A group of G = 3 sessions, one of which branches: both of its branches reach the learner's batch,
    each with the loss on exactly the ids the engine generated in that branch, and both with the session's
    advantage; the group's advantages are those of its 3 sessions, as without the branch."""
    from megagrpo.algo.advantages import group_advantages
    from megagrpo.rollout.prompt_group import PromptGroup
    from megagrpo.trainer.episodes import episode_rows
    from megagrpo.trainer.grpo import local_batch
    from tests.unit.trainer.test_branch_rows import step_rows

    q2 = "What is 2 + 2?"
    script = {Q1: [SCRIPT1[0], "<answer>97406785</answer>", "<answer>97406785</answer>"], q2: ["4"]}
    rows = [{**ROW, "kind": "branch"}, {"prompt": q2, "kind": "one"}, {"prompt": q2, "kind": "zero"}]
    agents = {"branch": _summarising_agent, "one": _one_request, "zero": _answers_zero}
    eng, groups, stats = _sessions(tok, script, rows, _by_kind(agents))
    eps = [g[0] for g in groups]  # three sessions of one prompt, sampled as three rows here
    assert [(e.branches, len(e.earlier)) for e in eps] == [(1, 1), (0, 0), (0, 0)]
    m = stats.metrics()
    # a session's counters hold all its branches: 2 model turns in the branching one, routes of both
    assert (m["rollout/branches"], m["rollout/turns_mean"]) == (1.0, 4 / 3)
    routes = sum(t.route_bytes_received for e in eps for t in (e.trajectory, *e.earlier))
    assert m["rollout/route_bytes_per_traj"] == routes / 3 and eps[0].earlier[0].route_bytes_received > 0
    group = PromptGroup(
        [1], completions=[episode_completion(e) for e in eps], branches=[episode_rows(e) for e in eps]
    )
    rewards = torch.tensor([[e.reward for e in eps]])
    adv = group_advantages(rewards, "grpo")
    assert adv[0, 0] > 0 and adv[0, 2] < 0
    step = step_rows([group], group_size=3)
    batch = local_batch(step, adv, rewards, pad_id=0)
    assert step.session.tolist() == [0, 0, 1, 2]
    first, second = (r for r in eng.requests if Q1 in tok.decode(r["ids"]))
    for rid, req in ((0, first), (1, second)):  # the branch opened first, then the session's own row
        i = step.local.tolist().index(rid)
        n = int(batch["seq_lens"][i])
        assert batch["input_ids"][i, :n].tolist() == req["ids"] + req["out"]
        assert batch["input_ids"][i][batch["loss_mask"][i]].tolist() == req["out"]
        assert batch["advantages"][i] == adv[0, 0]
    # the session advantages are the group's: the plain sessions' rows get theirs
    for rid, g in ((2, 1), (3, 2)):
        assert batch["advantages"][step.local.tolist().index(rid)] == adv[0, g]


def test_on_departure_refuse_answers_409_and_counts(tok):
    seen = []

    def agent(base_url, row):
        try:
            _summarising_agent(base_url, row)
        except openai.ConflictError as e:
            seen.append(e.status_code)
            raise

    opts = EndpointOptions(timeout_s=300, on_departure="refuse", on_failure="zero")
    eng, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], agent, options=opts)
    assert seen == [409] and len(eng.requests) == 1
    assert (ep.branch_refusals, ep.branches, ep.agent_failure, ep.reward, ep.dropped) == (
        1,
        0,
        "error",
        0.0,
        False,
    )
    m = stats.metrics()
    assert (m["rollout/branch_refusals"], m["rollout/agent_errors"], m["rollout/agent_dropped_frac"]) == (
        1,
        1,
        0,
    )
    # "zero": the row trains (its mask kept), scored 0
    assert episode_completion(ep).output_mask.any()


# --------------------------------------------------------------------------------------------- faults


def _by_kind(agents):
    """One agent per row, chosen by the row's "kind"."""
    return lambda base_url, row: agents[row["kind"]](base_url, row)


def _one_request(base_url, row):
    """One request without tools (no parser to build: quick on a loaded machine), and reward 1."""
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


def _hangs(base_url, row):
    _one_request(base_url, row)
    time.sleep(600)  # past any budget: the session ends at its deadline, this thread is left behind


def test_an_agent_that_hangs_is_ended_at_its_budget_counted_and_dropped(tok):
    rows = [{**ROW, "kind": "hang"}, {**ROW, "kind": "ok"}]
    t0 = time.monotonic()
    agent = _by_kind({"hang": _hangs, "ok": _one_request})
    _, [[hung], [ok]], stats = _sessions(
        tok, {Q1: SCRIPT1}, rows, agent, options=EndpointOptions(timeout_s=8.0)
    )
    assert time.monotonic() - t0 < 45  # the step ends at the budget, not when the agent does (600 s)
    assert (hung.agent_failure, hung.reward, hung.dropped, hung.trajectory.turns) == ("timeout", 0.0, True, 1)
    assert (ok.agent_failure, ok.reward, ok.dropped, ok.trajectory.turns) == (None, 1.0, False, 1)
    m = stats.metrics()
    assert (m["rollout/agent_timeouts"], m["rollout/agent_dropped_frac"]) == (1.0, 0.5)
    # the dropped row takes no loss (its reward, 0, stays in its group's baseline)
    assert not episode_completion(hung).output_mask.any() and episode_completion(ok).output_mask.any()


LATE: list = []


def _returns_then_asks(base_url, row):
    """Returns at once, and asks again from a thread once its session has ended."""
    import threading

    def late():
        time.sleep(0.5)
        try:
            _one_request(base_url, row)
        except openai.APIStatusError as e:
            LATE.append((e.status_code, e.message))

    _one_request(base_url, row)
    threading.Thread(target=late, daemon=True).start()
    return 0.5


def _late(base_url, row):
    time.sleep(2.0)  # keeps the rollout's server up while the other session's late request arrives
    return calculator_agent(base_url, row)


def test_a_request_after_its_session_ended_gets_410(tok):
    LATE.clear()
    rows = [{**ROW, "kind": "early"}, {**ROW, "kind": "late"}]
    agent = _by_kind({"early": _returns_then_asks, "late": _late})
    _, [[early], [late]], _ = _sessions(tok, {Q1: SCRIPT1}, rows, agent)
    assert len(LATE) == 1 and LATE[0][0] == 410 and "this session has ended" in LATE[0][1]
    assert (early.reward, early.trajectory.turns, late.reward) == (0.5, 1, 1.0)


def _crashes(base_url, row):
    _one_request(base_url, row)
    raise RuntimeError("the agent's own bug")


@pytest.mark.parametrize("on_failure", ["drop", "zero"])
def test_an_agent_that_crashes_ends_its_session_counted(tok, on_failure):
    opts = EndpointOptions(timeout_s=300, on_failure=on_failure)
    _, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], _crashes, options=opts)
    assert (ep.agent_failure, ep.reward, ep.dropped, ep.trajectory.turns) == (
        "error",
        0.0,
        on_failure == "drop",
        1,
    )
    assert stats.metrics()["rollout/agent_errors"] == 1.0
    assert episode_completion(ep).output_mask.any() == (on_failure == "zero")
    # reward: functions scores the row's text: a failed session's is empty, so it scores 0 there too
    assert episode_completion(ep).text == ""


def _malformed(base_url, row):
    """A body that is not JSON, then n=2, then a message without a role; then a good episode."""
    statuses = []
    with httpx.Client() as http:
        statuses.append(http.post(base_url + "/chat/completions", content=b"{not json").status_code)
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    for kw in ({"n": 2, "messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"content": "hi"}]}):
        try:
            client.chat.completions.create(model="m", **kw)
        except openai.BadRequestError as e:
            statuses.append(e.status_code)
    assert statuses == [400, 400, 400], statuses
    return calculator_agent(base_url, row)


def test_a_malformed_request_is_answered_400_and_counted(tok):
    _, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], _malformed)
    assert (ep.agent_failure, ep.reward, ep.bad_requests, ep.trajectory.turns) == (None, 1.0, 3, 3)
    assert stats.metrics()["rollout/agent_bad_requests"] == 3.0


def _no_token(base_url, row):
    """Calls the server without its session's token (the bare /v1, another token), then gives up."""
    root = base_url.split("/s/")[0]
    statuses = []
    for url in (root + "/v1", root + "/s/" + "x" * 32 + "/v1"):
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        except openai.NotFoundError as e:
            statuses.append(e.status_code)
    assert statuses == [404, 404]
    assert openai.OpenAI(base_url=base_url, api_key="k").models.list().data[0].object == "model"


def test_an_agent_that_sends_no_token_gets_404_and_its_empty_session_is_dropped(tok):
    eng, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], _no_token)
    assert eng.requests == [] and (ep.agent_failure, ep.reward, ep.dropped) == ("no_request", 0.0, True)
    c = episode_completion(ep)
    assert c.num_tokens == 2 and not c.output_mask.any()  # the placeholder row: no loss
    assert stats.metrics()["rollout/agent_no_request"] == 1.0


def test_a_command_agent_gets_its_url_and_row_and_its_stdout_is_the_reward(tok, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys\n"
        "from megagrpo.envs.calculator_agent import run\n"
        "assert os.environ['OPENAI_BASE_URL'] == os.environ['MEGAGRPO_BASE_URL']\n"
        "print('log line')\n"
        "row = json.load(sys.stdin)\n"
        "assert row == json.load(open(os.environ['MEGAGRPO_ROW_FILE']))\n"
        "print(json.dumps({'reward': run(os.environ['MEGAGRPO_BASE_URL'], row), 'x': 1,\n"
        "                  'torch': 'torch' in sys.modules}))\n"
    )  # an agent process that imports megagrpo.envs does not pay torch's import (megagrpo/rewards/__init__.py)
    runner = AgentRunner(command=f"{sys.executable} {script}")
    _, [[ep]], _ = _sessions(tok, {Q1: SCRIPT1}, [ROW], runner)
    assert (ep.agent_failure, ep.reward, ep.info, ep.trajectory.turns) == (
        None,
        1.0,
        {"x": 1, "torch": False},
        3,
    )
    crash = AgentRunner(command=f"{sys.executable} -c 'import sys; sys.exit(3)'")
    _, [[bad]], _ = _sessions(tok, {Q1: SCRIPT1}, [ROW], crash)
    assert (bad.agent_failure, bad.dropped) == ("error", True)  # a crash, whatever it sent


def test_a_command_agent_that_hangs_is_killed_at_its_budget(tok):
    runner = AgentRunner(command=f"{sys.executable} -c 'import time; time.sleep(60)'")
    t0 = time.monotonic()
    _, [[ep]], stats = _sessions(tok, {Q1: SCRIPT1}, [ROW], runner, options=EndpointOptions(timeout_s=1.0))
    assert time.monotonic() - t0 < 30 and ep.agent_failure == "timeout"  # not the 60 s it would sleep
    assert stats.metrics()["rollout/agent_timeouts"] == 1.0


def test_the_agent_is_checked_when_configured():
    with pytest.raises(MegagrpoError, match=r"agent.function: cannot import 'no_such_pkg.agent:run'"):
        AgentRunner("no_such_pkg.agent:run")
    with pytest.raises(MegagrpoError, match=r"does not take \(base_url, row"):
        AgentRunner(lambda url: 0)
    with pytest.raises(MegagrpoError, match=r"does not take"):
        AgentRunner(calculator_agent, options={"no_such_option": 1})
    with pytest.raises(MegagrpoError, match="set exactly one of function"):
        AgentRunner(calculator_agent, command="python")
    with pytest.raises(MegagrpoError, match="not an executable on PATH"):
        AgentRunner(command="no-such-agent-binary --x")
    AgentRunner("megagrpo.envs.calculator_agent:run", options={"max_turns": 2})


def test_max_turns_and_max_tokens_truncate_a_session_as_they_do_a_trajectory(tok):
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    try:
        [[ep]], stats = rollout_sessions(
            eng,
            [ROW],
            AgentRunner(calculator_agent),
            SAMPLING,
            MultiTurnLimits(max_turns=2),
            options=OPTS,
        )
    finally:
        eng.close()
    # the third request was refused (400); the agent stopped on it: a truncated row, not an agent failure
    assert (ep.truncation, ep.agent_failure, ep.reward, ep.trajectory.turns) == ("max_turns", None, None, 2)
    assert stats.metrics()["rollout/truncated_max_turns_frac"] == 1.0
    assert episode_completion(ep).finish_reason == "length"  # the overlong filter's mark
    eng_d, _, _ = _run_driver(tok, [ROW])
    n = len(eng_d.requests[0]["out"]) + 4  # a budget that ends inside the second turn
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    try:
        [[cut]], _ = rollout_sessions(
            eng,
            [ROW],
            AgentRunner(calculator_agent),
            SAMPLING,
            MultiTurnLimits(max_tokens=n + 20),
            options=OPTS,
        )
    finally:
        eng.close()
    assert (cut.truncation, cut.agent_failure) == ("max_tokens", None)
    assert cut.trajectory.num_tokens - cut.trajectory.prompt_ids.numel() <= n + 20


def test_the_config_names_the_agent_and_the_episode_sampler_runs_it(tok):
    from megagrpo.config.schema import MultiTurnConfig
    from megagrpo.rollout.prompt_group import PromptGroup
    from megagrpo.trainer.episodes import EpisodeSampler, check_multi_turn, row_check

    with pytest.raises(ValueError, match="and command are both set; name the agent by one of them"):
        MultiTurnConfig(enabled=True, agent={"function": "a:b", "command": "python"})
    with pytest.raises(ValueError, match="names an agent while rollout.multi_turn.enabled=false"):
        MultiTurnConfig(agent={"function": "a:b"})
    with pytest.raises(
        MegagrpoError, match=r"rollout.multi_turn.agent.function: cannot import 'no_such:run'"
    ):
        check_multi_turn(MultiTurnConfig(enabled=True, agent={"function": "no_such:run"}))
    mt = MultiTurnConfig(
        enabled=True,
        environment="no.such:Env",  # not used, nor imported, while an agent drives
        agent={"function": "megagrpo.envs.calculator_agent:run", "options": {"max_turns": 3}},
    )
    check_multi_turn(mt)
    assert row_check(mt) is None
    eng = ScriptedEngine(tok, {Q1: SCRIPT1})
    groups = [PromptGroup([1], sample=ROW)]
    try:
        [comps] = EpisodeSampler(mt).generate(eng, groups, SAMPLING, 2, 0, 4)
    finally:
        eng.close()
    assert groups[0].env_rewards == [1.0, 1.0] and len(comps) == 2
    assert sum(int(c.output_mask.sum()) for c in comps) == sum(len(r["out"]) for r in eng.requests)
    assert set(comps[0].output_versions[comps[0].output_mask].tolist()) == {4}
    assert EpisodeSampler.counts(groups)["multi_turn/trajectories"] == 2.0


def test_the_episode_sampler_gives_a_branching_session_a_row_per_branch(tok):
    from megagrpo.config.schema import MultiTurnConfig
    from megagrpo.rollout.prompt_group import PromptGroup
    from megagrpo.trainer.episodes import EpisodeSampler

    mt = MultiTurnConfig(
        enabled=True, agent={"function": "tests.unit.rollout.test_agent_endpoint:_summarising_agent"}
    )
    eng = ScriptedEngine(tok, {Q1: [SCRIPT1[0], "<answer>97406785</answer>", "<answer>97406785</answer>"]})
    groups = [PromptGroup([1], sample=ROW)]
    try:
        [comps] = EpisodeSampler(mt).generate(eng, groups, SAMPLING, 2, 0, 4)
    finally:
        eng.close()
    p = groups[0]
    assert len(comps) == 2 and p.env_rewards == [1.0, 1.0]  # the group's samples: its 2 sessions
    assert [len(b) for b in p.branches] == [1, 1] and [g for g, _ in p.rows()] == [0, 0, 1, 1]
    # every row's loss is on ids the engine generated: together, all of them, once each
    trained = sorted(x for _, c in p.rows() for x in c.output_ids[c.output_mask].tolist())
    assert trained == sorted(x for r in eng.requests for x in r["out"])


def test_an_agent_s_return_is_its_reward():
    from megagrpo.rollout.agents.endpoint import AgentFailed, agent_reward

    assert agent_reward(None) == (None, {})  # left to rewards.functions, or unscored
    assert agent_reward(True) == (1.0, {}) and agent_reward(2) == (2.0, {})
    assert agent_reward({"reward": 0.5, "turns": 3}) == (0.5, {"turns": 3})
    assert agent_reward({"turns": 3}) == (None, {"turns": 3})
    for bad in ("1.0", [1.0], {"reward": "high"}):
        with pytest.raises(AgentFailed) as e:
            agent_reward(bad)
        assert e.value.kind == "error"


def test_each_turn_records_the_policy_version_read_after_its_request(tok):
    versions = iter(range(7, 100))  # async mode: the weights may change between a session's turns
    _, [[ep]], _ = _sessions(tok, {Q1: SCRIPT1}, [ROW], calculator_agent, version=lambda: next(versions))
    got = [s.versions.unique().tolist() for s in ep.trajectory.model_segments]
    assert got == [[7], [8], [9]]
    assert set(ep.trajectory.versions[~ep.trajectory.loss_mask].tolist()) == {-1}


REASONED: list = []


def _reasoning_agent(base_url, row):
    """The calculator agent, keeping what each reply said in reasoning_content (streamed and not)."""
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    messages = [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": row["prompt"]},
    ]
    first = client.chat.completions.create(model="m", messages=messages, tools=[tool_schema()])
    said = first.choices[0].message.model_dump(exclude_none=True)
    REASONED.append((said.get("reasoning_content"), said.get("content"), len(said.get("tool_calls", []))))
    call = said["tool_calls"][0]
    messages += [said, {"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": "4"}]
    chunks = list(
        client.chat.completions.create(model="m", messages=messages, tools=[tool_schema()], stream=True)
    )
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    REASONED.append((reasoning, "".join(c.choices[0].delta.content or "" for c in chunks), 0))
    return 1.0


def test_reasoning_is_split_off_for_the_client_and_the_ids_are_the_driver_s():
    from megagrpo.tiny_model import train_tokenizer
    from tests.fixtures.qwen3 import qwen3_tokenizer

    qtok = qwen3_tokenizer(train_tokenizer(1024))
    q = "What is 2 + 2?"
    script = {q: ["<think>\nAdd.\n</think>\n\n" + _call("calculator", {"expression": "2+2"}),
                  "<think>\nIt is 4.\n</think>\n\n<answer>4</answer>"]}  # fmt: skip
    row, kw = (
        {"prompt": q, "answer": "4"},
        dict(reasoning_parser="qwen3", template_kwargs={"enable_thinking": True}),
    )
    REASONED.clear()
    eng, [[ep]], _ = _sessions(qtok, script, [row], _reasoning_agent, **kw)
    assert REASONED == [("\nAdd.\n", "", 1), ("\nIt is 4.\n", "\n\n<answer>4</answer>", 0)]
    d = ScriptedEngine(qtok, script)
    try:
        [[ref]], _ = rollout_episodes(d, [row], CalculatorEnv, SAMPLING, MultiTurnLimits(), **kw)
    finally:
        d.close()
    _same_trajectory(ep.trajectory, ref.trajectory)
    assert [r["ids"] for r in eng.requests] == [r["ids"] for r in d.requests]
