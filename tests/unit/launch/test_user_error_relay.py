"""`--nproc`: the CLI prints the failing rank's own error, not the other ranks' echoes of it."""

from __future__ import annotations

import time

from megagrpo.launch.torchrun import ERROR_DIR_ENV, first_user_error, leave_user_error


def test_a_ranks_own_error_wins_over_the_echoes_written_before_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    assert first_user_error(tmp_path) is None
    monkeypatch.setenv("RANK", "1")
    assert leave_user_error("rank 0 failed in the weight sync; its error is in that rank's log", echo=True)
    assert first_user_error(tmp_path).startswith("rank 0 failed")  # only an echo so far: it is printed
    time.sleep(0.01)
    monkeypatch.setenv("RANK", "0")
    assert leave_user_error("engine 0 (http://h:1, rank 2 on n2): an SGLang process of the server died")
    assert first_user_error(tmp_path).startswith("engine 0")


def test_among_own_errors_the_first_written_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    for rank, message in (("3", "first"), ("1", "second")):
        monkeypatch.setenv("RANK", rank)
        leave_user_error(message)
        time.sleep(0.01)
    assert first_user_error(tmp_path) == "first"


def test_outside_a_relayed_launch_nothing_is_left(tmp_path, monkeypatch):
    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    assert not leave_user_error("x")
