"""Weight sync learner -> SGLang: buckets of HF-named tensors, update_weights_from_tensor, checksums, timing."""

from megagrpo.sync.buckets import DEFAULT_BUCKET_BYTES, bucketize, layer_of
from megagrpo.sync.checks import checkpoint_shapes, validate_buckets
from megagrpo.sync.checksums import engine_checksums
from megagrpo.sync.stats import SyncStats
from megagrpo.sync.weights import sync_weights

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
