"""`EnginePool`: SGLang engines reused by several trainer runs in one test process.

Engine start-up (SGLang's scheduler processes) dominates a short run on the CPU, so tests that run many
short trainings in one process (the option matrix, the async-rollout runs) give each run a pooled engine
with the run's initial weights instead of a new one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class EnginePool:
    """SGLang engines shared by the cases of this module, keyed by architecture and engine settings.

    Stands in for `megagrpo.rollout.engines.engine.RolloutEngine` while the cases run: the trainer's
    `RolloutEngine(cfg).start()` gets a started engine, whose weights (and tokenizer, with its chat
    template) are reloaded from the case's model directory when it served an earlier case, and its
    `shutdown()` leaves the engine running for the next case. `close()` shuts every engine down for real.

    `one_live`: starting an engine shuts the others down, so that engines sized for one case each (a share
    of this machine's RAM) never stand side by side; a caller whose runs come grouped by engine loses no
    start by it."""

    def __init__(self, one_live: bool = False) -> None:
        from megagrpo.rollout.engines.engine import RolloutEngine

        self.cls = RolloutEngine
        self.engines: dict[tuple, RolloutEngine] = {}
        self.starts = 0
        self.replacements = 0  # engines started in place of a failed one (`starts` counts the others)
        self.one_live = one_live

    @staticmethod
    def key(cfg) -> tuple:
        from megagrpo.trainer.preflight import remote_code_needed

        hf = json.loads((Path(cfg.model_path) / "config.json").read_text())
        arch = tuple(hf.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"))
        settings = dataclasses.asdict(dataclasses.replace(cfg, model_path=""))
        if not remote_code_needed(cfg.model_path):
            # transformers' own classes serve the model either way: trusting its (absent) Python changes
            # nothing the engine loads
            settings["trust_remote_code"] = None
        return (arch, json.dumps(settings, sort_keys=True, default=str))

    def __call__(self, cfg, *, name: str | None = None):
        key = self.key(cfg)
        eng = self.engines.get(key)
        replacing = eng is not None and eng.failed is not None
        if replacing:  # a fault case's replacement (issue 45): the failed engine goes, a new one comes
            self.cls.shutdown(self.engines.pop(key))
            eng = None
        if eng is None:
            if self.one_live:
                self.drop_all()
            eng = self.cls(cfg, name=name)  # started by the trainer's own start() call
            eng.shutdown = lambda: None
            self.engines[key] = eng
            if replacing:
                self.replacements += 1
            else:
                self.starts += 1
            return eng
        eng.name = name or eng.name  # this run's placement, in its errors
        eng.resume()
        ok, message, *_ = eng.engine.update_weights_from_disk(cfg.model_path)
        if not ok:
            raise RuntimeError(f"update_weights_from_disk({cfg.model_path}) failed: {message}")
        from transformers import AutoTokenizer

        eng.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)  # multi-turn renders with this one
        return eng

    def drop_all(self) -> None:
        for eng in self.engines.values():
            self.cls.shutdown(eng)
        self.engines.clear()
