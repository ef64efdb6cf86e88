"""CPU compatibility for megatron-core 0.19.2 and SGLang 0.5.23.

`apply_cpu_compat()` is called once at process start (by `launch/` and the test fixtures). It does
nothing when CUDA is available. Every patch lives in `megatron_cpu` or `sglang_cpu`, names the
upstream function it replaces and why, and counts its hits in `patching.HITS`.
"""

from __future__ import annotations

import torch

from megagrpo.compat.patching import APPLIED, HITS

_done = False


def apply_cpu_compat(*, megatron: bool = True, sglang: bool = False) -> dict[str, str]:
    """Patch the libraries for a CUDA-less machine; return {patched name: reason}. Idempotent."""
    global _done
    if torch.cuda.is_available():
        return {}
    if megatron:
        from megagrpo.compat import megatron_cpu

        megatron_cpu.apply()
    if sglang:
        from megagrpo.compat import sglang_cpu

        sglang_cpu.apply()
    _done = True
    return {name: p.reason for name, p in APPLIED.items()}


__all__ = ["APPLIED", "HITS", "apply_cpu_compat"]
