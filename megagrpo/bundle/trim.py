"""Trimming native libraries to the target's SM architectures: the record the manifest keeps, and the
interface. The trimming itself is NOT IMPLEMENTED: `trim_library` raises NotImplementedError.

What it is to do (../shared/gpu-bundles.md; not yet reproduced here): TE 2.12.0's core library is mostly
`.nv_fatbin` entries for sm75/80/89/100/103/120 besides sm90, stored uncompressed; zeroing the payload of
every entry whose SM is not a target's, headers and offsets untouched, shrank the repacked wheel from
189.8 MB to 29.1 MB, and the library still loaded. sglang-kernel is trimmed by leaving out whole modules
(`flash_ops`, `sm100/`), not by editing a library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrimRecord:
    """What trimming did to one file, for the manifest."""

    package: str
    member: str  # path inside the wheel, or the module left out
    action: str  # "zeroed-fatbin-entries" or "removed"
    kept_sm: tuple[int, ...]
    removed_sm: tuple[int, ...]
    bytes_before: int
    bytes_after: int

    def to_json(self) -> dict:
        return asdict(self)


def trim_library(path: str | Path, keep_sm: list[int]) -> TrimRecord:
    """Zero the fatbin entries of `path` whose SM is not in `keep_sm`. Not implemented yet."""
    raise NotImplementedError(
        f"trimming {path} to sm {keep_sm} is not implemented yet: megagrpo.bundle selects versions and "
        "writes manifests, but cannot trim fatbins (docs/gpu.md, 'Offline bundles')"
    )
