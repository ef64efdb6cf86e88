"""The "python" tool: the model writes a program, the sandbox runs it, the model reads what it printed.

Each call is a fresh process with an empty scratch directory (no state carries over between calls), the
standard library only, and no network. `run_python` never raises for anything the code does: a crash, a
limit or a sandbox that could not start comes back as text the model can read. A run that something outside
it ended (a SIGKILL to the sandbox's own processes; the job's stop signals are ignored by the sandbox) is
not the code's doing: it raises `ToolInterrupted`, and the trajectory is dropped, counted. So is a call the
sandbox refused to run because it could not isolate it (rollout.multi_turn.sandbox_isolation: require):
`ToolRefused`, counted besides as refused.

Host cost per call: one sandbox (docs/sandbox.md): 3 processes (boot, init, the code) plus what the code
forks, up to `max_processes`; up to `max_processes` x `memory_mb` of address space and `scratch_mb` of
RAM in its private tmpfs; one scratch directory on the host holding `main.py`, removed when the call ends.
How many run at once on an engine owner: `rollout.multi_turn.max_concurrent_tools`.
"""

from __future__ import annotations

import signal
from typing import Any

from megagrpo.envs import sandbox
from megagrpo.envs.answer import AnswerToolEnv
from megagrpo.envs.sandbox import SandboxConfig, SandboxResult
from megagrpo.envs.tools import Tool, ToolExecutor, ToolInterrupted, ToolOutput, ToolRefused

NAME = "python"
DESCRIPTION = (
    "Run a Python 3 program (standard library only, no network, no state between calls) and return what it "
    "prints to stdout. Print every value you need."
)
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "The complete program to run."}},
    "required": ["code"],
}
SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {"name": NAME, "description": DESCRIPTION, "parameters": PARAMETERS},
}

_STDERR_TAIL_CHARS = 1500  # the end of a traceback names the error; its start rarely helps the model


def run_python(code: str, cfg: SandboxConfig | None = None) -> str:
    """Run `code` in the sandbox and return the text the model sees: stdout, then one error line (and the
    end of stderr) if the program failed or hit a limit. Empty successful output reads "(no output)".
    Raises `ToolInterrupted` when something outside the run ended it (module doc)."""
    return python_call(code, cfg or SandboxConfig()).content


def python_call(code: str, cfg: SandboxConfig) -> ToolOutput:
    """`run_python`'s text, marked `unisolated` when the sandbox ran without some isolation (best-effort
    mode, docs/sandbox.md) so that the executor counts the call. Raises `ToolRefused` when, under require,
    the sandbox could not isolate this call and did not run it."""
    if not isinstance(code, str):
        return ToolOutput(f"Error: `code` must be a string, got {type(code).__name__}.")
    try:
        result = sandbox.run(code, cfg)
    except OSError as e:  # no scratch space, no interpreter: not the code's fault
        return ToolOutput(f"Error: the sandbox could not start: {e}")
    if result.refused:
        raise ToolRefused(
            f"the sandbox could not isolate it, so its code was not run: {'; '.join(result.notes)}"
        )
    if result.interrupted:
        raise ToolInterrupted(
            f"the sandbox's processes were killed from outside after {result.wall_seconds:.1f} s"
        )
    return ToolOutput(format_result(result, cfg), unisolated=bool(result.missing))


def format_result(r: SandboxResult, cfg: SandboxConfig) -> str:
    parts = [r.stdout] if r.stdout else []
    if r.truncated:
        parts.append(f"\n[output cut at {cfg.max_output_bytes} bytes]")
    error = _error_line(r, cfg)
    if error:
        tail = r.stderr.rstrip()[-_STDERR_TAIL_CHARS:]
        if tail and r.limit not in ("wall", "cpu", "output", "file_size"):
            parts.append(("\n" if parts else "") + tail)
        parts.append(("\n" if parts else "") + error)
    return "".join(parts) or "(no output)"


def _error_line(r: SandboxResult, cfg: SandboxConfig) -> str | None:
    messages = {
        "wall": f"stopped: wall-time limit of {cfg.wall_seconds:g} s",
        "cpu": f"stopped: CPU-time limit of {cfg.cpu_seconds} s",
        "memory": f"out of memory (limit {cfg.memory_mb} MB)",
        "output": f"stopped: output over {cfg.max_output_bytes} bytes",
        "file_size": f"stopped: a file grew past {cfg.max_file_mb} MB",
        "processes": f"too many processes (limit {cfg.max_processes})",
    }
    if r.limit:
        return f"Error: {messages[r.limit]}."
    if r.signal is not None:
        try:
            name = signal.Signals(r.signal).name
        except ValueError:  # a real-time signal without a name
            name = f"signal {r.signal}"
        return f"Error: killed by {name}."
    if r.exit_code:
        return f"Error: exited with code {r.exit_code}."
    return None


def python_tool(cfg: SandboxConfig | None = None) -> Tool:
    """The tool for `ToolExecutor`. Its deadline leaves the sandbox time to kill the run and clean up, so
    the sandbox's own wall limit, not the executor's, is what ends a long program."""
    cfg = cfg or SandboxConfig()
    return Tool(
        name=NAME,
        description=DESCRIPTION,
        parameters=PARAMETERS,
        fn=lambda code: python_call(code, cfg),
        timeout_s=cfg.wall_seconds + 5.0,
    )


PYTHON_SYSTEM_PROMPT = (
    "Solve the problem. You can run Python programs with the python tool; print what you need. Give the "
    "final answer as <answer>ANSWER</answer>."
)


# The boot process and the PID namespace's init: two Python interpreters with the preloaded modules.
SANDBOX_OVERHEAD_MB = 64


class PythonEnv(AnswerToolEnv):
    """Questions worked out with the sandboxed python tool (`AnswerToolEnv`'s rules); the sandbox limits
    are `SandboxConfig`'s fields (docs/sandbox.md says what they isolate). `sandbox_config` is what the
    trainer probes at start (`trainer.episodes.check_multi_turn`, rollout.multi_turn.sandbox_isolation).
    Per trajectory an executor of its own; the trainer gives them its owner's shared `ToolSlots`."""

    def __init__(
        self,
        max_turns: int = 4,
        question_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str = PYTHON_SYSTEM_PROMPT,
        max_result_chars: int = 4000,
        cpu_seconds: int = 5,
        wall_seconds: float = 10.0,
        memory_mb: int = 512,
        max_processes: int = 16,
        scratch_mb: int = 64,
    ) -> None:
        cfg = SandboxConfig(
            cpu_seconds=cpu_seconds,
            wall_seconds=wall_seconds,
            memory_mb=memory_mb,
            max_processes=max_processes,
            scratch_mb=scratch_mb,
        )
        self.sandbox_config = cfg
        super().__init__(
            ToolExecutor([python_tool(cfg)], cfg.wall_seconds + 5.0, max_result_chars),
            max_turns=max_turns,
            question_key=question_key,
            answer_key=answer_key,
            system_prompt=system_prompt,
        )

    @staticmethod
    def host_bytes_per_call(memory_mb: int = 512, scratch_mb: int = 64, **_: object) -> int:
        """Host memory one running call holds, for the memory plan's host side (`plan/host.py`): the code's
        memory limit, its private tmpfs (RAM), and the boot and init processes. A program that forks can
        hold more (`memory_mb` is per process, up to `max_processes` of them; docs/sandbox.md)."""
        return (memory_mb + scratch_mb + SANDBOX_OVERHEAD_MB) << 20
