"""`megagrpo eval`: held-out accuracy of `model.hf_path` (or of a checkpoint given by --resume)."""

from __future__ import annotations

import json

from megagrpo.config.schema import Config
from megagrpo.trainer.session import Session


class EvalSession(Session):
    stage = "eval"

    def make_optimizer(self):
        return None  # forward-only: no optimizer state to build


def evaluate(cfg: Config, resume: str | None = None) -> int:
    s = EvalSession(cfg, resume=resume or "never")
    try:
        s.restore()
        metrics = s.evaluate()
        if s.rank0:
            print(json.dumps(metrics, indent=2, sort_keys=True))
        return 0
    finally:
        s.close()
