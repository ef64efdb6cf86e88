"""Turn a `rewards.functions[i]` entry into a (label, RewardFn): a built-in name or a dotted import path."""

from __future__ import annotations

import importlib
import inspect

from megagrpo.config.schema import RewardFnConfig
from megagrpo.errors import MegagrpoError
from megagrpo.rewards.verifiers import BUILTIN_REWARDS, RewardFn


def import_object(path: str) -> object:
    """Import 'package.module:attr' or 'package.module.attr'."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not 'package.module:function'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_reward(cfg: RewardFnConfig, where: str) -> tuple[str, RewardFn]:
    """Resolve one configured reward; `where` is its config path (e.g. 'rewards.functions[0]') for errors."""
    if cfg.name in BUILTIN_REWARDS:
        factory = BUILTIN_REWARDS[cfg.name]
        try:
            fn = factory(**cfg.kwargs)
        except (TypeError, ValueError) as e:
            params = ", ".join(inspect.signature(factory).parameters)
            raise MegagrpoError(
                f"{where}.kwargs: {cfg.kwargs!r} are not valid for {cfg.name!r} ({e}); it takes: {params}"
            ) from None
        return cfg.label or cfg.name, fn
    if "." not in cfg.name and ":" not in cfg.name:
        raise MegagrpoError(
            f"{where}.name: {cfg.name!r} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor a dotted "
            "import path like 'my_pkg.rewards:my_fn'"
        )
    try:
        obj = import_object(cfg.name)
    except (ImportError, AttributeError) as e:
        raise MegagrpoError(
            f"{where}.name: cannot import {cfg.name!r}: {e}; check the module is on PYTHONPATH"
        ) from None
    if not callable(obj):
        raise MegagrpoError(f"{where}.name: {cfg.name!r} is a {type(obj).__name__}, not a callable")
    if cfg.kwargs:
        try:
            obj = obj(**cfg.kwargs)
        except Exception as e:
            raise MegagrpoError(f"{where}.kwargs: calling {cfg.name}(**{cfg.kwargs!r}) failed: {e}") from None
        if not callable(obj):
            raise MegagrpoError(
                f"{where}: {cfg.name}(**kwargs) returned a {type(obj).__name__}, not a reward function"
            )
    label = cfg.label or cfg.name.replace(":", ".").rsplit(".", 1)[-1]
    return label, obj  # type: ignore[return-value]
