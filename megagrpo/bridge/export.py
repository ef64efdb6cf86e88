"""Streaming export: a live, sharded megatron model -> buckets of HF-named tensors.

`iter_hf_buckets` walks the parameter map in HF checkpoint order. For each megatron parameter the
stage that owns it gathers the TP shards (expert weights: the ETP shards, and the experts of every EP
rank), converts it to HF tensors, and sends it to the exporting rank over the pipeline group. Only the
exporter yields buckets; at most one bucket is alive in the generator at a time.

Contract with the caller (the learner / sync), which owns megatron's `parallel_state`:
- EVERY rank of the model-parallel replica (all TP x EP x PP ranks that hold one copy of the weights) calls
  `iter_hf_buckets` with the same arguments and iterates it to exhaustion, because the gathers are
  collectives. Ranks that are not the exporter get no buckets.
- By default the exporter is the rank with rank 0 in its TP, ETP, EP and PP groups. DP replicas beyond EP
  each have their own exporter and export independently. `receive=True` makes any rank an exporter (an
  engine owner, `rollout.groups`): after the TP/ETP/EP gathers every rank of the owning stage holds the
  full tensor, and the owning stage sends it to each stage of its pipeline group that receives, so an
  owner gets its engine's weights from its own replica, never through one global rank.
- `params` are the rank's own `(name, tensor)` pairs as megatron names them inside its model chunk
  (`export_tensors(model)`: the parameters and the router's correction-bias buffers; or a state dict): layers numbered locally from `layer_offset`, experts by
  local index. SequentialMLP or TE-grouped expert names and local or TE norm names are all accepted.
- `groups` holds torch.distributed process groups; `ExportGroups.from_parallel_state(parallel_state)` builds
  them from megatron's module without this package importing megatron.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.bridge.bucketing import BucketFiller
from megagrpo.bridge.maps import ParamMap, Placement, megatron_name, param_maps
from megagrpo.bridge.transforms import to_hf, tp_unshard
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError

# Names a megatron model holds that carry no HF tensor: TE/fp8 extra state, and the output-layer copy the
# last pipeline stage keeps when embeddings are tied (stage 0's embedding is exported instead).
_SKIP = re.compile(r"(\._extra_state$)")


# Megatron state that is a buffer, not a parameter, yet part of the HF checkpoint: the router's correction
# bias (HF `e_score_correction_bias`). It stays fp32 on export whatever the output dtype, as checkpoints
# ship it, so that the selection it drives is reproduced bit for bit.
BUFFER_SUFFIXES = ("mlp.router.expert_bias",)


def export_tensors(module: Any) -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of everything `iter_hf_buckets` exports from one model chunk: its parameters and
    the buffers of BUFFER_SUFFIXES."""
    out = list(module.named_parameters())
    out += [(n, b) for n, b in module.named_buffers() if b is not None and n.endswith(BUFFER_SUFFIXES)]
    return out


@dataclass(frozen=True)
class ExportGroups:
    """Process groups of one model-parallel replica; None means size 1.

    tp: tensor parallel (attention, dense MLP, vocab). etp: expert tensor parallel (defaults to tp's role
    for expert weights; None = 1). ep: expert parallel. pp: pipeline parallel.
    layer_offset: global index of this rank's first decoder layer.
    """

    tp: Any = None
    etp: Any = None
    ep: Any = None
    pp: Any = None
    layer_offset: int = 0

    @classmethod
    def from_parallel_state(cls, ps: Any, layer_offset: int = 0) -> ExportGroups:
        """Groups from megatron's `parallel_state` module (passed in; this package never imports it)."""
        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            layer_offset=layer_offset,
        )


def _size(g: Any) -> int:
    return 1 if g is None else dist.get_world_size(g)


def _rank(g: Any) -> int:
    return 0 if g is None else dist.get_rank(g)


def _all_gather(t: torch.Tensor, g: Any) -> list[torch.Tensor]:
    if _size(g) == 1:
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(_size(g))]
    dist.all_gather(out, t, group=g)
    return out


def _detect_placement(names: Iterable[str], groups: ExportGroups) -> Placement:
    names = list(names)
    grouped = any(re.search(r"\.experts\.linear_fc[12]\.weight\d+$", n) for n in names)
    te = any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    return Placement(
        layer_offset=groups.layer_offset,
        ep_rank=_rank(groups.ep),
        ep_size=_size(groups.ep),
        grouped_experts=grouped,
        te_norms=te,
    )


def _units(maps: list[ParamMap], arch: ModelArch, ep_size: int) -> list[list[ParamMap]]:
    """Export units in HF order; expert params are grouped so one EP all-gather serves one local index.

    A unit of experts holds, for one layer / leaf / local expert index j, the experts j, n + j, 2n + j, ...
    (n experts per EP rank), i.e. exactly what an all-gather of local expert j over the EP group returns.
    """
    n_local = arch.num_experts // ep_size if arch.is_moe else 0
    units: list[list[ParamMap]] = []
    pending: dict[tuple[int, str], list[ParamMap]] = {}
    for pm in maps:
        if not pm.is_expert:
            units.extend(pending.values())
            pending.clear()
            units.append([pm])
            continue
        leaf = pm.mcore.split(f"local_experts.{pm.expert}.", 1)[1]  # e.g. linear_fc1.weight
        key = (pm.expert % n_local, leaf)
        pending.setdefault(key, []).append(pm)
    units.extend(pending.values())
    for u in units:
        if u[0].is_expert:
            u.sort(key=lambda p: p.expert)
    return units


def iter_hf_buckets(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    arch: ModelArch,
    *,
    bucket_bytes: int,
    groups: ExportGroups | None = None,
    dtype: torch.dtype | None = None,
    receive: bool | None = None,
    stage_only: bool = False,
    together: Mapping[str, tuple[str, ...]] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of `(hf_name, tensor)` of at most `bucket_bytes` each (a larger single tensor comes alone).

    params: this rank's megatron `(name, tensor)` pairs (see the module contract). dtype: cast on export.
    receive: whether this rank yields the buckets; None = the default exporter (see the module contract).
    stage_only: a receiving rank yields only the tensors its own pipeline stage holds, and nothing moves
    over the pipeline group (each stage feeds its own weights group, `sync.stages`).
    Tensors yielded are CPU/device tensors detached from the model; they may alias the model's storage
    when no gather or transform was needed, so consume a bucket before the next optimizer step.
    together: groups of HF names that no bucket boundary may cut (`bridge.bucketing`); a bucket then
    exceeds `bucket_bytes` only where one group's span does.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups = groups or ExportGroups()
    local = dict(params.items() if isinstance(params, Mapping) else params)
    local = {n: t.detach() for n, t in local.items() if not _SKIP.search(n)}
    place = _detect_placement(local, groups)
    # PP receive buffers live where the parameters do: an NCCL group cannot receive into host memory.
    device = next(iter(local.values())).device if local else torch.device("cpu")
    maps = param_maps(arch)
    tp, etp, ep, pp = groups.tp, groups.etp, groups.ep, groups.pp
    pp_rank, pp_size = _rank(pp), _size(pp)

    # Which map entries this rank holds, under which local name.
    held: dict[str, str] = {}
    for pm in maps:
        name = megatron_name(pm, arch, place)
        if name is not None and name in local:
            held[pm.mcore] = name
    unused = set(local) - set(held.values())
    if arch.tie_embeddings and pp_size > 1:
        unused.discard("output_layer.weight")
    if unused:
        raise MegagrpoError(
            f"megatron parameter {sorted(unused)[0]!r} (and {len(unused) - 1} more) has no entry in the "
            f"{arch.family} parameter map; the model does not match the architecture"
        )

    # Which pipeline stage owns each entry, and the dtype / padded vocab, agreed by every stage.
    my_layers = sorted({pm.layer for pm in maps if pm.mcore in held and pm.layer is not None})
    if receive is None:
        receive = _rank(tp) == 0 and _rank(etp) == 0 and _rank(ep) == 0 and pp_rank == 0
    info = {
        "receive": bool(receive),
        "layers": my_layers,
        "first": "embedding.word_embeddings.weight" in held,
        "last": "decoder.final_layernorm.weight" in held,
        "dtypes": {pm.mcore: local[held[pm.mcore]].dtype for pm in maps if pm.mcore in held},
    }
    emb = held.get("embedding.word_embeddings.weight")
    info["padded_vocab"] = local[emb].shape[0] * _size(tp) if emb else None
    infos = [info]
    if pp_size > 1:
        infos = [None] * pp_size
        dist.all_gather_object(infos, info, group=pp)
    owner_of_layer = {layer: s for s, inf in enumerate(infos) for layer in inf["layers"]}
    first = next(s for s, inf in enumerate(infos) if inf["first"])
    last = next(s for s, inf in enumerate(infos) if inf["last"])
    padded_vocab = infos[first]["padded_vocab"]
    missing = [pm.mcore for pm in maps if pm.layer is not None and pm.layer not in owner_of_layer]
    if missing:
        raise MegagrpoError(f"no pipeline stage holds {missing[0]!r}; check layer_offset and the model")

    receivers = [s for s, inf in enumerate(infos) if inf["receive"]]
    out_dtype = dtype
    filler = BucketFiller(bucket_bytes, together)
    # stacked HF expert tensors (gpt-oss), per name: each expert's slice until the last one arrives; at
    # most one layer's experts are held
    stacks: dict[str, dict[int, torch.Tensor]] = {}

    for unit in _units(maps, arch, place.ep_size):
        pm0 = unit[0]
        if pm0.layer is not None:
            owner = owner_of_layer[pm0.layer]
        else:
            owner = first if pm0.mcore.startswith("embedding.") else last
        fulls: list[torch.Tensor] | None = None
        if pp_rank == owner:
            if pm0.is_expert:
                mine = [pm for pm in unit if pm.mcore in held]
                if len(mine) != 1:
                    raise MegagrpoError(
                        f"EP rank {place.ep_rank} holds {len(mine)} of expert unit {pm0.mcore}"
                    )
                gathered = _all_gather(local[held[mine[0].mcore]], ep)  # experts j, n+j, ... in EP rank order
                fulls = [tp_unshard(pm, _all_gather(t, etp)) for pm, t in zip(unit, gathered, strict=True)]
            else:
                if pm0.mcore not in held:
                    raise MegagrpoError(f"pipeline stage {owner} should hold {pm0.mcore!r} but does not")
                fulls = [tp_unshard(pm0, _all_gather(local[held[pm0.mcore]], tp))]
        for dst in () if stage_only else receivers:
            if dst == owner:
                continue
            if pp_rank == owner:
                for t in fulls:
                    dist.send(t.contiguous(), dist.get_global_rank(pp, dst), group=pp)
            elif pp_rank == dst:
                fulls = []
                # the sender holds one expert of an expert unit (its EP rank's); all share one dtype
                dtypes = infos[owner]["dtypes"]
                unit_dtype = next(dtypes[pm.mcore] for pm in unit if pm.mcore in dtypes)
                for pm in unit:
                    t = torch.empty(_full_shape(pm, arch, padded_vocab), dtype=unit_dtype, device=device)
                    dist.recv(t, dist.get_global_rank(pp, owner), group=pp)
                    fulls.append(t)
        if not receive or (stage_only and pp_rank != owner):
            continue
        for pm, full in zip(unit, fulls, strict=True):
            for name, t in zip(pm.hf, to_hf(pm, full, arch), strict=True):
                keep = out_dtype is None or t.dtype == out_dtype or pm.mcore.endswith(BUFFER_SUFFIXES)
                t = t if keep else t.to(out_dtype)
                if pm.stacked:
                    slices = stacks.setdefault(name, {})
                    slices[pm.expert] = t
                    if len(slices) < arch.num_experts:
                        continue
                    t = torch.stack([slices[e] for e in range(arch.num_experts)])
                    del stacks[name]
                ready = filler.add(name, t.contiguous())
                if ready is not None:
                    yield ready
                    del ready  # held no longer than the consumer holds it
    last_bucket = filler.finish()
    if last_bucket is not None:
        yield last_bucket


def _full_shape(pm: ParamMap, arch: ModelArch, padded_vocab: int) -> tuple[int, ...]:
    shapes = pm.hf_shapes
    if pm.kind == "vocab":
        return (padded_vocab, *shapes[0][1:])
    if pm.kind in ("qkv", "gate_up"):
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    if pm.kind in ("gate_up_interleaved", "transpose"):
        return tuple(reversed(shapes[0]))
    return shapes[0]
