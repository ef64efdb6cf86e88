"""HF tensors -> one rank's megatron shards (the shard-aware direction of the map).

The conversion tool writes mesh-independent dist checkpoints instead; this is for loading HF weights
straight into a live sharded model (e.g. a reference model) without a checkpoint on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator

import torch

from megagrpo.bridge.maps import Placement, megatron_name, param_maps
from megagrpo.bridge.transforms import to_megatron, tp_shard
from megagrpo.config.model import ModelArch


def iter_local_shards(
    get_hf: Callable[[str], torch.Tensor],
    arch: ModelArch,
    *,
    padded_vocab: int,
    place: Placement | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
    layers: Container[int] | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(local megatron name, this rank's shard)` for every parameter this rank holds.

    get_hf(name) -> HF tensor (e.g. `HFCheckpoint.get`); only the tensors this rank needs are read.
    layers: global layer indices of this rank's pipeline chunk (None = all); first/last_stage: whether
    it holds the embedding / the final norm and output layer. Expert weights are split over the expert-TP
    group (etp_*), everything else over TP. Shapes are those of `GPTModel.state_dict()` on that rank.
    """
    place = place or Placement()
    # stacked HF expert tensors (gpt-oss) are read once per layer, not once per expert
    layer_cache: dict[str, torch.Tensor] = {}
    cached_layer: int | None = None
    for pm in param_maps(arch):
        if pm.layer is None:
            if pm.mcore.startswith("embedding.") and not first_stage:
                continue
            if not pm.mcore.startswith("embedding.") and not last_stage:
                continue
        elif layers is not None and pm.layer not in layers:
            continue
        name = megatron_name(pm, arch, place)
        if name is None:
            continue  # an expert of another EP rank
        if pm.stacked:
            if pm.layer != cached_layer:
                layer_cache, cached_layer = {}, pm.layer
            for n in pm.hf:
                if n not in layer_cache:
                    layer_cache[n] = get_hf(n)
            sources = [layer_cache[n][pm.expert] for n in pm.hf]
        else:
            sources = [get_hf(n) for n in pm.hf]
        full = to_megatron(pm, sources, arch, padded_vocab)
        rank, size = (etp_rank, etp_size) if pm.is_expert else (tp_rank, tp_size)
        yield name, tp_shard(pm, full, rank, size)
