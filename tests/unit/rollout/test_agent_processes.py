"""Issue 43, part 3: command agents, as processes.

* when a session ends, its agent's whole process tree ends with it: a child in a session of its own
  (`setsid`) and an orphan of a double fork included, whatever the agent did;
* a finished agent whose child still holds its standard output returns at once, with its reward, not at
  its deadline as a timeout;
* the data row reaches the agent by a file (its stdin), so a row over the 128 KiB an environment variable
  may hold starts like any other;
* 150 sessions under `ulimit -n 256` all run (at most `agent.max_concurrent` at once) and leave no process
  behind; an agent that cannot start fails its own session, counted, and the rollout goes on;
* the agent's environment is the explicit set (`agent.env`) and its session's own key: the trainer's
  OPENAI_API_KEY and HF_TOKEN are not in it.

Real subprocesses against the scripted fake engine of test_multi_turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megagrpo.rollout.agents.endpoint import AgentRunner, EndpointOptions, rollout_sessions
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits
from tests.unit.rollout.test_multi_turn import SAMPLING, ScriptedEngine

REPO = Path(__file__).resolve().parents[3]
Q = "What is 2 + 2?"
ROW = {"prompt": Q}

# One request over the stdlib (so the agent starts in milliseconds), then whatever `LEAVE` leaves behind;
# prints {"reward": 1, ...} as its return.
AGENT = """\
import json, os, sys, urllib.request
row = json.load(sys.stdin)
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": row["prompt"]}]}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body,
                             {"Content-Type": "application/json",
                              "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
reply = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"]
LEAVE
print(json.dumps({"reward": 1, "blob": len(row.get("blob", "")), "key": os.environ.get("OPENAI_API_KEY"),
                  "hf": "HF_TOKEN" in os.environ, "env": sorted(os.environ)}), flush=True)
"""


@pytest.fixture(scope="module")
def tok():
    from megagrpo.tiny_model import train_tokenizer

    return train_tokenizer(1024)


def _agent(tmp_path: Path, leave: str = "") -> AgentRunner:
    script = tmp_path / "agent.py"
    script.write_text(AGENT.replace("LEAVE", textwrap.dedent(leave)))
    return AgentRunner(command=f"{sys.executable} -I -S {script}")


OPTS = EndpointOptions(timeout_s=60)


def _rollout(tok, runner, rows=(ROW,), options=OPTS):
    eng = ScriptedEngine(tok, {Q: ["4"]})
    try:
        return rollout_sessions(eng, list(rows), runner, SAMPLING, MultiTurnLimits(), options=options)
    finally:
        eng.close()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


LEAVES_TWO = """
import subprocess, time
pids = open(os.environ["PIDS"], "a")
# a child in a session of its own, then an orphan: its parent exits at once, so init (or a subreaper) gets it
s = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL)
pids.write(f"{s.pid}\\n")
r, w = os.pipe()
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        os.write(w, str(os.getpid()).encode())
        os.execvp("sleep", ["sleep", "300"])
    os._exit(0)
pids.write(os.read(r, 32).decode() + "\\n")
pids.close()
"""


@pytest.mark.parametrize("ends", ["returns", "times_out"])
def test_a_session_ends_its_agent_s_whole_process_tree(tok, tmp_path, monkeypatch, ends):
    pids = tmp_path / "pids"
    monkeypatch.setenv("PIDS", str(pids))
    runner = _agent(tmp_path, LEAVES_TWO + ("time.sleep(120)\n" if ends == "times_out" else ""))
    runner.env = (*runner.env, "PIDS")
    t0 = time.monotonic()
    [[ep]], _ = _rollout(tok, runner, options=EndpointOptions(timeout_s=10))
    assert time.monotonic() - t0 < 40
    if ends == "returns":
        assert (ep.agent_failure, ep.reward) == (None, 1.0)
    else:
        assert (ep.agent_failure, ep.reward, ep.dropped) == ("timeout", 0.0, True)
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2
    assert [p for p in left if _alive(p)] == []


LEAVES_STDOUT = """
import subprocess
# a child that keeps the agent's standard output open after the agent has returned
open(os.environ["PIDS"], "w").write(str(subprocess.Popen(["sleep", "300"]).pid))
"""


def test_a_finished_agent_whose_child_holds_its_stdout_returns_at_once(tok, tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    monkeypatch.setenv("PIDS", str(pids))
    runner = _agent(tmp_path, LEAVES_STDOUT)
    runner.env = (*runner.env, "PIDS")
    t0 = time.monotonic()
    [[ep]], stats = _rollout(tok, runner, options=EndpointOptions(timeout_s=30))
    assert time.monotonic() - t0 < 20  # not its 30 s budget
    assert (ep.agent_failure, ep.reward) == (None, 1.0) and stats.metrics()["rollout/agent_timeouts"] == 0
    assert not _alive(int(pids.read_text()))


def test_a_row_over_128_kib_reaches_its_agent(tok, tmp_path):
    row = {**ROW, "blob": "x" * 200_000}  # execve's limit on one environment string is 128 KiB
    [[ep]], _ = _rollout(tok, _agent(tmp_path), rows=[row])
    assert (ep.agent_failure, ep.reward, ep.info["blob"]) == (None, 1.0, 200_000)


def test_the_agent_gets_an_explicit_environment_and_its_session_s_key(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-trainer-s-real-key")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    [[ep]], _ = _rollout(tok, _agent(tmp_path))
    assert ep.agent_failure is None
    assert ep.info["key"] != "sk-the-trainer-s-real-key" and len(ep.info["key"]) >= 32 and not ep.info["hf"]
    allowed = {
        "PATH",
        "HOME",
        "USER",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "VIRTUAL_ENV",
    }
    session = {"OPENAI_API_KEY", "OPENAI_BASE_URL", "MEGAGRPO_BASE_URL", "MEGAGRPO_ROW_FILE", "LC_CTYPE"}
    assert set(ep.info["env"]) <= allowed | session  # (Python adds LC_CTYPE under a C locale)
    # a variable named in agent.env is passed
    monkeypatch.setenv("MY_TOOL_URL", "http://tools")
    runner = _agent(tmp_path, 'assert os.environ["MY_TOOL_URL"] == "http://tools"')
    runner.env = (*runner.env, "MY_TOOL_URL")
    [[ep]], _ = _rollout(tok, runner)
    assert (ep.agent_failure, ep.reward) == (None, 1.0)


def test_an_agent_that_cannot_start_fails_its_own_session(tok, tmp_path):
    """Its program is gone when its session starts (it was there when the run was checked): that session
    fails, counted, and the others run."""
    gone = tmp_path / "gone-agent"
    gone.write_text("#!/bin/sh\necho 1\n")
    gone.chmod(0o755)
    runner = AgentRunner(command=str(gone))
    gone.unlink()
    [[ep]], stats = _rollout(tok, runner)
    assert (ep.agent_failure, ep.dropped) == ("start", True)
    assert stats.metrics()["rollout/agent_start_failures"] == 1.0


UNDER_ULIMIT = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from megagrpo.tiny_model import train_tokenizer
from megagrpo.rollout.agents.endpoint import AgentRunner, EndpointOptions, rollout_sessions
from megagrpo.rollout.episodes.multi_turn import MultiTurnLimits
from tests.unit.rollout.test_multi_turn import SAMPLING, ScriptedEngine

tok = train_tokenizer(1024)
runner = AgentRunner(command=sys.argv[1])
runner.env = (*runner.env, "PIDS")
out = {}
for phase, n, limit in (("ulimit 256", 150, None), ("no descriptor left", 3, 3)):
    eng = ScriptedEngine(tok, {"What is 2 + 2?": ["4"]})
    if limit is not None:  # as good as none: every session's start fails
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + limit, 256))
    groups, stats = rollout_sessions(eng, [{"prompt": "What is 2 + 2?"}], runner, SAMPLING, MultiTurnLimits(),
                                     options=EndpointOptions(timeout_s=120), group_size=n)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    eng.close()
    out[phase] = [[e.reward, e.agent_failure] for e in groups[0]], stats.metrics()["rollout/agent_start_failures"]
print(json.dumps(out))
"""

LEAVES_ONE = """
s = __import__("subprocess").Popen(["sleep", "300"], start_new_session=True, stdout=-3)
with open(os.environ["PIDS"], "a") as f:
    f.write(f"{s.pid}\\n")
"""


def test_150_sessions_under_ulimit_256_run_and_leave_nothing_behind(tmp_path):
    """The issue's trial: all 150 sessions were lost to EMFILE and 162 processes outlived them."""
    pids = tmp_path / "pids"
    script = tmp_path / "rollout.py"
    script.write_text(UNDER_ULIMIT)
    runner = _agent(tmp_path, LEAVES_ONE)
    env = {**os.environ, "PIDS": str(pids), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(script), " ".join(runner.argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    sessions, starts = out["ulimit 256"]
    assert sessions == [[1.0, None]] * 150 and starts == 0
    sessions, starts = out["no descriptor left"]
    assert sessions == [[0.0, "start"]] * 3 and starts == 3
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 150 and [p for p in left if _alive(p)] == []


def test_the_config_names_what_a_command_agent_gets():
    from megagrpo.config.schema import AGENT_ENV_DEFAULT, MultiTurnConfig
    from megagrpo.trainer.episodes import agent_runner

    mt = MultiTurnConfig(enabled=True, agent={"command": f"{sys.executable} -c pass"})
    assert agent_runner(mt).env == AGENT_ENV_DEFAULT and "HF_TOKEN" not in AGENT_ENV_DEFAULT
    mt = MultiTurnConfig(
        enabled=True, agent={"command": f"{sys.executable} -c pass", "env": ["PATH", "MY_TOOL_URL"]}
    )
    assert agent_runner(mt).env == ("PATH", "MY_TOOL_URL")
    with pytest.raises(ValueError, match=r"not variable names; list names \(PATH, HOME\), not NAME=value"):
        MultiTurnConfig(enabled=True, agent={"command": "python", "env": ["OPENAI_API_KEY=sk-1"]})
