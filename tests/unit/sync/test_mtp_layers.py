"""Checkpoints that ship multi-token-prediction layers (DeepSeek-V3/R1, GLM-4.5; issue 43): the weight
sync expects only what the learner exports, and a trainer's checkpoint carries the MTP tensors for the
export. Before, the expected set was the whole checkpoint, MTP included, and the first sync failed with
"tensors missing from the export: model.layers.3.eh_proj.weight ... (and 39 more)" after the engine loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.bridge.hf_io import MTP_FILES, mtp_layer_prefixes
from megagrpo.bridge.maps import hf_shapes
from megagrpo.sync.checks import check_announced, checkpoint_shapes
from megagrpo.trainer.checkpointing import mtp_files

MODELS = Path(__file__).resolve().parents[3] / "configs" / "models"


@pytest.mark.parametrize(
    "model, prefixes",
    [("DeepSeek-V3", ("model.layers.61.",)), ("GLM-4.5-Air", ("model.layers.46.",)), ("Kimi-K2", ())],
)
def test_the_released_configs_mtp_layers_lie_outside_what_the_learner_exports(model, prefixes):
    assert mtp_layer_prefixes(str(MODELS / model)) == prefixes
    arch = arch_from_hf(MODELS / model)
    assert arch.mtp_layers == len(prefixes)
    exported = hf_shapes(arch)  # what every sync announces
    assert not [n for n in exported if prefixes and n.startswith(prefixes)]
    assert any(n.startswith(f"model.layers.{arch.num_layers - 1}.") for n in exported)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_the_sync_expects_what_the_learner_exports_on_an_mtp_checkpoint(tiny_model, arch):
    path = tiny_model(arch, mtp_layers=1)
    expected = checkpoint_shapes(str(path))
    on_disk = load_file(str(path / "model.safetensors"))
    assert len(on_disk) - len(expected) > 20  # the MTP layer's tensors are in the checkpoint, not expected
    announced = hf_shapes(arch_from_hf(path))
    assert expected == announced
    check_announced(expected, announced)  # a full sync of the learner's tensors is complete


def test_a_trainer_checkpoint_carries_the_mtp_tensors_unchanged(tiny_model, tmp_path):
    """`trainer.checkpointing.mtp_files`: the MTP shards beside every checkpoint, extracted once per root,
    in the layout `convert megatron-to-hf` writes back; none for a model without MTP layers."""
    path = tiny_model("deepseek_v3", mtp_layers=1)
    files = mtp_files(path, tmp_path / "ckpt")
    assert [f.name for f in files] == ["mtp-00001.safetensors"] and files[0].match(MTP_FILES)
    src = load_file(str(path / "model.safetensors"))
    got = load_file(str(files[0]))
    assert set(got) == {n for n in src if n.startswith("model.layers.2.")}
    assert all(torch.equal(got[n], src[n]) for n in got)
    assert mtp_files(path, tmp_path / "ckpt") == files  # extracted once, then reused
    assert mtp_files(tiny_model("deepseek_v3"), tmp_path / "plain") == []
