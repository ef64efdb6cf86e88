"""What an SGLang engine imports when it starts, trimmed to the model it serves.

SGLang's model registry imports every module in `sglang.srt.models` (about 260) in each scheduler process to
find the one class the checkpoint names. Only one of them is used. `SGLANG_DISABLED_MODEL_ARCHS` (SGLang's
own setting, read by the registry) skips modules by name; `skipped_model_modules` lists every module except
the one that defines the checkpoint's architecture, so a scheduler imports that module alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pkgutil
from collections.abc import Iterator
from pathlib import Path

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
