"""Asking a CPU engine which parameters it holds in other shapes than the checkpoint's (padding), before the
first packed send, without loading anything."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from megagrpo.rollout.engines.engine import EngineFailed
from megagrpo.sync.buckets import NamedTensor
from megagrpo.sync.checks import _check_ok
from megagrpo.sync.engine_state import _per_engine
from megagrpo.sync.sglang_layout import FusedParam, sglang_plan

# The probe of a CPU engine's real parameter shapes (`rollout.engines.engine` names it in `custom_weight_loader`
# beside `load_packed`). Layout of the probe's one uint8 tensor, both ways: 8 bytes little-endian length,
# then that many bytes of JSON.
SHAPES_PROBE = f"{__name__}.report_shape_mismatches"
_PROBE_NAME = "megagrpo.shape_probe"


def report_shape_mismatches(model: torch.nn.Module, named_tensors: list[NamedTensor]) -> None:
    """SGLang custom weight loader that loads nothing; runs in the CPU engine's scheduler process.

    Its one tensor (`_PROBE_NAME`, in shared memory: the scheduler maps the parent's pages, as for
    `load_packed`) holds `{sglang_param_name: shape}` as JSON; it is overwritten with the JSON list of
    `[name, shape sent, shape the engine holds or None]` for every parameter that differs, which the parent
    reads back when the call returns. Why: the engine's parameters can differ from the checkpoint's
    shapes (SGLang's CPU MoE pads the expert intermediate size), and a packed load of a misshapen tensor
    raises inside the scheduler, which kills the scheduler, whose SIGQUIT then kills the trainer
    (SGLang's process-tree handler) with no error naming the tensor. Asking first keeps the scheduler
    alive and the error ours."""
    ((_, buf),) = named_tensors
    asked = json.loads(_read_probe(buf))
    params = dict(model.named_parameters())
    bad = [
        [name, shape, list(params[name].shape) if name in params else None]
        for name, shape in asked.items()
        if name not in params or list(params[name].shape) != shape
    ]
    _write_probe(buf, json.dumps(bad).encode())


def _read_probe(buf: torch.Tensor) -> bytes:
    n = int.from_bytes(bytes(buf[:8].tolist()), "little")
    return bytes(buf[8 : 8 + n].tolist())


def _write_probe(buf: torch.Tensor, data: bytes) -> None:
    if 8 + len(data) > buf.numel():
        raise ValueError(f"shape probe: {len(data)} bytes do not fit its buffer of {buf.numel()}")
    buf[: 8 + len(data)] = torch.tensor(list(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)


def engine_shape_mismatches(
    eng: Any, plan: Mapping[str, FusedParam]
) -> list[tuple[str, tuple, tuple | None]]:
    """`(sglang name, shape in plan, shape the engine holds or None)` for every parameter of `plan` that the
    engine does not hold as planned, asked of the engine itself (`report_shape_mismatches`) in the
    weight-update session the caller has open. Cost: one update call carrying the plan's names and shapes
    as JSON (tens of KB), and in the scheduler a walk of its parameters; nothing is loaded."""
    asked = json.dumps({fp.name: list(fp.shape) for fp in plan.values()}).encode()
    # Shared memory: the scheduler maps these pages and writes its answer into them.
    buf = torch.zeros(8 + 2 * len(asked) + 4096, dtype=torch.uint8).share_memory_()
    _write_probe(buf, asked)
    result = eng.update_weights_from_tensor([(_PROBE_NAME, buf)], load_format=SHAPES_PROBE, flush_cache=False)
    _check_ok(result, "update_weights_from_tensor (the shape probe)")
    return [(n, tuple(s), None if h is None else tuple(h)) for n, s, h in json.loads(_read_probe(buf))]


def engine_held_shapes(eng: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """{SGLang parameter name: the shape the engine holds} for the packing plan of checkpoint `shapes`
    (None where it lacks the parameter), asked of the engine once (`engine_shape_mismatches`, in a
    weight-update session of its own that loads nothing) and kept: its shapes are fixed for its lifetime.
    Engines started without the probe (not by `rollout.engines.engine` on a CPU) are not asked: {} (the planned
    shapes are taken as theirs). Cost, once per engine: the probe's one call (module doc of the probe)."""
    if SHAPES_PROBE not in (getattr(eng.server_args, "custom_weight_loader", None) or []):
        return {}

    def ask() -> dict[str, tuple[int, ...]]:
        plan = sglang_plan(shapes)
        _check_ok(eng.begin_weight_update(), "begin_weight_update (the shape probe)")
        open_session = True
        try:
            bad = engine_shape_mismatches(eng, plan)
        except EngineFailed:
            open_session = False  # no scheduler is left to end the session: asking would wait forever
            raise
        finally:
            if open_session:
                _check_ok(eng.end_weight_update(), "end_weight_update (the shape probe)")
        held = {fp.name: fp.shape for fp in plan.values()}
        held.update({name: h for name, _, h in bad})
        return held

    return _per_engine(eng, "held_shapes", ask)
