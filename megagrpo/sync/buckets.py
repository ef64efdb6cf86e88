"""Group a stream of `(hf_name, tensor)` into buckets for `update_weights_from_tensor`.

A bucket never splits one MoE layer's experts when they fit together: SGLang's `load_weights` builds
`dict(model.named_parameters())` once per call, so many tiny calls cost O(calls x params); fewer, larger
buckets keep the per-call overhead proportional to the bytes sent. Nor does it ever split a group of
tensors that SGLang fuses at load (`sglang_layout.load_groups`), whose halves its loader may drop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from megagrpo.bridge.bucketing import BucketFiller, NamedTensor, tensor_bytes
from megagrpo.sync.sglang_layout import load_groups

DEFAULT_BUCKET_BYTES = 512 << 20

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer index in an HF name (`model.layers.3.mlp...` -> 3), None for embeddings/head/norm."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def bucketize(
    named_tensors: Iterable[NamedTensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[NamedTensor]]:
    """Yield lists of `(hf_name, tensor)` of at most `bucket_bytes` each, in input order, lazily.

    Buckets close only at decoder-layer boundaries (`layer_of`), so one layer's tensors (attention and all
    of its experts) travel together; a layer larger than `bucket_bytes` is split, never inside a group
    that SGLang fuses at load (`sglang_layout.load_groups`, read from the layer's own tensors: such a
    group lies within one layer), and a single tensor larger than `bucket_bytes` goes alone. Holds one
    layer and one bucket at most.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for layer in _layers(named_tensors):
        layer_size = sum(tensor_bytes(t) for _, t in layer)
        if bucket and size + layer_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        if layer_size <= bucket_bytes or len(layer) == 1:
            bucket += layer
            size += layer_size
            continue
        filler = BucketFiller(bucket_bytes, load_groups({n: tuple(t.shape) for n, t in layer}))
        filler.bucket, filler.size = bucket, size
        for name, t in layer:
            ready = filler.add(name, t)
            if ready is not None:
                yield ready
        bucket, size = filler.bucket, filler.size
    if bucket:
        yield bucket


def _layers(named_tensors: Iterable[NamedTensor]) -> Iterator[list[NamedTensor]]:
    """Runs of consecutive tensors of one decoder layer (or of none: embeddings, norm, head)."""
    run: list[NamedTensor] = []
    current: object = object()
    for name, t in named_tensors:
        lid = layer_of(name)
        if lid != current and run:
            yield run
            run = []
        current = lid
        run.append((name, t))
    if run:
        yield run
