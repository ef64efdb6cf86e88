"""Metric sinks: one `MetricsLogger` writes each step's metrics to JSONL, TensorBoard, Weights & Biases
(optional) and the console.

Metric names are `area/name` (see docs/metrics.md). Values are converted to python floats here, once,
so every sink sees the same numbers. Only rank 0 writes; other ranks get a logger that drops records.
`wandb` is imported only when `logging.wandb.enabled` is true, and only on rank 0.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megagrpo.errors import MegagrpoError


def to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().item())
    return float(v)


def flatten_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep scalar metrics only, as floats; non-finite values are kept (JSON gets null) so they are visible."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() != 1:
            continue
        if isinstance(v, (int, float, bool, torch.Tensor)):
            out[k] = to_float(v)
    return out


class WandbSink:
    """One Weights & Biases run per process start: `log` sends a step's scalars, `close` finishes the run.

    `settings` is the `logging.wandb` section. Its files go to `WANDB_DIR` when set, else to the run
    directory; a null `mode` leaves the choice to `WANDB_MODE` (wandb's own default: online). A resumed
    run starts a new W&B run: W&B takes each step once and in order, and a resume re-logs the steps
    after its checkpoint.
    """

    def __init__(self, settings: Any, out_dir: Path, *, run_config: Mapping[str, Any], job_type: str):
        try:
            import wandb
        except ImportError as e:
            raise MegagrpoError(
                f"logging.wandb.enabled: true, but `import wandb` fails ({e}); install it with "
                "`pip install wandb`, or set logging.wandb.enabled=false"
            ) from None
        self._run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            tags=list(settings.tags),
            mode=settings.mode,
            job_type=job_type,
            config=dict(run_config),
            dir=None if os.environ.get("WANDB_DIR") else str(out_dir),
        )

    def log(self, step: int, flat: Mapping[str, float]) -> None:
        self._run.log(dict(flat), step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Appends `{"step": s, **metrics}` lines to `metrics.jsonl`; scalars to TensorBoard and to W&B.

    `wandb` is the `logging.wandb` section (None or disabled: no W&B run); `run_config` (the resolved
    config) and `job_type` (the stage) describe the W&B run.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb: Any = None,
        run_config: Mapping[str, Any] | None = None,
        job_type: str = "train",
    ):
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        self._wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / "metrics.jsonl"
        self._jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        if wandb is not None and wandb.enabled:
            self._wandb = WandbSink(wandb, self.out_dir, run_config=run_config or {}, job_type=job_type)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        flat = flatten_metrics(metrics)
        if not self.enabled:
            return flat
        rec = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in flat.items()}}
        self._jsonl.write(json.dumps(rec, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, flat)
        return flat

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint so the JSONL has each step once."""
        if not self.enabled or not self.jsonl_path.exists():
            return
        self._jsonl.close()
        lines = [ln for ln in self.jsonl_path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln)["step"] <= step]
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        os.replace(tmp, self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


CONSOLE_KEYS = (
    ("sft/nll", "nll"),
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval"),
    ("rollout/response_len_mean", "len"),
    ("loss/entropy", "ent"),
    ("loss/clip_frac_high", "clip_hi"),
    ("mismatch/kl_sampler_learner_k3", "mmKL"),
    ("moe/agreement_rollout_old", "agree"),
    ("perf/step_seconds", "s/step"),
)


def console_line(step: int, flat: Mapping[str, float]) -> str:
    """The one-line step summary: a fixed set of headline metrics, those present."""
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key in flat and flat[key] is not None and math.isfinite(flat[key]):
            parts.append(f"{short}={flat[key]:.4g}")
    return "  ".join(parts)
