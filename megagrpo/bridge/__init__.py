"""HF <-> Megatron parameter maps, config translation, checkpoint I/O and the streaming export.

Imports torch, safetensors and transformers' config classes only; never megatron (the tools and the
learner pass megatron objects in).
"""

from megagrpo.bridge.export import ExportGroups, export_tensors, iter_hf_buckets
from megagrpo.bridge.hf_config import arch_from_hf, hf_config_from_arch
from megagrpo.bridge.load import iter_local_shards
from megagrpo.bridge.maps import ParamMap, Placement, hf_names, megatron_name, param_maps
from megagrpo.bridge.transforms import to_hf, to_megatron, tp_shard, tp_unshard

__all__ = [
    "ExportGroups",
    "ParamMap",
    "Placement",
    "arch_from_hf",
    "export_tensors",
    "hf_config_from_arch",
    "hf_names",
    "iter_hf_buckets",
    "iter_local_shards",
    "megatron_name",
    "param_maps",
    "to_hf",
    "to_megatron",
    "tp_shard",
    "tp_unshard",
]
