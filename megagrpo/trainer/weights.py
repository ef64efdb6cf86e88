"""Moving weights between a Hugging Face directory, the megatron learner and the SGLang sampler.

All three directions go through the bridge's one parameter map: `load_hf_into_learner` (HF -> live
learner shards), `export_buckets` (live learner -> HF-named buckets, gathered to the exporting rank) and
`save_hf` (those buckets -> an HF directory, written atomically).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.bridge import export as bridge_export
from megagrpo.bridge.export import ExportGroups, iter_hf_buckets
from megagrpo.bridge.hf_config import exported_config
from megagrpo.bridge.hf_io import (
    HFCheckpoint,
    atomic_output_dir,
    copy_side_files,
    mtp_layer_prefixes,
    write_hf_checkpoint,
)
from megagrpo.bridge.load import iter_local_shards
from megagrpo.bridge.maps import Placement, hf_shapes
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.sync.checks import all_finite
from megagrpo.sync.sglang_layout import load_groups


def _layer_offset(chunk: Any) -> int:
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return int(layers[0].layer_number) - 1  # megatron numbers layers from 1, globally


def _placement(chunk: Any, names: list[str]) -> Placement:
    from megatron.core import parallel_state as ps

    return Placement(
        layer_offset=_layer_offset(chunk),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        grouped_experts=any(".experts.linear_fc1.weight" in n for n in names),
        te_norms=any(n.endswith("layer_norm_weight") for n in names),
    )


def _unwrap(chunk: Any) -> Any:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


@torch.no_grad()
def load_hf_into_learner(learner: Any, hf_dir: str | Path) -> ModelArch:
    """Copy an HF checkpoint into this rank's shards of `learner.chunks` (every rank calls it)."""
    from megatron.core import parallel_state as ps

    from megagrpo.learner.model import padded_vocab_size

    ckpt = HFCheckpoint(hf_dir)
    arch = ckpt.arch
    if arch != learner.arch:
        raise MegagrpoError(
            f"{hf_dir}: its config.json describes a different model than the learner was built for; "
            "build the learner from this directory's config"
        )
    tp_size = ps.get_tensor_model_parallel_world_size()
    padded = padded_vocab_size(arch, tp_size)
    for chunk in learner.chunks:
        chunk = _unwrap(chunk)
        # the parameters and the router's correction bias (a buffer): the checkpoint fills both
        params = dict(bridge_export.export_tensors(chunk))
        offset = _layer_offset(chunk)
        n_layers = len(chunk.decoder.layers) if hasattr(chunk, "decoder") else 0
        shards = iter_local_shards(
            ckpt.get,
            arch,
            padded_vocab=padded,
            place=_placement(chunk, list(params)),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=tp_size,
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            layers=range(offset, offset + n_layers),
            first_stage=chunk.pre_process,
            last_stage=chunk.post_process,
        )
        filled = set()
        for name, shard in shards:
            if name not in params or shard.shape != params[name].shape:
                got = tuple(params[name].shape) if name in params else "absent"
                raise MegagrpoError(
                    f"{hf_dir}: the map gives {name} of shape {tuple(shard.shape)} on this rank, but the "
                    f"model holds {got}; the checkpoint and the learner's model config disagree"
                )
            params[name].copy_(shard.to(params[name].dtype))
            filled.add(name)
        if arch.tie_embeddings and "output_layer.weight" in params and "output_layer.weight" not in filled:
            # the last stage's copy of a tied embedding; megatron keeps it equal to the first stage's
            filled.add("output_layer.weight")
            if "embedding.word_embeddings.weight" in params:
                params["output_layer.weight"].copy_(params["embedding.word_embeddings.weight"])
        missing = sorted(set(params) - filled)
        if missing:
            raise MegagrpoError(
                f"{hf_dir}: no HF tensor fills megatron parameter {missing[0]!r} ({len(missing)} in all)"
            )
    ckpt.close()
    if getattr(learner, "optimizer", None) is not None and hasattr(learner.optimizer, "reload_model_params"):
        learner.optimizer.reload_model_params()  # the fp32 main copies must follow the new weights
    if getattr(learner, "reference", None) is not None:
        learner.copy_policy_to_reference()
    return arch


def export_buckets(
    learner: Any, bucket_bytes: int, *, receive: bool | None = None, stage_only: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named buckets of the live policy; every model-parallel rank must iterate this to the end.

    receive: whether this rank gets the buckets (an engine owner); None = the replica's first rank
    (`bridge.export`'s default exporter). stage_only: only its own pipeline stage's tensors. No bucket
    cuts a group of tensors that SGLang fuses at load (`fused_groups`), whatever the transport that
    carries the buckets on."""
    from megatron.core import parallel_state as ps

    together = fused_groups(learner.arch)
    for chunk in learner.chunks:
        chunk = _unwrap(chunk)
        groups = ExportGroups.from_parallel_state(ps, layer_offset=_layer_offset(chunk))
        yield from iter_hf_buckets(
            bridge_export.export_tensors(chunk),  # the parameters and the router's correction bias (a buffer)
            learner.arch,
            bucket_bytes=bucket_bytes,
            groups=groups,
            receive=receive,
            stage_only=stage_only,
            together=together,
        )


@functools.lru_cache(maxsize=4)
def fused_groups(arch: ModelArch) -> dict[str, tuple[str, ...]]:
    """The groups of the export's HF tensors that SGLang fuses at load (`sync.sglang_layout.load_groups`),
    computed once per architecture (0.6 s for DeepSeek-V3's 45k tensors)."""
    return load_groups(hf_shapes(arch))


@torch.no_grad()
def check_learner_weights(learner: Any) -> None:
    """Refuse a weight sync from a policy with NaN/inf values, before any engine is touched (collective).

    Each rank checks its own shards (one sum per parameter, M / model-parallel size bytes read, and one
    device sync for all of them; a non-finite sum is confirmed exactly by `all_finite`), and the verdict is
    agreed over WORLD as one scalar; the names travel only when something is wrong. Checking here, not on
    the exported buckets, is what lets the GPU sync stream its buckets (`sync.weights`)."""
    params = [
        (name, p)
        for chunk in learner.chunks
        for name, p in _unwrap(chunk).named_parameters()
        if p.is_floating_point() and p.numel()
    ]
    bad = None
    if params:
        sums = torch.stack([p.detach().sum().float() for _, p in params])
        suspect = (~torch.isfinite(sums)).nonzero().flatten().tolist()  # the one device sync
        bad = next((params[i][0] for i in suspect if not all_finite(params[i][1].detach())), None)
    flag = torch.tensor([0 if bad is None else 1], dtype=torch.int64, device=learner.mesh.device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    names = [bad]
    if world > 1:
        names = [None] * world
        dist.all_gather_object(names, bad)
    rank, name = next((r, n) for r, n in enumerate(names) if n)
    raise MegagrpoError(
        f"weight sync: learner parameter {name!r} (rank {rank}) holds NaN or inf values after the update; "
        "nothing was sent, the engines keep their weights. Lower optimizer.lr or check the loss for "
        "overflow (loss/grad_norm)"
    )


def save_hf(
    learner: Any, out_dir: str | Path, *, side_files_from: str | Path, bucket_bytes: int = 1 << 30
) -> None:
    """Write the policy as an HF directory (config, tokenizer, safetensors). Atomic; rank 0 writes.

    Multi-token-prediction layers, which the learner neither builds nor trains, are written unchanged
    from `side_files_from` (the HF model the run started from), so that the saved model holds what its
    config's `num_nextn_predict_layers` promises and loads with them wherever the original did; from a
    source without them the saved model says `num_nextn_predict_layers: 0`.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    buckets = export_buckets(learner, bucket_bytes)
    if not rank0:
        for _ in buckets:
            pass
        return
    import itertools
    import json

    src = Path(side_files_from)
    mtp = HFCheckpoint(src) if mtp_layer_prefixes(str(src)) else None
    with atomic_output_dir(out_dir) as tmp:
        carried = mtp.iter_mtp(bucket_bytes) if mtp is not None else iter(())
        write_hf_checkpoint(tmp, itertools.chain(buckets, carried))
        copy_side_files(src, tmp)
        cfg = exported_config(learner.arch, src)
        if learner.arch.mtp_layers and (mtp is None or not mtp.mtp_names()):
            cfg["num_nextn_predict_layers"] = 0  # a promise of MTP layers without their tensors loads nowhere
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if mtp is not None:
        mtp.close()
