"""Group a stream of `(hf_name, tensor)` into buckets for `update_weights_from_tensor`.

A bucket never splits one MoE layer's experts when they fit together: SGLang's `load_weights` builds
`dict(model.named_parameters())` once per call, so many tiny calls cost O(calls x params); fewer, larger
buckets keep the per-call overhead proportional to the bytes sent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 << 20

_LAYER = re.compile(r"\.layers\.(\d+)\.")

NamedTensor = tuple[str, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_of(name: str) -> int | None:
    """The decoder layer index in an HF name (`model.layers.3.mlp...` -> 3), None for embeddings/head/norm."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def bucketize(
    named_tensors: Iterable[NamedTensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[NamedTensor]]:
    """Yield lists of `(hf_name, tensor)` of at most `bucket_bytes` each, in input order, lazily.

    Buckets close only at decoder-layer boundaries (`layer_of`), so one layer's tensors (attention and all
    of its experts) travel together; a layer larger than `bucket_bytes` is split greedily, and a single
    tensor larger than `bucket_bytes` goes alone.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    layer: list[NamedTensor] = []
    size = layer_size = 0
    current: object = object()
    for name, t in named_tensors:
        lid = layer_of(name)
        if lid != current and layer:
            if bucket and size + layer_size > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket += layer
            size += layer_size
            layer, layer_size = [], 0
        current = lid
        n = tensor_bytes(t)
        if layer and layer_size + n > bucket_bytes:  # one layer larger than a bucket: split it
            if bucket:
                yield bucket
                bucket, size = [], 0
            yield layer
            layer, layer_size = [], 0
        layer.append((name, t))
        layer_size += n
    if layer:
        if bucket and size + layer_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += layer
    if bucket:
        yield bucket
