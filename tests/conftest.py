"""Shared fixtures: GPU-marker handling, tiny Hugging Face models built locally (never downloaded), and
the bytecode cache every test process shares.

Bytecode: with PYTHONDONTWRITEBYTECODE set (container images often set it) no process ever caches a
compiled module, so each of the hundreds of processes a `make test` starts (every rank, every SGLang
scheduler and detokenizer, every CLI call) compiles megatron-core, SGLang and transformers from source
again: 26 s instead of 12.6 s to import SGLang's engine and megatron-core here. This process and all it
starts therefore write and read bytecode under PYTHONPYCACHEPREFIX (default
~/.cache/megagrpo/pycache), outside the source tree and the venv, which is what that setting protects.
Python checks each cached file against its source's mtime and size, so a stale cache is never used.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest


def _share_bytecode() -> None:
    if not (sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    prefix = os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(cache) / "megagrpo" / "pycache"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


_share_bytecode()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(arch="qwen3_moe", **kwargs) -> Path of a cached HF model directory."""
    from megagrpo.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def build(arch: str = "qwen3_moe", **kwargs) -> Path:
        key = json.dumps({"arch": arch, **kwargs}, sort_keys=True)
        if key not in cache:
            cache[key] = make_tiny_model(root / f"m{len(cache)}_{arch}", arch, **kwargs)
        return cache[key]

    return build
