"""The GPU tier: one CUDA device, one process, megatron-core without the CPU compat layer.

Every test module here sets `pytestmark = pytest.mark.gpu`; `tests/conftest.py` skips them with the reason shown when no CUDA device
is present, so CI (no GPU) lists them as skipped rather than silently passing. The learner runs on a
one-rank NCCL group; each test builds and closes its own learner and the process group lives for the
session.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def one_rank():
    """A world of one for `DistEnv.from_environ()`; the NCCL group is torn down once, at the end."""
    import torch.distributed as dist

    from megagrpo.learner.mesh import DistEnv

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    yield DistEnv.from_environ()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def hf_moe(tiny_model):
    """A tiny Qwen3-MoE in HF format (2 layers, 8 experts, top-2, vocab 1024), built locally."""
    return tiny_model("qwen3_moe", hidden=64, layers=2, experts=8, topk=2, vocab_size=1024, seed=3)


@pytest.fixture(scope="session")
def hf_moe_sglang(tiny_model):
    """The tiny Qwen3-MoE with head_dim 128 for the tests that start SGLang's CUDA engine: with a head_dim
    of 16 its rotary embedding takes a fallback that cannot write the KV cache (seen on an H200)."""
    return tiny_model("qwen3_moe", hidden=512, layers=2, experts=8, topk=2, vocab_size=1024, seed=3)


@pytest.fixture(autouse=True)
def _reset_cuda_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
