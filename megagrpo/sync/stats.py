"""What one weight sync reports: bytes, seconds, buckets, tensors, checksum (`sync/` metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncStats:
    bytes: int  # bytes given (sum over the HF tensors of numel * element size, as passed in)
    seconds: float  # wall time of the sync: validation, packing, begin/update/end (not the checksum)
    buckets: int  # update_weights_from_tensor calls
    tensors: int  # HF tensors given
    checksum_ok: bool | None  # None when no checksum was asked for
    packed: bool = False  # True when sent in SGLang's parameter layout (load_format "direct" or load_packed)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def metrics(self) -> dict[str, float]:
        m = {"sync/bytes": float(self.bytes), "sync/seconds": self.seconds, "sync/gbps": self.gbps}
        if self.checksum_ok is not None:
            m["sync/checksum_ok"] = float(self.checksum_ok)
        return m
