"""SGLang sampler: engine life cycle, batched generation with logprobs and routed experts, dynamic sampling."""

from megagrpo.rollout.completion import NO_ROUTE, Completion, decode_routes
from megagrpo.rollout.config import RolloutConfig, SamplingConfig
from megagrpo.rollout.dynamic import DynamicBatch, DynamicSamplingConfig, check_group_size, dynamic_sample
from megagrpo.rollout.engines.engine import MEMORY_TAGS, RolloutEngine

__all__ = [
    "MEMORY_TAGS",
    "NO_ROUTE",
    "Completion",
    "DynamicBatch",
    "DynamicSamplingConfig",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingConfig",
    "check_group_size",
    "dynamic_sample",
    "decode_routes",
]
