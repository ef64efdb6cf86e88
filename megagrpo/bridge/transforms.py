"""Tensor transforms of the parameter maps: HF tensors <-> full megatron tensor <-> TP shards.

All functions are exact (views, cat, slicing, zero padding): a round trip returns bit-identical tensors.
Shapes: HF Linear weights are [out, in]; see `megagrpo.bridge.maps` for the megatron layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megagrpo.bridge.maps import GATE_UP_KINDS, ParamMap
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError


def check_hf_shapes(pm: ParamMap, tensors: Sequence[torch.Tensor]) -> None:
    """Raise a MegagrpoError naming the HF key whose shape disagrees with the config."""
    for name, t, want in zip(pm.hf, tensors, pm.hf_shapes, strict=True):
        if tuple(t.shape) != want:
            raise MegagrpoError(
                f"tensor {name!r} has shape {tuple(t.shape)} but config.json implies {want}; "
                "the checkpoint and its config.json disagree"
            )


def to_megatron(
    pm: ParamMap, tensors: Sequence[torch.Tensor], arch: ModelArch, padded_vocab: int
) -> torch.Tensor:
    """HF tensors (in `pm.hf` order) -> the full megatron tensor (contiguous)."""
    check_hf_shapes(pm, tensors)
    if pm.kind == "copy":
        return tensors[0].contiguous()
    if pm.kind == "vocab":
        t = tensors[0]
        if padded_vocab < t.shape[0]:
            raise MegagrpoError(f"padded vocab {padded_vocab} is smaller than the HF vocab {t.shape[0]}")
        out = t.new_zeros((padded_vocab, *t.shape[1:]))
        out[: t.shape[0]] = t
        return out
    if pm.kind == "gate_up":
        return torch.cat(list(tensors), dim=0)
    if pm.kind == "gate_up_interleaved":
        # gpt-oss: [H, 2F] (or a [2F] bias) with gate and up alternating on the last axis
        t = tensors[0]
        gate, up = t[..., ::2], t[..., 1::2]
        return torch.cat([gate.transpose(0, -1), up.transpose(0, -1)], dim=0).contiguous()
    if pm.kind == "transpose":
        return tensors[0].transpose(0, 1).contiguous()
    if pm.kind == "qkv":
        q, k, v = tensors
        groups, hd = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        qg = q.reshape(groups, -1, *rest)  # [ng, heads_per_group * hd, ...]
        kg = k.reshape(groups, hd, *rest)
        vg = v.reshape(groups, hd, *rest)
        return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()
    raise ValueError(f"unknown map kind {pm.kind!r}")


def to_hf(pm: ParamMap, full: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """The full megatron tensor -> HF tensors in `pm.hf` order (vocab padding cut off)."""
    if pm.kind == "copy":
        return [full]
    if pm.kind == "vocab":
        return [full[: arch.vocab_size]]
    if pm.kind == "gate_up":
        return list(torch.chunk(full, 2, dim=0))
    if pm.kind == "gate_up_interleaved":
        gate, up = torch.chunk(full, 2, dim=0)
        pairs = torch.stack([gate.transpose(0, -1), up.transpose(0, -1)], dim=-1)  # [..., F, 2]
        return [pairs.reshape(*pairs.shape[:-2], -1)]
    if pm.kind == "transpose":
        return [full.transpose(0, 1).contiguous()]
    if pm.kind == "qkv":
        groups, hd = arch.num_kv_heads, arch.head_dim
        per_group = arch.num_attention_heads // groups * hd
        rest = full.shape[1:]
        g = full.reshape(groups, per_group + 2 * hd, *rest)
        q, k, v = torch.split(g, [per_group, hd, hd], dim=1)
        return [x.reshape(-1, *rest) for x in (q, k, v)]
    raise ValueError(f"unknown map kind {pm.kind!r}")


def tp_shard(pm: ParamMap, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's shard of the full megatron tensor (the whole tensor if replicated)."""
    if pm.tp_axis is None or size == 1:
        return full
    if pm.kind in GATE_UP_KINDS:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([_split(pm, gate, size, 0)[rank], _split(pm, up, size, 0)[rank]], dim=0)
    return _split(pm, full, size, pm.tp_axis)[rank].contiguous()


def tp_unshard(pm: ParamMap, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_shard`: the full tensor from every TP rank's shard, in rank order."""
    if pm.tp_axis is None or len(shards) == 1:
        return shards[0]
    if pm.kind in GATE_UP_KINDS:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=pm.tp_axis)


def _split(pm: ParamMap, t: torch.Tensor, size: int, axis: int) -> tuple[torch.Tensor, ...]:
    if t.shape[axis] % size:
        raise MegagrpoError(
            f"{pm.mcore}: axis {axis} of size {t.shape[axis]} does not split over tensor-parallel size {size}"
        )
    return torch.chunk(t, size, dim=axis)
