"""A megatron-core `torch_dist` checkpoint written chunk by chunk, without holding the model in memory.

megatron-core's torch_dist format is a `torch.distributed.checkpoint` (DCP) directory plus
`metadata.json`. Every megatron `ShardedTensor` becomes a DCP tensor (key, global shape) whose stored
chunks are the local shards; `ShardedObject`s become byte items under their `unique_key`. A loader on any
mesh reads the chunks overlapping its own shards, so a checkpoint written from the TP=EP=PP=1 layout
loads everywhere.

The caller (tools/convert_hf_to_megatron.py) lists the chunks from megatron's own `sharded_state_dict()`
of a model built on the meta device, so keys and shapes are exactly megatron's; this module only
plans them and asks `produce(param_name)` for data when DCP writes each chunk, one at a time.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

# megatron-core >= 0.16 stores the non-sharded part of the state dict as ShardedObject("common_state",
# global_shape=(1,), global_offset=(0,)) inside the DCP checkpoint (no common.pt).
COMMON_STATE_KEY = "common_state/shard_0_1"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


@dataclass(frozen=True)
class ChunkSpec:
    """One stored chunk of a DCP tensor.

    key: dist-checkpoint key (megatron `ShardedTensor.key`), global_shape / offsets / sizes: the chunk's
    place in the global tensor (prepended layer / expert axes included). source: the model's
    `state_dict` name whose data the chunk is; view: (size, stride, storage_offset) of the chunk inside
    that contiguous parameter (a whole parameter, or e.g. the gate half of a SwiGLU fc1).
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    source: str
    view: tuple[tuple[int, ...], tuple[int, ...], int]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ObjectSpec:
    """A megatron `ShardedObject`: stored as `torch.save([data])` bytes under its unique key."""

    unique_key: str
    data: Any


class _StreamingPlanner(DefaultSavePlanner):
    """Plans write items from chunk specs and materialises each chunk only when DCP writes it."""

    def __init__(self, chunks: Sequence[ChunkSpec], objects: Sequence[ObjectSpec], produce, on_chunk) -> None:
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False
        )
        self._chunks = {MetadataIndex(c.key, torch.Size(c.offsets)): c for c in chunks}
        self._objects = {o.unique_key: o for o in objects}
        self._produce = produce
        self._on_chunk = on_chunk
        self._cache: tuple[str, torch.Tensor] | None = None

    def create_local_plan(self) -> SavePlan:
        items = []
        for obj in self._objects.values():
            items.append(WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO))
        for idx, c in self._chunks.items():
            items.append(
                WriteItem(
                    index=idx,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                        properties=TensorProperties(dtype=c.dtype),
                        size=torch.Size(c.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([self._objects[write_item.index.fqn].data], buf)
            buf.seek(0)
            return buf
        c = self._chunks[MetadataIndex(write_item.index.fqn, write_item.index.offset)]
        # one-entry cache: the two SwiGLU halves of an fc1 are consecutive chunks of one parameter
        if self._cache is None or self._cache[0] != c.source:
            self._cache = None  # drop the previous parameter before producing the next
            full = self._produce(c.source)
            if full.dtype != c.dtype:
                full = full.to(c.dtype)
            full = full.contiguous()
            if full.storage_offset() or full.untyped_storage().nbytes() != full.numel() * full.element_size():
                # a view into a larger tensor (one expert's slice of a stacked HF tensor): the chunk views
                # below index storage from its start
                full = full.clone()
            self._cache = (c.source, full)
        size, stride, offset = c.view
        out = self._cache[1].as_strided(size, stride, offset)
        if out.numel() != c.numel:
            raise RuntimeError(f"chunk of {c.key} has shape {tuple(out.shape)}, expected {c.sizes}")
        if self._on_chunk is not None:
            self._on_chunk(c)
        # prepended layer / expert axes are size 1 in the chunk; a part of a parameter (a SwiGLU half) is
        # copied to a compact storage, a whole parameter is written as it is
        whole = out.numel() == self._cache[1].numel()
        return out.reshape(c.sizes) if whole else out.reshape(c.sizes).clone()


def write_dist_checkpoint(
    out_dir: str | Path,
    chunks: Sequence[ChunkSpec],
    objects: Sequence[ObjectSpec],
    produce: Callable[[str], torch.Tensor],
    *,
    on_chunk: Callable[[ChunkSpec], None] | None = None,
) -> None:
    """Write the torch_dist checkpoint into an existing, empty `out_dir` (one process, one file).

    Chunks are written in the given order; `produce(source)` is called once per run of consecutive chunks
    with the same source, so peak memory is one full parameter plus its HF inputs.
    """
    out = Path(out_dir)
    planner = _StreamingPlanner(chunks, objects, produce, on_chunk)
    writer = FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1, sync_files=True)
    dcp_save(state_dict={}, storage_writer=writer, planner=planner, no_dist=True)
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


def chunks_from_sharded_state_dict(sharded_sd: dict[str, Any]) -> tuple[list[ChunkSpec], list[ObjectSpec]]:
    """Chunk / object specs from a megatron `sharded_state_dict()` of a single-process (TP=EP=PP=1) model.

    Duck-typed on megatron's ShardedTensor (`key`, `global_shape`, `global_offset`, `data`),
    ShardedTensorFactory (`build()`) and ShardedObject (`unique_key`, `data`); the dict keys are the
    model's state_dict names, which identify the source parameter of every chunk.
    """
    chunks: list[ChunkSpec] = []
    objects: list[ObjectSpec] = []
    common: dict[str, Any] = {}
    for name, obj in sharded_sd.items():
        if not any(hasattr(obj, a) for a in ("build", "global_shape", "unique_key")):
            common[name] = obj  # megatron keeps non-sharded values in one "common_state" object
            continue
        if hasattr(obj, "build") and callable(obj.build) and not hasattr(obj, "global_shape"):
            parts = obj.build()
            parts = parts if isinstance(parts, (list, tuple)) else [parts]
        else:
            parts = [obj]
        for p in parts:
            if type(p).__name__ == "ShardedObject":
                objects.append(ObjectSpec(p.unique_key, p.data))
                continue
            if getattr(p, "flattened_range", None) is not None:
                raise ValueError(f"{name}: flattened shards are not supported by the streaming writer")
            data = p.data
            chunks.append(
                ChunkSpec(
                    key=p.key,
                    global_shape=tuple(p.global_shape),
                    offsets=tuple(p.global_offset),
                    sizes=(1,) * p.prepend_axis_num + tuple(p.local_shape),
                    dtype=data.dtype,
                    source=name,
                    view=(tuple(data.shape), tuple(data.stride()), int(data.storage_offset())),
                )
            )
    objects.append(ObjectSpec(COMMON_STATE_KEY, common))
    # group chunks of one source together (the factory halves are already adjacent)
    order = {n: i for i, n in enumerate(dict.fromkeys(c.source for c in chunks))}
    chunks.sort(key=lambda c: order[c.source])
    return chunks, objects
