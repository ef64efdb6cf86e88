"""Whether the engine holds what was sent: SGLang's per-parameter hashes against hashes of the sent tensors,
laid out as the engine holds them (TP 1)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from megagrpo.errors import MegagrpoError
from megagrpo.sync import sglang_layout
from megagrpo.sync.buckets import NamedTensor
from megagrpo.sync.checks import checkpoint_shapes
from megagrpo.sync.engine_state import _per_engine, _sglang_engine
from megagrpo.sync.sglang_layout import sglang_params
from megagrpo.sync.shape_probe import engine_held_shapes


def _verify_packed(eng: Any, sends: list[list[NamedTensor]]) -> bool:
    """True when every staged SGLang parameter hashes like the engine's copy of it."""
    held = engine_checksums(eng)
    common = [(n, t) for b in sends for n, t in b if n in held]
    if not common:
        raise MegagrpoError("weight sync checksum: no sent tensor maps onto an engine parameter")
    return all(_hash(t) == held[n] for n, t in common)


def engine_checksums(engine: Any) -> dict[str, str]:
    """SGLang's per-parameter hashes of what the engine holds now ({sglang_param_name: hex}), TP rank 0."""
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    eng = _sglang_engine(engine)
    ok, msg, ranks, _ = eng.loop.run_until_complete(
        eng.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None)
    )
    if not ok or not ranks:
        raise RuntimeError(f"SGLang check_weights(checksum) failed: {msg}")
    return dict(ranks[0]["checksums"])


def _hash(t: torch.Tensor) -> str:
    # Same digest as sglang.srt.managers.mm_utils.tensor_hash on the CPU: sha256 of the bytes, first 8 bytes.
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], 'big'):016x}"


def verify_checksum(engine: Any, buckets: list[list[NamedTensor]]) -> bool:
    """True when every SGLang parameter built from the sent tensors hashes like the engine's copy.

    The sent tensors are cast to the engine's dtype and fused the way SGLang fuses them (`sglang_layout`).
    Raises MegagrpoError when the engine runs with TP > 1 (its parameters are shards) or when none of the
    sent tensors maps onto an engine parameter.
    """
    eng = _sglang_engine(engine)
    if int(eng.server_args.tp_size) != 1:
        raise MegagrpoError("weight sync checksum supports engines with tp_size=1 only; set checksum=false")
    dtype = eng.tokenizer_manager.model_config.dtype
    sent = {name: t.to(sglang_layout.engine_dtype(name, dtype)) for b in buckets for name, t in b}
    shapes = _per_engine(eng, "shapes", lambda: checkpoint_shapes(eng.server_args.model_path))
    expected = sglang_params(sent, engine_held_shapes(eng, shapes))
    held = engine_checksums(eng)
    common = [n for n in expected if n in held]
    if not common:
        raise MegagrpoError("weight sync checksum: no sent tensor maps onto an engine parameter")
    return all(_hash(expected[n]) == held[n] for n in common)
