"""The code sandbox and the python tool: each way model-written code can misbehave is stopped or refused,
and the test process (the trainer) is left as it was, with no process of the run left behind."""

import glob
import os
import resource
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest

from megagrpo.envs import python_tool, sandbox
from megagrpo.envs.sandbox import SandboxConfig
from megagrpo.errors import MegagrpoError

ROOT = os.geteuid() == 0
# Small limits keep each case short; the wall limits leave room for a loaded 2-core machine.
CFG = SandboxConfig(
    cpu_seconds=1, wall_seconds=8, memory_mb=256, max_processes=8, max_file_mb=4, max_output_bytes=4096
)


def _sandbox_processes(uid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids", "status"]):
        uids = p.info["uids"]
        if uids and uid in (uids.real, uids.effective) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def _run(code: str, cfg: SandboxConfig = CFG) -> sandbox.SandboxResult:
    """Run and check what every run must leave behind: nothing (no process, no scratch, no cgroup)."""
    rlimits = {r: resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC)}
    cwd, env = os.getcwd(), dict(os.environ)
    r = sandbox.run(code, cfg)
    assert not os.path.exists(r.scratch_dir)
    assert not glob.glob(f"/sys/fs/cgroup/pids/**/megagrpo-sandbox-{os.getpid()}-*", recursive=True)
    if ROOT:
        assert r.uid >= 1 << 20 and r.uid != os.getuid()
        assert _sandbox_processes(r.uid) == []
    assert {r: resource.getrlimit(r) for r in rlimits} == rlimits
    assert (os.getcwd(), dict(os.environ)) == (cwd, env)
    return r


def test_runs_code_in_an_empty_scratch_with_a_scrubbed_environment(monkeypatch):
    monkeypatch.setenv("MEGAGRPO_TEST_SECRET", "hunter2-credential")
    r = _run(
        "import os, sys\n"
        "print(sorted(os.listdir('.')), os.getcwd() == os.environ['HOME'])\n"
        "print(sorted(os.environ))\n"
        "print(os.environ.get('MEGAGRPO_TEST_SECRET'))\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except PermissionError:\n    print('trainer environ: denied')\n"
        "sys.exit(3)\n"
    )
    assert r.exit_code == 3 and r.limit is None and r.signal is None and not r.ok
    lines = r.stdout.splitlines()
    assert lines[0] == "['main.py'] True"
    assert lines[1] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    assert lines[2] == "None"
    if ROOT:  # the code runs as another uid, so /proc does not show it the trainer's environment
        assert lines[3] == "trainer environ: denied"
    assert "hunter2" not in r.stdout and "MEGAGRPO_TEST_SECRET" not in r.stdout


def test_endless_loop_is_stopped_by_the_cpu_limit_and_sleep_by_the_wall_limit():
    # 1 CPU second against 30 wall seconds: the CPU limit is hit first even on a loaded machine
    r = _run("while True:\n    pass\n", SandboxConfig(cpu_seconds=1, wall_seconds=30))
    assert r.limit == "cpu" and r.signal in (signal.SIGXCPU, signal.SIGKILL)
    cfg = SandboxConfig(wall_seconds=1.5, cpu_seconds=5)
    r = _run("import time\nprint('started', flush=True)\ntime.sleep(600)\n", cfg)
    assert r.limit == "wall" and r.signal == signal.SIGKILL and r.exit_code is None
    assert r.stdout == "started\n"  # what was printed before the kill is kept
    assert 1.5 <= r.wall_seconds < 5


def test_allocating_10_gb_is_refused_by_the_memory_limit():
    r = _run("x = bytearray(10 * 1024**3)\nprint('allocated')\n")
    assert r.limit == "memory" and r.exit_code == 1
    assert "allocated" not in r.stdout and r.stderr.rstrip().endswith("MemoryError")


def test_a_fork_bomb_is_contained_and_leaves_no_process():
    r = _run("import os\nwhile True:\n    os.fork()\n")
    assert r.limit == "processes" and "BlockingIOError" in r.stderr

    # A bomb that swallows the errors runs until the wall limit; count its processes while it runs.
    peak: dict[int, int] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            counts: dict[int, int] = {}
            for p in psutil.process_iter(["uids"]):
                if p.info["uids"] and p.info["uids"].real >= 1 << 20:
                    counts[p.info["uids"].real] = counts.get(p.info["uids"].real, 0) + 1
            for uid, n in counts.items():
                peak[uid] = max(peak.get(uid, 0), n)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    cfg = SandboxConfig(wall_seconds=2, cpu_seconds=5, max_processes=8)
    try:
        r = _run(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", cfg
        )
    finally:
        done.set()
        watcher.join()
    assert r.limit == "wall" and r.process_limit in ("cgroup+rlimit", "rlimit")
    if ROOT:
        assert 1 < peak.get(r.uid, 0) <= cfg.max_processes  # it did fork, and never past the limit
    assert subprocess.run(["true"], timeout=30).returncode == 0  # the trainer can still start processes


def test_children_that_leave_the_process_group_do_not_outlive_the_run():
    code = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(600)\n"
    r = _run(code)  # _run asserts that none of them is left
    assert r.exit_code == 0 and r.ok
    assert "PID namespace unavailable" not in " ".join(r.notes) or not ROOT


def test_writing_a_1_gb_file_is_stopped_by_the_file_size_limit():
    r = _run(
        "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * 2**20)\nprint('wrote')\n"
    )
    assert r.limit == "file_size" and r.signal == signal.SIGXFSZ and "wrote" not in r.stdout


def test_a_network_connection_is_refused_unless_the_network_is_allowed():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
    try:
        r = _run(code)
        if ROOT:  # CI runs as root, where a network namespace always works: assert it did
            assert r.network_isolated and r.notes == []
        if r.network_isolated:
            assert "connected" not in r.stdout and r.exit_code == 1
            with pytest.raises(BlockingIOError):
                server.accept()
        else:  # non-root on a kernel without user namespaces: never silently open
            assert any("network namespace unavailable" in n for n in r.notes)

        r = _run(code, SandboxConfig(network=True))  # the control: the same code does reach the server
        assert r.stdout == "connected\n" and not r.network_isolated
        server.setblocking(True)
        server.settimeout(5)
        server.accept()[0].close()
    finally:
        server.close()


def test_printing_100_mb_is_cut_without_deadlock():
    r = _run(
        "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\nprint('end', file=sys.stderr)\n"
    )
    assert r.limit == "output" and r.truncated
    assert r.stdout == "x" * CFG.max_output_bytes and "end" not in r.stderr
    assert r.wall_seconds < CFG.wall_seconds


def test_config_rejects_non_positive_limits():
    with pytest.raises(MegagrpoError, match=r"sandbox\.memory_mb must be > 0"):
        SandboxConfig(memory_mb=0)
    with pytest.raises(MegagrpoError, match=r"sandbox\.max_processes must be >= 2"):
        SandboxConfig(max_processes=1)


def test_python_tool_answers_the_model_in_text_and_never_raises(monkeypatch):
    assert python_tool.SCHEMA["function"]["name"] == "python"
    assert python_tool.SCHEMA["function"]["parameters"]["required"] == ["code"]
    assert python_tool.python_tool(CFG).schema() == python_tool.SCHEMA

    assert python_tool.run_python("print(6 * 7)", CFG) == "42\n"
    assert python_tool.run_python("x = 1", CFG) == "(no output)"
    text = python_tool.run_python("print('before')\n1 / 0\n", CFG)
    assert text.startswith("before\n") and "ZeroDivisionError" in text
    assert text.endswith("Error: exited with code 1.")
    text = python_tool.run_python("x = bytearray(10 * 1024**3)", CFG)
    assert text.endswith(f"Error: out of memory (limit {CFG.memory_mb} MB).")
    assert python_tool.run_python(None, CFG) == "Error: `code` must be a string, got NoneType."

    def no_sandbox(code, cfg):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sandbox, "run", no_sandbox)
    assert python_tool.run_python("print(1)", CFG).startswith("Error: the sandbox could not start")
