import json
import math
import signal

import torch

from megagrpo.trainer.health import HealthConfig, health_warnings
from megagrpo.trainer.metrics import MetricsLogger, console_line, read_jsonl
from megagrpo.trainer.report import write_report
from megagrpo.trainer.signals import StopRequest


def test_jsonl_tensorboard_and_truncate(tmp_path):
    log = MetricsLogger(tmp_path)
    for s in range(1, 5):
        log.log(
            s, {"reward/mean": torch.tensor(0.1 * s), "loss/policy": s, "vec": torch.ones(3), "nan": math.nan}
        )
    log.truncate_after(2)
    log.log(3, {"reward/mean": 9.0})
    log.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert abs(recs[1]["reward/mean"] - 0.2) < 1e-7 and recs[2]["reward/mean"] == 9.0
    assert "vec" not in recs[0] and recs[0]["nan"] is None
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_report_png_and_md(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(6):
            f.write(
                json.dumps(
                    {"step": s, "reward/mean": s / 6, "eval/accuracy": s / 10, "loss/entropy": 1 - s / 10}
                )
                + "\n"
            )
    png, md = write_report(tmp_path, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "| `reward/mean` | 0 | 0.8333 |" in text and "eval/accuracy" in text


def test_console_line_only_known_present_keys():
    line = console_line(7, {"reward/mean": 0.5, "loss/entropy": 1.25, "other": 3.0})
    assert line == "step 7  reward=0.5  ent=1.25"


def test_health_warnings():
    cfg = HealthConfig(window=2)
    healthy = [
        {
            "loss/entropy": 1.0,
            "rollout/response_len_mean": 10,
            "reward/mean": 0.1 * i,
            "loss/clip_frac_high": 0.01,
        }
        for i in range(4)
    ]
    assert health_warnings(healthy, cfg) == []
    sick = [
        {"loss/entropy": e, "rollout/response_len_mean": n, "reward/mean": 0.3, "loss/clip_frac_high": c}
        for e, n, c in [(1, 10, 0.0), (1, 10, 0.0), (0.2, 40, 0.2), (0.2, 40, 0.2)]
    ]
    w = health_warnings(sick, cfg)
    assert len(w) == 3 and w[0].startswith("entropy collapsing") and "length" in w[1] and "clip" in w[2]


def test_stop_request_on_sigusr1():
    stop = StopRequest().install()
    try:
        assert not stop.requested
        signal.raise_signal(signal.SIGUSR1)
        assert stop.requested and stop.name() == "SIGUSR1"
    finally:
        stop.uninstall()


def test_report_shows_the_lag_histogram_of_an_async_run(tmp_path):
    from megagrpo.trainer.report import lag_histogram

    recs = [
        {"step": 1, "rollout/completions": 8.0, "rollout/lag_0_frac": 1.0, "rollout/lag_1_frac": 0.0},
        {"step": 2, "rollout/completions": 24.0, "rollout/lag_0_frac": 0.25, "rollout/lag_1_frac": 0.75},
    ]
    assert lag_histogram(recs) == {0: (8 + 6) / 32, 1: 18 / 32}
    assert lag_histogram([{"step": 1, "reward/mean": 0.5}]) == {}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({**r, "reward/mean": 0.5}) + "\n" for r in recs)
    png, md = write_report(tmp_path, title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "Policy lag of trained completions: 0: 43.8%, 1: 56.2%" in md.read_text()
