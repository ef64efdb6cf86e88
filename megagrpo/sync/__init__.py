"""Weight sync learner -> SGLang: buckets of HF-named tensors, update_weights_from_tensor, checksums, timing."""

from megagrpo.sync.buckets import DEFAULT_BUCKET_BYTES, bucketize, layer_of
from megagrpo.sync.weights import (
    SyncStats,
    checkpoint_shapes,
    engine_checksums,
    sync_weights,
    validate_buckets,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SyncStats",
    "bucketize",
    "checkpoint_shapes",
    "engine_checksums",
    "layer_of",
    "sync_weights",
    "validate_buckets",
]
