"""Weight sync learner -> SGLang: validate, send bucket by bucket, optionally verify by checksum.

`sync_weights` takes buckets of `(hf_name, tensor)` (the bridge's streaming export, or `bucketize(...)`),
checks every name and shape against the engine's HF checkpoint BEFORE sending anything (so a bad export
leaves the engine serving the old weights), then sends each bucket with `update_weights_from_tensor`
between `begin_weight_update()` and `end_weight_update()`.

Checking everything first means the buckets are held until validation is done: their tensors stay alive
for the whole sync (a full copy of the model where the export had to gather or transform them).

Transport. CPU engine: the bucket is pickled by SGLang's `MultiprocessingSerializer` (tensors travel
through shared memory). GPU engine: one `FlattenedTensorBucket` per bucket (`load_format="flattened_bucket"`),
so each bucket is a single CUDA-IPC handle per TP rank instead of one per tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from megagrpo.errors import MegagrpoError
from megagrpo.sync.buckets import NamedTensor, tensor_bytes
from megagrpo.sync.sglang_layout import sglang_params


@dataclass(frozen=True)
class SyncStats:
    bytes: int  # bytes sent (sum over tensors of numel * element size, as sent)
    seconds: float  # wall time from begin_weight_update to end_weight_update
    buckets: int
    tensors: int
    checksum_ok: bool | None  # None when no checksum was asked for

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def metrics(self) -> dict[str, float]:
        m = {"sync/bytes": float(self.bytes), "sync/seconds": self.seconds, "sync/gbps": self.gbps}
        if self.checksum_ok is not None:
            m["sync/checksum_ok"] = float(self.checksum_ok)
        return m


def _sglang_engine(engine: Any) -> Any:
    return getattr(engine, "engine", engine)  # a RolloutEngine or a bare sglang.Engine


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """{hf_name: shape} of every tensor in the HF checkpoint the engine was started from (headers only)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in files:
        with safe_open(os.path.join(model_dir, fname), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def validate_buckets(
    buckets: list[list[NamedTensor]], expected: Mapping[str, tuple[int, ...]], *, partial: bool = False
) -> None:
    """Raise MegagrpoError naming the first unknown, duplicated, misshapen or (unless partial) missing tensor."""
    seen: set[str] = set()
    for bucket in buckets:
        for name, t in bucket:
            if not torch.is_tensor(t):
                raise MegagrpoError(f"weight sync: {name!r} is a {type(t).__name__}, not a tensor")
            if name not in expected:
                raise MegagrpoError(
                    f"weight sync: tensor {name!r} is not in the engine's checkpoint; the export and the rollout "
                    "model directory disagree (check the bridge's name map for this architecture)"
                )
            if name in seen:
                raise MegagrpoError(f"weight sync: tensor {name!r} is sent twice")
            if tuple(t.shape) != tuple(expected[name]):
                raise MegagrpoError(
                    f"weight sync: tensor {name!r} has shape {tuple(t.shape)}, the engine expects "
                    f"{tuple(expected[name])}"
                )
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise MegagrpoError(f"weight sync: tensor {name!r} holds NaN or inf values")
            seen.add(name)
    if not partial:
        missing = sorted(set(expected) - seen)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise MegagrpoError(f"weight sync: tensors missing from the export: {missing[:3]}{more}")


def _check_ok(result: Any, what: str) -> None:
    ok, msg = (result[0], result[1]) if isinstance(result, tuple) else (getattr(result, "success", True), "")
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {msg or result}")


def _flattened_payload(bucket: list[NamedTensor], tp_size: int) -> list[Any]:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=bucket)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(tp_size)]


def sync_weights(
    engine: Any,
    buckets: Iterable[list[NamedTensor]],
    *,
    checksum: bool = False,
    partial: bool = False,
) -> SyncStats:
    """Send HF-named tensors into a running SGLang engine. Returns `SyncStats` (see `metrics()`).

    engine: a `RolloutEngine` or `sglang.Engine`. buckets: lists of `(hf_name, tensor)` with HF checkpoint
    names and full (unsharded) shapes. partial: allow sending a subset of the checkpoint. checksum: after
    the update, compare SGLang's per-parameter hashes with hashes of what was sent (TP=1 engines).
    """
    eng = _sglang_engine(engine)
    buckets = [list(b) for b in buckets]
    buckets = [b for b in buckets if b]
    if not buckets:
        raise MegagrpoError("weight sync got no tensors; the export yielded nothing")
    validate_buckets(buckets, checkpoint_shapes(eng.server_args.model_path), partial=partial)

    on_gpu = any(t.is_cuda for b in buckets for _, t in b)
    tp_size = int(eng.server_args.tp_size)
    nbytes = sum(tensor_bytes(t) for b in buckets for _, t in b)
    t0 = time.perf_counter()
    _check_ok(eng.begin_weight_update(), "begin_weight_update")
    try:
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            if on_gpu:
                result = eng.update_weights_from_tensor(
                    _flattened_payload(bucket, tp_size), load_format="flattened_bucket", flush_cache=last
                )
            else:
                result = eng.update_weights_from_tensor(bucket, flush_cache=last)
            _check_ok(result, "update_weights_from_tensor")
    finally:
        _check_ok(eng.end_weight_update(), "end_weight_update")
    seconds = time.perf_counter() - t0
    ok = verify_checksum(eng, buckets) if checksum else None
    return SyncStats(
        bytes=nbytes, seconds=seconds, buckets=len(buckets), tensors=sum(map(len, buckets)), checksum_ok=ok
    )


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
    sent = {name: t.to(dtype) for b in buckets for name, t in b}
    expected = sglang_params(sent)
    held = engine_checksums(eng)
    common = [n for n in expected if n in held]
    if not common:
        raise MegagrpoError("weight sync checksum: no sent tensor maps onto an engine parameter")
    return all(_hash(expected[n]) == held[n] for n in common)
