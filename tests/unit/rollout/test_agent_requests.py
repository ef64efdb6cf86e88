"""Issue 43, part 3: what an agent sends cannot buy it more than its limits, nor break its session.

* limits count over the session: an agent that branches on every request (it echoes each reply back with a
  newline) gets `max_turns` model turns, `max_tokens` tokens after prompts and `max_branches` rows over all
  its branches, not per branch; `megagrpo plan` counts the rows a session may train;
* a malformed request (numeric content parts, `function` as a string, a template's `raise_exception`, a
  tools entry without `function`) is answered 400 with OpenAI's error JSON before anything is generated,
  and counted;
* a reply the client never received (it went away while the engine generated) is taken back: it trains no
  row, and the client's retry is served as if it were the first request;
* a 100k-message history is refused (400, naming the limit) off the loop that serves every session.

Against the scripted fake engine of test_multi_turn, with agents on the real `openai` client or raw HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from megagrpo.rollout.agents.endpoint import AgentRunner, EndpointOptions, rollout_sessions
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits
from megagrpo.trainer.episodes import episode_rows
from tests.unit.rollout.test_multi_turn import SAMPLING, ScriptedEngine

REPO = Path(__file__).resolve().parents[3]
Q = "Echo the story back to me."
STORY = "The quick brown fox jumps over the lazy dog and a tiny model learns to add numbers. " * 5
OPTS = EndpointOptions(timeout_s=300)


@pytest.fixture(scope="module")
def tok():
    from megagrpo.tiny_model import train_tokenizer

    return train_tokenizer(1024)


LIMITS = MultiTurnLimits()


def _rollout(eng, agent, limits=LIMITS, options=OPTS, rows=({"prompt": Q},), **kw):
    try:
        return rollout_sessions(eng, list(rows), AgentRunner(agent), SAMPLING, limits, options=options, **kw)
    finally:
        eng.close()


# -------------------------------------------------------------------------------- limits per session


def _newline_echo(base_url, row):
    """Sends each reply back with a newline added, so every request departs from the recording and opens a
    branch; stops at the first refusal (or after 8 replies)."""
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(8):
        try:
            reply = client.chat.completions.create(model="m", messages=messages).choices[0].message
        except openai.BadRequestError:
            break
        messages += [
            {"role": "assistant", "content": reply.content + "\n"},
            {"role": "user", "content": "Again."},
        ]
    return 1.0


@pytest.mark.parametrize(
    ("limits", "max_branches", "truncation"),
    [
        (MultiTurnLimits(max_turns=2, max_tokens=300), 4, "max_turns"),  # the trial
        (MultiTurnLimits(max_turns=8, max_tokens=300), 8, "max_tokens"),
        (MultiTurnLimits(max_turns=8, max_tokens=4000), 3, "max_branches"),
    ],
    ids=["max_turns", "max_tokens", "max_branches"],
)
def test_a_session_that_branches_on_every_request_stays_within_its_limits(
    tok, limits, max_branches, truncation
):
    eng = ScriptedEngine(tok, {Q: [STORY] * 8})
    n_story = len(tok(STORY, add_special_tokens=False)["input_ids"]) + 1
    assert 8 * n_story > 2 * 300  # unbounded, the agent would get 8 untruncated rows of it
    opts = EndpointOptions(timeout_s=300, max_branches=max_branches)
    [[ep]], stats = _rollout(eng, _newline_echo, limits, opts)
    rows = [ep.trajectory, *ep.earlier]
    assert ep.truncation == truncation and ep.agent_failure is None
    assert sum(t.turns for t in rows) <= limits.max_turns and len(eng.requests) <= limits.max_turns
    assert sum(t.num_tokens - t.prompt_ids.numel() for t in rows) <= limits.max_tokens
    assert len(rows) <= min(max_branches, limits.max_turns) and ep.branches == len(rows) - 1
    # every row trains as truncated ("length": the overlong filter's mark), the session's own included
    assert all(c.finish_reason == "length" for c in episode_rows(ep))
    assert stats.metrics()[f"rollout/truncated_{truncation}_frac"] == 1.0


def test_the_plan_counts_the_rows_an_agent_session_may_train():
    """On a released model's config, an agent that may branch multiplies the step's rows by
    min(max_branches, max_turns): the micro-batches per rank and the rows in flight follow."""
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.config import load_config
    from megagrpo.plan.job import plan_memory
    from megagrpo.plan.memory import rows_wire_bytes, workload_from_config

    base: list[str] = []
    path = REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml"
    agent = ["rollout.multi_turn.enabled=true", "rollout.multi_turn.reward=functions",
             "rollout.multi_turn.agent.command=python"]  # fmt: skip
    plain = load_config(path, base, check_paths=False)
    cases = {
        (): 4,  # max_branches and max_turns, both 4 by default
        ("rollout.multi_turn.max_turns=6",): 4,
        ("rollout.multi_turn.max_turns=2",): 2,  # one model turn per branch at least
        ("rollout.multi_turn.agent.max_branches=1",): 1,
        ("rollout.multi_turn.agent.on_departure=refuse",): 1,
    }
    assert plain.rollout.multi_turn.rows_per_session == 1
    w0 = workload_from_config(plain, 16)
    for extra, rows in cases.items():
        cfg = load_config(path, [*base, *agent, *extra], check_paths=False)
        assert cfg.rollout.multi_turn.rows_per_session == rows
        w = workload_from_config(cfg, 16)
        r, m = cfg.rollout, cfg.mesh
        seqs = r.prompts_per_step * r.group_size * rows // cfg.algo.ppo_mini_batches
        per_rank = max(1, seqs // (16 // (m.tp * m.cp * m.pp)))
        assert w.micro_batches == max(1, -(-per_rank // cfg.schedule.micro_batch_size)) >= w0.micro_batches
        scores = max(1, len(cfg.rewards.functions))
        engines = 16 // r.engine_tp
        assert w.rows_in_flight == rows_wire_bytes(
            16, engines, r.prompts_per_step, r.group_size * rows, scores
        )
    agent_cfg = load_config(path, [*base, *agent], check_paths=False)
    four = workload_from_config(agent_cfg, 16)
    assert four.micro_batches > w0.micro_batches and four.rows_in_flight > w0.rows_in_flight
    # the released model's plan at the default settings carries them into the rollout phase's peak
    arch = arch_from_hf(REPO / "configs" / "models" / "Qwen3-30B-A3B")
    plan = plan_memory(agent_cfg, arch, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    assert plan.rows_in_flight == four.rows_in_flight and plan.workload.micro_batches == four.micro_batches


# ------------------------------------------------------------------------------------ bad requests

RAISES = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Conversation roles must be system, user, assistant or tool') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HI = {"role": "user", "content": Q}
MALFORMED = {
    "numeric content parts": {"messages": [{"role": "user", "content": [1, 2]}]},
    "numeric text": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "function as a string": {
        "messages": [
            HI,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c", "type": "function", "function": "f"}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "1"},
        ]
    },
    "raise_exception": {"messages": [HI, {"role": "critic", "content": "no"}]},
    "tools without function": {"messages": [HI], "tools": [{"type": "function"}]},
}
SEEN: dict[str, tuple[int, dict]] = {}


def _malformed_then_good(base_url, row):
    with httpx.Client(timeout=60) as http:
        for name, body in MALFORMED.items():
            r = http.post(base_url + "/chat/completions", json={"model": "m", **body})
            SEEN[name] = (r.status_code, r.json())
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    client.chat.completions.create(model="m", messages=[HI])
    return 1.0


def test_a_malformed_request_gets_400_and_openai_s_error_json_before_any_generation(tok):
    t = copy.deepcopy(tok)
    t.chat_template = RAISES
    eng = ScriptedEngine(t, {Q: ["Hello."]})
    SEEN.clear()
    [[ep]], stats = _rollout(eng, _malformed_then_good)
    for name, (status, body) in SEEN.items():
        err = body["error"]
        assert status == 400 and err["type"] == "invalid_request_error", (name, status, body)
        assert isinstance(err["message"], str) and err["code"], (name, body)
    assert "raise_exception" not in SEEN["raise_exception"][1]["error"]["message"]  # the template's words
    assert "Conversation roles must be" in SEEN["raise_exception"][1]["error"]["message"]
    assert len(eng.requests) == 1  # only the good request reached the engine
    assert (ep.bad_requests, ep.branches, ep.earlier, ep.trajectory.turns) == (5, 0, [], 1)
    assert stats.metrics()["rollout/agent_bad_requests"] == 5.0


class SlowEngine(ScriptedEngine):
    """Generates its first request slowly, so the client can go away while it does."""

    async def generate_turn(self, input_ids, sampling, **kw):
        if not self.requests:
            await asyncio.sleep(1.0)
        return await super().generate_turn(input_ids, sampling, **kw)


def _leaves_then_retries(base_url, row):
    """Sends a streamed request and closes its connection before the reply (a client timeout), then sends
    the request again, as the openai client's retry does."""
    u = urlsplit(base_url)
    body = httpx.Request(
        "POST", base_url + "/chat/completions", json={"model": "m", "messages": [HI], "stream": True}
    )
    with socket.create_connection((u.hostname, u.port)) as s:
        head = f"POST {u.path}/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body.content)}\r\n\r\n"
        s.sendall(head.encode() + body.content)
        time.sleep(0.3)  # the engine is generating
    time.sleep(1.5)  # the reply finds the client gone
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[HI], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    return 1.0 if text == "Hello." else 0.0


def test_a_reply_the_client_never_received_trains_no_row(tok):
    eng = SlowEngine(tok, {Q: ["Hello."]})
    [[ep]], stats = _rollout(eng, _leaves_then_retries)
    assert len(eng.requests) == 2  # the engine generated the unseen turn, and then the retry
    assert stats.metrics()["rollout/agent_undelivered"] == 1.0
    assert (ep.reward, ep.branches, ep.earlier, ep.trajectory.turns) == (1.0, 0, [], 1)
    # the row is the retry's: its ids and the seed of the session's first turn
    assert ep.trajectory.ids.tolist() == eng.requests[1]["ids"] + eng.requests[1]["out"]
    assert eng.requests[1]["seed"] == eng.requests[0]["seed"]
    assert len(episode_rows(ep)) == 0


LAG: list[float] = []


def _huge_history(eng):
    def agent(base_url, row):
        stop = threading.Event()

        async def ticker() -> None:  # the loop's longest stall while the request is handled
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.01)
                LAG.append(time.monotonic() - t - 0.01)

        history = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(100_000)
        ]
        body = json.dumps({"model": "m", "messages": [*history, HI]}).encode()  # before the clock starts
        asyncio.run_coroutine_threadsafe(ticker(), eng.loop)
        time.sleep(0.1)
        try:
            r = httpx.post(base_url + "/chat/completions", content=body, timeout=120)
            SEEN["huge"] = (r.status_code, r.json()["error"])
        finally:
            time.sleep(0.05)
            stop.set()
        return 0.0

    return agent


def test_a_100k_message_history_is_refused_without_holding_the_loop(tok):
    eng = ScriptedEngine(tok, {Q: ["Hello."]})
    LAG.clear()
    SEEN.clear()
    [[ep]], stats = _rollout(eng, _huge_history(eng))
    status, body = SEEN["huge"]
    assert status == 400 and "100001 messages" in body["message"] and "4096" in body["message"]
    assert eng.requests == [] and stats.metrics()["rollout/agent_bad_requests"] == 1.0
    assert max(LAG) < 1.0, max(LAG)  # the other sessions were served meanwhile
