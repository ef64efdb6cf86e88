"""`tis.cap: auto` / `mis.cap: auto`: the importance-weight cap set from measured token-ratio quantiles.

Rule (deterministic): each step contributes one measurement q_s, the token-ratio quantile `quantile`
(config `tis.auto.quantile`, default 0.999: the p99.9 of pi/mu over the step's valid tokens, read from
`mismatch_metrics(...).metrics` under `token_ratio_metric_name(quantile)`; pass a non-standard quantile
to `mismatch_metrics` in `extra_token_quantiles`, or measure only it with `token_ratio_quantiles`).
Over the last `window` measurements the cap is

    cap = clamp(margin · exp(mean_s log q_s), cap_min, cap_max)

i.e. the geometric mean of the recent quantiles (ratios live on a log scale; a geometric mean is not
dragged by one spiky step as much as an arithmetic one), times a safety margin, clamped to the configured
range (config `tis.auto.clamp` = [cap_min, cap_max]). Before the first measurement the cap is
`clamp(initial, cap_min, cap_max)` (initial defaults to cap_max: no truncation beyond the widest allowed
cap until something was measured). A step with no valid token (`mismatch/n_tokens` = 0) contributes
nothing. The same class can serve a lower MIS floor: `quantile=0.001` and a range below 1.

The measured quantiles are histogram quantiles (`megagrpo.algo.quantiles`, bounded by DP all-reduces of a
fixed size): a bin edge on the outward side of the exact quantile, so an upper quantile (a cap) is never
below the exact one and a lower one (a floor) never above, by at most a factor exp(1.09%·|log q| + 2^-23).
The cap from them thus truncates or masks no token that the exact quantile's cap would keep.

The cap to use at step s is `cap` read *before* `update` with step s's measurement (the weights of a step
cannot depend on a quantile measured on themselves after the fact without a second pass); callers that
do measure first may update first, the rule is the same. The state is the list of recent measurements,
saved by `state_dict()` (plain floats, JSON-serialisable) for resume.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from megagrpo.diagnostics.mismatch import token_ratio_metric_name


class AdaptiveCap:
    """Windowed, clamped cap from a measured ratio quantile; logged as `log_name` (e.g. mismatch/tis_cap)."""

    def __init__(
        self,
        *,
        cap_min: float,
        cap_max: float,
        window: int = 10,
        quantile: float = 0.999,
        margin: float = 1.0,
        initial: float | None = None,
        log_name: str = "mismatch/tis_cap",
    ):
        if not (math.isfinite(cap_min) and math.isfinite(cap_max)) or cap_min <= 0 or cap_min > cap_max:
            raise ValueError(
                f"AdaptiveCap: need 0 < cap_min <= cap_max, finite; got cap_min={cap_min}, cap_max={cap_max}"
            )
        if int(window) != window or window < 1:
            raise ValueError(f"AdaptiveCap: window must be an integer >= 1, got {window}")
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"AdaptiveCap: quantile must be in [0, 1], got {quantile}")
        if not math.isfinite(margin) or margin <= 0:
            raise ValueError(f"AdaptiveCap: margin must be finite and > 0, got {margin}")
        if initial is not None and (not math.isfinite(initial) or initial <= 0):
            raise ValueError(f"AdaptiveCap: initial must be finite and > 0, got {initial}")
        self.cap_min = float(cap_min)
        self.cap_max = float(cap_max)
        self.window = int(window)
        self.quantile = float(quantile)
        self.metric = token_ratio_metric_name(self.quantile)
        self.margin = float(margin)
        self.initial = float(initial) if initial is not None else self.cap_max
        self.log_name = log_name
        self._log_q: deque[float] = deque(maxlen=self.window)
        self._steps = 0

    @classmethod
    def from_auto_config(cls, auto, *, log_name: str = "mismatch/tis_cap") -> AdaptiveCap:
        """From a config section with `quantile`, `window`, `clamp=[low, high]` (e.g. `algo.tis.auto`)."""
        low, high = auto.clamp
        return cls(cap_min=low, cap_max=high, window=auto.window, quantile=auto.quantile, log_name=log_name)

    def _clamp(self, x: float) -> float:
        return min(self.cap_max, max(self.cap_min, x))

    @property
    def cap(self) -> float:
        if not self._log_q:
            return self._clamp(self.initial)
        mean_log = sum(self._log_q) / len(self._log_q)
        # Decide the clamp in log space so a huge quantile cannot overflow exp(), and return the bounds
        # exactly (exp(log(x)) may differ from x in the last bit).
        if mean_log >= math.log(self.cap_max / self.margin):
            return self.cap_max
        if mean_log <= math.log(self.cap_min / self.margin):
            return self.cap_min
        return self._clamp(self.margin * math.exp(mean_log))

    def update(self, metrics: Mapping[str, float]) -> float:
        """Add one step's measurement from a `mismatch_metrics(...).metrics` dict; returns the new cap."""
        n = metrics.get("mismatch/n_tokens")
        if n is not None and float(n) == 0:
            return self.cap
        if self.metric not in metrics:
            raise ValueError(
                f"AdaptiveCap: metrics lack {self.metric!r}; pass mismatch_metrics(..., "
                f"extra_token_quantiles=({self.quantile},)).metrics or token_ratio_quantiles(..., "
                f"[{self.quantile}])"
            )
        return self.observe(float(metrics[self.metric]))

    def observe(self, quantile: float) -> float:
        """Add one measured ratio quantile (> 0, may be +inf: saturates at cap_max); returns the new cap."""
        q = float(quantile)
        if math.isnan(q) or q <= 0:
            raise ValueError(f"AdaptiveCap: measured ratio quantile must be > 0, got {quantile}")
        self._log_q.append(math.log(q) if math.isfinite(q) else math.log(self.cap_max / self.margin))
        self._steps += 1
        return self.cap

    def metrics(self) -> dict[str, float]:
        return {self.log_name: self.cap}

    def state_dict(self) -> dict:
        return {"version": 1, "log_quantiles": list(self._log_q), "steps": self._steps}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore measurements. A shorter `window` than at save time keeps the most recent ones."""
        if state.get("version") != 1 or "log_quantiles" not in state:
            raise ValueError("AdaptiveCap.load_state_dict: not an AdaptiveCap state (version 1) dict")
        vals = [float(v) for v in state["log_quantiles"]]
        if not all(math.isfinite(v) for v in vals):
            raise ValueError("AdaptiveCap.load_state_dict: log_quantiles must be finite")
        self._log_q = deque(vals, maxlen=self.window)
        self._steps = int(state.get("steps", len(vals)))
