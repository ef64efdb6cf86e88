"""Shared fixtures: GPU-marker handling and tiny Hugging Face models built locally (never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
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
