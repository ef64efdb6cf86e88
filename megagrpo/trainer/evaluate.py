"""`megagrpo eval`: held-out accuracy of `model.hf_path` (or of a checkpoint given by --resume).

Results go to `<logging.out_dir>/eval/metrics.jsonl` (one record per evaluation, at the checkpoint's step),
never into the training run's own metrics, which an evaluation of an older checkpoint must not rewrite.
"""

from __future__ import annotations

import json
from pathlib import Path

from megagrpo.config.schema import Config
from megagrpo.trainer.session import Session


class EvalSession(Session):
    stage = "eval"
    rewrites_log_on_resume = False

    def output_dir(self) -> Path:
        return Path(self.cfg.logging.out_dir) / "eval"

    def make_optimizer(self):
        return None  # forward-only: no optimizer state to build


def evaluate(cfg: Config, resume: str | None = None) -> int:
    s = EvalSession(cfg, resume=resume or "never")
    try:
        s.restore()
        metrics = s.evaluate()
        s.logger.log(s.step, metrics)
        if s.rank0:
            print(json.dumps(metrics, indent=2, sort_keys=True))
        return 0
    finally:
        s.close()
