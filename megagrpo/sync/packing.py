"""HF tensors packed into SGLang's parameter layout (`sglang_layout`) in the engine's shapes and dtype, into
send buckets that are views of the engine's staging (`staging`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from megagrpo.errors import MegagrpoError
from megagrpo.sync import checksums, sglang_layout
from megagrpo.sync.buckets import NamedTensor
from megagrpo.sync.checks import _check_finite, all_finite
from megagrpo.sync.engine_state import _per_engine
from megagrpo.sync.sglang_layout import (
    FusedParam,
    fuse_into,
    laid_out,
    sglang_plan,
)
from megagrpo.sync.shape_probe import engine_held_shapes
from megagrpo.sync.staging import _Staging

logger = logging.getLogger(__name__)


def _lay_out(
    touched: Mapping[str, FusedParam],
    held: Mapping[str, tuple[int, ...]],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, FusedParam]:
    """`touched` laid out in the engine's shapes (`sglang_layout.laid_out`: zero-padded slots), or a
    MegagrpoError naming the first parameter the engine holds in a shape that is no padding of the plan's
    (or lacks), before anything is sent."""
    out: dict[str, FusedParam] = {}
    bad: list[tuple[str, tuple[int, ...], Any]] = []
    for name, fp in touched.items():
        h = held.get(name, fp.shape)
        fitted = None if h is None else laid_out(fp, h, shapes)
        if fitted is None:
            bad.append((name, fp.shape, h))
        else:
            out[name] = fitted
    if bad:
        name, sent, h = bad[0]
        held_says = "does not hold it" if h is None else f"holds {tuple(h)}"
        raise MegagrpoError(
            f"weight sync: the engine's parameter {name!r}: the learner's export packs {sent}, the engine "
            f"{held_says}, which is no zero-padding of it ({len(bad)} parameter(s) differ; nothing was sent, "
            "the engine keeps its weights). Set sync.pack=false to send HF-named tensors through SGLang's "
            "own loader"
        )
    return out


def _engine_param_names(eng: Any) -> frozenset[str]:
    """Names of the engine's parameters and buffers (from one checksum pass), cached per engine."""
    return _per_engine(eng, "param_names", lambda: frozenset(checksums.engine_checksums(eng)))


def _packing_plan(
    eng: Any, shapes: Mapping[str, tuple[int, ...]], buckets: list[list[NamedTensor]]
) -> dict[str, FusedParam] | None:
    """{hf_name: the SGLang parameter it goes into, in the engine's shapes} when every bucket can be sent
    packed, else None. MegagrpoError when the engine holds a touched parameter in a shape that is no
    zero-padding of the planned one (`_lay_out`); asks the engine its shapes on its first call."""
    sent = {name for b in buckets for name, _ in b}
    owner = {part: fp for fp in sglang_plan(shapes).values() for part in fp.parts}
    touched = {owner[name].name: owner[name] for name in sent}
    held = _engine_param_names(eng)
    unknown = sorted(n for n in touched if n not in held)
    incomplete = sorted(n for n, fp in touched.items() if not sent.issuperset(fp.parts))
    if unknown or incomplete:
        logger.info(
            "weight sync: sending HF-named tensors through load_weights (engine lacks %s; incomplete groups %s)",
            unknown[:3],
            incomplete[:3],
        )
        return None
    fitted = _lay_out(touched, engine_held_shapes(eng, shapes), shapes)
    return {part: fitted[fp.name] for part, fp in owner.items() if fp.name in fitted}


def _full_packing_plan(eng: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FusedParam] | None:
    """The packing plan of a full sync (every checkpoint tensor sent), None when the engine lacks a packed name."""
    return _per_engine(
        eng, "full_plan", lambda: _packing_plan(eng, shapes, [[(name, None) for name in shapes]])
    )


class _Packer:
    """Packs HF tensors, bucket by bucket, into `(sglang_param_name, tensor in dtype)` send buckets, the
    tensors of one send bucket being views of one shared-memory buffer of `staging`; a fused parameter
    travels with the bucket that completes it. Raises MegagrpoError naming the HF tensor when a value is
    NaN/inf, or does not fit `dtype` (inf after the cast)."""

    def __init__(self, owner: Mapping[str, FusedParam], dtype: torch.dtype, staging: _Staging | None = None):
        self.owner, self.dtype, self.staging = owner, dtype, staging or _Staging()
        params = {fp.name: fp for fp in owner.values()}  # room for every parameter that `owner` can fill
        self.staging.begin(
            _Staging.nbytes((fp.shape, sglang_layout.engine_dtype(fp.name, dtype)) for fp in params.values())
        )
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.sends: list[list[NamedTensor]] = []

    def add(self, bucket: list[NamedTensor]) -> None:
        ready: list[tuple[FusedParam, list[torch.Tensor]]] = []
        for name, t in bucket:
            fp = self.owner[name]
            got = self.pending.setdefault(fp.name, {})
            got[name] = t
            if len(got) == len(fp.parts):
                del self.pending[fp.name]
                ready.append((fp, [got[p] for p in fp.parts]))
        if not ready:
            return
        outs = self.staging.views(
            [(fp.shape, sglang_layout.engine_dtype(fp.name, self.dtype)) for fp, _ in ready]
        )
        for (fp, parts), out in zip(ready, outs):
            fuse_into(out, parts, fp.slot)
            if not all_finite(out):
                _raise_non_finite(fp, parts, out.dtype)
        self.sends.append([(fp.name, out) for (fp, _), out in zip(ready, outs)])

    def finish(self) -> list[list[NamedTensor]]:
        assert not self.pending, (
            f"incomplete groups after packing: {sorted(self.pending)[:3]}"
        )  # plan checked
        return self.sends


def _pack(
    buckets: list[list[NamedTensor]],
    owner: Mapping[str, FusedParam],
    dtype: torch.dtype,
    staging: _Staging | None = None,
) -> list[list[NamedTensor]]:
    """Every bucket through one `_Packer` (see there)."""
    packer = _Packer(owner, dtype, staging)
    for bucket in buckets:
        packer.add(bucket)
    return packer.finish()


def _raise_non_finite(fp: FusedParam, parts: list[torch.Tensor], dtype: torch.dtype) -> None:
    for name, t in zip(fp.parts, parts):
        _check_finite(name, t)
    for name, t in zip(fp.parts, parts):
        if not all_finite(t.to(dtype)):
            raise MegagrpoError(
                f"weight sync: tensor {name!r} has values outside the range of the engine's dtype {dtype}"
            )
    raise MegagrpoError(f"weight sync: parameter {fp.name!r} holds NaN or inf values")
