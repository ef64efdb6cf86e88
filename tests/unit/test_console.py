"""megagrpo.console: known-harmless library messages are hidden, in the process and in its spawned
children; unknown ones still show; verbose shows everything.

Each case runs in a fresh interpreter, because warning filters and logger filters are process-wide
(and pytest records warnings its own way)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from megagrpo.console import KNOWN_LOG_RECORDS, KNOWN_WARNINGS, warn_option

KNOWN = KNOWN_WARNINGS[0]  # Transformer Engine and Apex ... from megatron.core.optimizer
RECORD = KNOWN_LOG_RECORDS[1]  # GPTModel IS DEPRECATED ... from megatron.core.models.gpt.gpt_model

EMIT = textwrap.dedent(
    f"""
    import logging, warnings
    def emit(tag):
        # as the library does it: the message from the module that owns it
        warnings.warn_explicit({KNOWN.message!r} + ". Falling back", {KNOWN.category.__name__}, "f.py", 1,
                               module={KNOWN.module!r}, registry={{}})
        # same text from another module, and an unknown text from the known module: both still show
        warnings.warn_explicit({KNOWN.message!r} + " (elsewhere)", UserWarning, "g.py", 2, module="mylib",
                               registry={{}})
        warnings.warn_explicit("UNKNOWN-WARNING " + tag, UserWarning, "f.py", 3, module={KNOWN.module!r},
                               registry={{}})
        log = logging.getLogger({RECORD.logger!r})
        log.warning({RECORD.message!r} + ". GPTModel is only accepting critical bug fixes")
        log.warning("UNKNOWN-RECORD " + tag)
        import fakens.escape  # compiled in each process (-B): a SyntaxWarning from a known file
    """
)

SCRIPT = EMIT + textwrap.dedent(
    """
    import multiprocessing as mp, sys
    def child():
        import megagrpo.console as console
        console.quiet_child()  # what megagrpo.compat.sglang_cpu does in a spawned SGLang process
        emit("child")

    if __name__ == "__main__":
        import megagrpo.console as console
        console.KNOWN_SYNTAX_WARNINGS = (("invalid escape sequence", "fakens", "escape"),)
        console.quiet_known_noise(verbose=sys.argv[1] == "verbose")
        emit("parent")
        p = mp.get_context("spawn").Process(target=child)
        p.start(); p.join()
        sys.exit(p.exitcode)
    """
)


def run_script(tmp_path, mode: str) -> str:
    path = tmp_path / "emit.py"
    path.write_text(SCRIPT)
    (tmp_path / "fakens").mkdir()  # a namespace package, as megatron is
    (tmp_path / "fakens" / "escape.py").write_text('DOC = "\\-"\n')
    r = subprocess.run(
        [sys.executable, "-B", str(path), mode], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_known_messages_are_hidden_in_the_process_and_its_children_unless_verbose(tmp_path, mode):
    out = run_script(tmp_path, mode)
    for tag in ("parent", "child"):
        assert f"UNKNOWN-WARNING {tag}" in out and f"UNKNOWN-RECORD {tag}" in out, out
    assert out.count(KNOWN.message + " (elsewhere)") == 2, out  # the same words from another module
    shown = 2 if mode == "verbose" else 0
    assert out.count(KNOWN.message + ". Falling back") == shown, out
    assert out.count(RECORD.message) == shown, out
    assert out.count("SyntaxWarning: invalid escape sequence") == shown, out


def test_every_known_warning_is_a_valid_minus_w_option():
    """A ':' in a message or an unknown category would make the child print 'Invalid -W option'."""
    opts = [f"-W{warn_option(w)}" for w in KNOWN_WARNINGS]
    r = subprocess.run([sys.executable, *opts, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert all(":" not in w.message and w.why for w in KNOWN_WARNINGS)
    assert all(r.why for r in KNOWN_LOG_RECORDS)
