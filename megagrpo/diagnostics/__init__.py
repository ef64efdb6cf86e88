"""Sampler-vs-learner mismatch diagnostics: the `mismatch/` metric set, attribution to routing and
precision, and the adaptive TIS/MIS cap. Pure tensor math (torch only)."""

from megagrpo.diagnostics.adaptive_cap import AdaptiveCap
from megagrpo.diagnostics.attribution import attribute_mismatch, attribution_shares
from megagrpo.diagnostics.mismatch import MismatchResult, mismatch_metrics, token_ratio_metric_name
from megagrpo.diagnostics.reduce import DistReducer, LocalReducer, Reducer

__all__ = [
    "AdaptiveCap",
    "DistReducer",
    "LocalReducer",
    "MismatchResult",
    "Reducer",
    "attribute_mismatch",
    "attribution_shares",
    "mismatch_metrics",
    "token_ratio_metric_name",
]
