"""Issue 25, item 15: a user error found inside the ranks of `megagrpo train --nproc 2` is printed once,
without torchrun's failure report or a traceback, and exits 2 as a single process does.

`megagrpo.cli.main` runs in this process and starts torchrun with two real ranks. The ranks must find the
error themselves, so this process's own check of the stage inputs is switched off: a routing replay on a
dense model, given as an override after `--resume` (so the ranks also show that both reach them), is
then found by each rank's check. The ranks stop before any process group, learner or engine starts.
"""

from __future__ import annotations

import yaml

from megagrpo.cli import main


def test_a_user_error_inside_the_ranks_prints_once_and_exits_2(tiny_model, tmp_path, monkeypatch, capfd):
    dense = tiny_model("qwen3")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump({"model": {"hf_path": str(dense)}, "checkpoint": {"dir": str(tmp_path / "ckpt")}})
    )
    monkeypatch.setattr("megagrpo.trainer.preflight.check_stage_inputs", lambda *a, **k: None)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capfd.readouterr()
    rc = main(["train", str(cfg), "--nproc", "2", "--resume", "none", "replay=R3"])
    err = capfd.readouterr().err
    assert rc == 2, err[-4000:]
    message = f"megagrpo: error: replay: R3 replays MoE routing, but model.hf_path={str(dense)!r} is a dense"
    assert err.count("megagrpo: error:") == 1 and message in err, err[-4000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-4000:]
    assert "failed (exitcode" not in err and "closing signal" not in err, err[-4000:]  # torchrun's report
