"""Find the environment class that `rollout.multi_turn.environment` names: a built-in name or 'module:Class'."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from megagrpo.envs.base import Environment
from megagrpo.errors import MegagrpoError
from megagrpo.rewards.registry import import_object

FIELD = "rollout.multi_turn.environment"

# Built-ins by import path, so that a name costs nothing until it is used.
BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "calculator": "megagrpo.envs.calculator:CalculatorEnv",
    "python": "megagrpo.envs.python_tool:PythonEnv",
}


def resolve_environment(name: str, where: str = FIELD) -> Callable[..., Environment]:
    """The environment class (or factory) for a built-in name or an import path 'package.module:Class'.

    `where` is the config path named in errors. Raises `MegagrpoError` for an unknown name, an import that
    fails, or an object that is not an environment class.
    """
    path = BUILTIN_ENVIRONMENTS.get(name)
    if path is None:
        if ":" not in name and "." not in name:
            raise MegagrpoError(
                f"{where}: {name!r} is not a built-in environment (choose one of "
                f"{', '.join(sorted(BUILTIN_ENVIRONMENTS))}) nor an import path like 'my_pkg.envs:MyEnv'"
            )
        path = name
    try:
        obj = import_object(path)
    except (ImportError, AttributeError) as e:
        raise MegagrpoError(
            f"{where}: cannot import {name!r}: {e}; check the module is on PYTHONPATH"
        ) from None
    if not inspect.isclass(obj) or not all(callable(getattr(obj, m, None)) for m in ("reset", "step")):
        raise MegagrpoError(
            f"{where}: {name!r} is a {type(obj).__name__}, not an environment class with async reset(row) "
            "and step(assistant_message) (see megagrpo.envs.base.Environment)"
        )
    return obj


def build_environment(name: str, kwargs: dict[str, Any] | None = None, where: str = FIELD) -> Environment:
    """A fresh environment (one per trajectory) from its name and options; bad options are a `MegagrpoError`."""
    cls = resolve_environment(name, where)
    kwargs = kwargs or {}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        params = ", ".join(inspect.signature(cls).parameters)
        raise MegagrpoError(
            f"{where}: options {kwargs!r} do not fit {name!r} ({e}); it takes: {params}"
        ) from None
    try:
        return cls(**kwargs)
    except ValueError as e:  # the environment's own check of an option's value
        raise MegagrpoError(f"{where}: options {kwargs!r} are not valid for {name!r}: {e}") from None


def tool_call_host_bytes(name: str, kwargs: dict[str, Any] | None = None, where: str = FIELD) -> int:
    """Host memory one running tool call of environment `name` holds (its class's `host_bytes_per_call`
    with the environment's options, e.g. a python-tool sandbox); 0 for an environment that declares none."""
    fn = getattr(resolve_environment(name, where), "host_bytes_per_call", None)
    return int(fn(**(kwargs or {}))) if callable(fn) else 0
