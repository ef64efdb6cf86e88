"""The optional Weights & Biases sink (`logging.wandb`): values land in an offline run's files, a missing
wandb fails at validation with the fix, and a disabled sink never imports wandb."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from megagrpo.config import load_config
from megagrpo.config.schema import WandbConfig
from megagrpo.errors import MegagrpoError
from megagrpo.trainer.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "demo_qwen3_moe.yaml"


def offline_records(run_file: Path) -> list:
    """Every record of a `.wandb` file, read with wandb's own reader."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(run_file))
    out = []
    while (data := store.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        out.append(rec)
    return out


def test_offline_run_files_hold_the_logged_values(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is in requirements/lock-cpu.txt; run `make setup`")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    (tmp_path / "wandb_dir").mkdir()
    settings = WandbConfig(enabled=True, project="megagrpo-test", name="unit", tags=["unit", "cpu"])
    log = MetricsLogger(
        tmp_path / "run",
        tensorboard=False,
        wandb=settings,
        run_config={"algo": {"variant": "gspo"}},
        job_type="sft",
    )
    sent = {
        1: {"reward/mean": torch.tensor(0.25), "loss/policy": -1.5, "vec": torch.ones(3)},
        2: {"reward/mean": 0.75, "loss/policy": 2, "mismatch/kl": math.nan},
    }
    try:
        for step, metrics in sent.items():
            log.log(step, metrics)
    finally:
        log.close()
        wandb.teardown()

    (run_file,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb")
    assert not (tmp_path / "run" / "wandb").exists()  # WANDB_DIR wins over the run directory
    records = offline_records(run_file)
    history = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): item.value_json for item in rec.history.item}
            history[rec.history.step.num] = {
                k: json.loads(v) for k, v in row.items() if not k.startswith("_")
            }
    assert history[1] == {"reward/mean": 0.25, "loss/policy": -1.5}  # the tensor as a float, no vector
    assert history[2]["reward/mean"] == 0.75 and history[2]["loss/policy"] == 2
    assert math.isnan(history[2]["mismatch/kl"])
    assert sorted(history) == [1, 2]
    (run,) = [rec.run for rec in records if rec.WhichOneof("record_type") == "run"][:1]
    assert run.project == "megagrpo-test" and run.display_name == "unit" and run.job_type == "sft"
    assert list(run.tags) == ["unit", "cpu"]
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update
    }
    assert config["algo"] == {"variant": "gspo"}


def test_missing_wandb_fails_at_validation_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(MegagrpoError) as e:
        load_config(CONFIG, ["logging.wandb.enabled=true"], check_paths=False)
    assert "logging.wandb.enabled" in str(e.value) and "pip install wandb" in str(e.value)


def test_missing_wandb_fails_at_sink_start_with_the_fix(tmp_path, monkeypatch):
    """wandb gone after validation (another interpreter on the compute node): the sink names the fix."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    settings = WandbConfig.model_construct(
        enabled=True, project="p", entity=None, name=None, mode=None, tags=[]
    )
    with pytest.raises(MegagrpoError, match=r"logging\.wandb\.enabled.*pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=settings)


def test_disabled_sink_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import attempt would raise
    cfg = load_config(CONFIG, [], check_paths=False)
    assert cfg.logging.wandb.enabled is False
    log = MetricsLogger(tmp_path, tensorboard=False, wandb=cfg.logging.wandb, run_config=cfg.model_dump())
    log.log(1, {"reward/mean": 1.0})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("reward/mean") == 1
