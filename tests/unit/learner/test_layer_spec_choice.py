"""`model.layer_spec: auto` on a GPU node with Transformer Engine: TE only where it computes what was asked.

Measured on an H200 (docs/gpu.md): TE's GEMMs take fp32 inputs in TF32, so an fp32 learner on TE was
1.7e-4 nats from the fp32 reference (9.5e-7 on the local spec); and the bridge has no names for TE's MLA
layers, so a DeepSeek-V3-shaped learner on TE failed at its first weight load. The node is simulated
(CUDA and the package reported present) since the choice is made before anything is built.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.learner import model
from megagrpo.learner.model import use_transformer_engine
from tests.dist._common import TINY_DEEPSEEK_V3, TINY_GLM4_MOE


@pytest.fixture
def gpu_node_with_te(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(model.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        model.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "transformer_engine" else real(name, *a),
    )


@pytest.mark.parametrize(
    "dtype, fp8, expected",
    [(torch.bfloat16, None, True), (torch.float32, None, False), (torch.float32, "hybrid", True)],
)
def test_auto_takes_te_unless_the_learner_is_fp32_without_fp8(gpu_node_with_te, dtype, fp8, expected):
    assert use_transformer_engine("auto", arch=TINY_GLM4_MOE, dtype=dtype, fp8=fp8) is expected
    assert use_transformer_engine("local", arch=TINY_GLM4_MOE, dtype=dtype, fp8=fp8) is False
    # insisting on TE keeps it, fp32 included (TF32 GEMMs: the documented choice of whoever insists)
    assert use_transformer_engine("transformer_engine", arch=TINY_GLM4_MOE, dtype=dtype, fp8=fp8) is True


def test_auto_keeps_mla_on_the_local_spec_and_insisting_is_refused(gpu_node_with_te):
    assert use_transformer_engine("auto", arch=TINY_DEEPSEEK_V3, dtype=torch.bfloat16) is False
    with pytest.raises(MegagrpoError, match="multi-latent attention.*model.layer_spec=local"):
        use_transformer_engine("transformer_engine", arch=TINY_DEEPSEEK_V3, dtype=torch.bfloat16)
    with pytest.raises(MegagrpoError, match="multi-latent attention.*set model.fp8=null"):
        use_transformer_engine("auto", arch=TINY_DEEPSEEK_V3, dtype=torch.bfloat16, fp8="hybrid")


def test_without_cuda_auto_is_local_whatever_is_asked(monkeypatch):
    monkeypatch.setattr(model.torch.cuda, "is_available", lambda: False)
    for arch in (TINY_GLM4_MOE, TINY_DEEPSEEK_V3):
        assert use_transformer_engine("auto", arch=arch, dtype=torch.bfloat16, fp8="hybrid") is False
