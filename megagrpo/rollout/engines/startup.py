"""What an SGLang engine starts with: the model modules it imports, the config fields SGLang reads, and
where its scheduler processes leave the cause of their death.

Imports. SGLang's model registry imports every module in `sglang.srt.models` (about 260) in each scheduler
process to find the one class the checkpoint names. Only one of them is used. `SGLANG_DISABLED_MODEL_ARCHS`
(SGLang's own setting, read by the registry) skips modules by name; `skipped_model_modules` lists every
module except the one that defines the checkpoint's architecture, so a scheduler imports that module alone.

Config fields. SGLang's DeepSeek model (`sglang/srt/models/deepseek_v2.py`) reads `scoring_func`,
`topk_method` and `moe_layer_freq` from the config as attributes. transformers' `DeepseekV3Config` neither
declares nor saves them (its model has one router: sigmoid scores, a selection-only correction bias over
group-limited top-k, every layer from `first_k_dense_replace` on MoE), so a config.json that transformers
wrote lacks them and the scheduler died with an AttributeError. `sglang_config_fill` gives SGLang the
values transformers' model computes with (`SGLANG_READS`), for the fields the checkpoint's own
config.json does not set, through SGLang's `json_model_override_args`; the checkpoint is not touched.

Cause of death. A scheduler that fails logs its traceback ("Scheduler hit an exception: ...") and signals
its parent, which sees only that the process died. `reporting_failure` wraps SGLang's scheduler entry
(`Engine.run_scheduler_process_func`, which the CPU compat also wraps): while `FAILURE_DIR_ENV` names a
folder, the scheduler also writes that traceback, or one it did not catch, to `<folder>/<pid>.failure`,
which `failure_cause` reads back for the error that names the engine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pkgutil
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megagrpo.config.model import MODEL_TYPE_ALIASES

DISABLED_ARCHS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"

# Families whose SGLang module is not named after their model_type: DeepSeek-V3's classes live in
# deepseek_v2.py (beside V2's, which they subclass).
MODULE_OF_MODEL_TYPE = {"deepseek_v3": "deepseek_v2"}


def _models_dir() -> Path:
    # `sglang` is a namespace package (no __file__); the spec of its models package has the directory
    (where,) = importlib.util.find_spec("sglang.srt.models").submodule_search_locations
    return Path(where)


def skipped_model_modules(model_path: str | Path) -> list[str]:
    """The `sglang.srt.models` modules a scheduler may skip for this checkpoint, or [] to import them all.

    The module kept is the one named after the config's `model_type` (SGLang's naming for the families
    megagrpo converts: llama, qwen2, qwen3, qwen3_moe, mixtral, glm4_moe; deepseek_v3 through
    `MODULE_OF_MODEL_TYPE`), and only if its source declares the config's architecture class; anything else falls back to SGLang's full scan, so no model loses support.
    """
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []  # the engine's own checks report a missing or broken config.json
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    try:
        models = _models_dir()
    except (ImportError, AttributeError, ValueError):  # not SGLang's layout (a test stand-in): skip nothing
        return []
    family = MODEL_TYPE_ALIASES.get(model_type, model_type)  # kimi_k2 is served by DeepSeek-V3's module
    module = MODULE_OF_MODEL_TYPE.get(family, family)
    source = models / f"{module}.py"
    if not model_type or len(archs) != 1 or not source.is_file() or archs[0] not in source.read_text():
        return []
    names = [n for _, n, pkg in pkgutil.iter_modules([str(models)]) if not pkg]
    return sorted(n for n in names if n not in (module, "registry"))


@contextlib.contextmanager
def only_the_served_model_imported(model_path: str | Path) -> Iterator[None]:
    """Set `SGLANG_DISABLED_MODEL_ARCHS` while an engine starts (its spawned schedulers inherit it), then put
    the environment back. A value the user set is kept: they may serve a model through a module of theirs."""
    skipped = [] if os.environ.get(DISABLED_ARCHS_ENV) else skipped_model_modules(model_path)
    if not skipped:
        yield
        return
    os.environ[DISABLED_ARCHS_ENV] = ",".join(skipped)
    try:
        yield
    finally:
        os.environ.pop(DISABLED_ARCHS_ENV, None)


# Per family (`model_type`, after MODEL_TYPE_ALIASES): fields SGLang's model reads that the family's
# transformers config class does not save, with the value transformers' model computes with (module doc).
# The same defaults megagrpo's bridge reads for a config without them (`bridge/hf_config_v3.py`).
SGLANG_READS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1},
}


def sglang_config_fill(model_path: str | Path) -> dict[str, Any]:
    """The fields of `SGLANG_READS` that the checkpoint's config.json lacks, with their values (module
    doc); {} when it sets them all, or is not a family listed there."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # the engine's own checks report a missing or broken config.json
    model_type = cfg.get("model_type")
    reads = SGLANG_READS.get(MODEL_TYPE_ALIASES.get(model_type, model_type), {})
    return {k: v for k, v in reads.items() if k not in cfg}


FAILURE_DIR_ENV = "MEGAGRPO_ENGINE_FAILURE_DIR"
SCHEDULER_FAILED = "Scheduler hit an exception: "  # sglang.srt.managers.scheduler.run_scheduler_process
_SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"


class _LastWords(logging.Handler):
    """Writes the traceback of the scheduler's failure record to `path` (module doc, "Cause of death")."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.ERROR)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(SCHEDULER_FAILED):
            self.path.write_text(message[len(SCHEDULER_FAILED) :])


def reporting_failure(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A scheduler process: `inner(*args, **kwargs)` (SGLang's scheduler entry), leaving the cause of its
    death in `$FAILURE_DIR_ENV/<pid>.failure` (module doc). A module function, so that spawn pickles it
    (with `functools.partial`) by reference."""
    where = os.environ.get(FAILURE_DIR_ENV)
    if not where:
        return inner(*args, **kwargs)
    path = Path(where) / f"{os.getpid()}.failure"
    logging.getLogger(_SCHEDULER_LOGGER).addHandler(_LastWords(path))
    try:
        return inner(*args, **kwargs)
    except Exception:  # not SystemExit: a scheduler that exits when told to has not failed
        path.write_text(traceback.format_exc())
        raise


def failure_cause(where: str | Path | None) -> str | None:
    """The cause a scheduler left under `where` (`reporting_failure`): the exception's last line and the
    frame that raised it, of the first to fail; None when none left one."""
    if where is None:
        return None
    reports = sorted(Path(where).glob("*.failure"), key=lambda p: p.stat().st_mtime)
    for report in reports:
        lines = [ln for ln in report.read_text().splitlines() if ln.strip()]
        if not lines:
            continue
        frames = [ln.strip() for ln in lines if ln.lstrip().startswith('File "')]
        return lines[-1].strip() + (f" (at {frames[-1]})" if frames else "")
    return None


@contextlib.contextmanager
def failures_reported_to(where: str | Path) -> Iterator[None]:
    """Set `FAILURE_DIR_ENV` while an engine's processes are spawned (they inherit it), then put it back."""
    previous = os.environ.get(FAILURE_DIR_ENV)
    os.environ[FAILURE_DIR_ENV] = str(where)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FAILURE_DIR_ENV, None)
        else:
            os.environ[FAILURE_DIR_ENV] = previous
