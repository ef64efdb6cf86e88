"""Training-health warnings computed from the metric history.

Each rule looks at a trailing window of steps and names the metric that triggered it, so a user sees
"entropy collapsing" before the run is lost rather than after.
"""

from __future__ import annotations

from megagrpo.config.schema import HealthThresholds

# The rules take the schema's section (`logging.health`) directly: its fields and defaults are the only ones.
HealthConfig = HealthThresholds


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def health_warnings(history: list[dict[str, float]], cfg: HealthThresholds | None = None) -> list[str]:
    """Return human-readable warnings for the latest step (empty when healthy or too little history)."""
    cfg = cfg if cfg is not None else HealthThresholds()
    w = cfg.window
    if len(history) < 2 * w:
        return []

    def series(key: str) -> tuple[list[float], list[float]] | None:
        vals = [h.get(key) for h in history[-2 * w :]]
        if any(v is None for v in vals):
            return None
        return vals[:w], vals[w:]

    out = []
    ent = series("loss/entropy")
    if ent and _mean(ent[0]) > 0 and _mean(ent[1]) < cfg.entropy_drop * _mean(ent[0]):
        out.append(f"entropy collapsing: loss/entropy {_mean(ent[0]):.3g} -> {_mean(ent[1]):.3g}")
    ln = series("rollout/response_len_mean")
    if ln and _mean(ln[0]) > 0 and _mean(ln[1]) > cfg.length_growth * _mean(ln[0]):
        out.append(f"response length exploding: {_mean(ln[0]):.3g} -> {_mean(ln[1]):.3g} tokens")
    rw, clip = series("reward/mean"), series("loss/clip_frac_high")
    if rw and clip:
        flat = abs(_mean(rw[1]) - _mean(rw[0])) < cfg.reward_flat_tol
        if flat and _mean(clip[1]) - _mean(clip[0]) > cfg.clip_rise:
            out.append(
                f"reward flat ({_mean(rw[1]):.3g}) while clip fraction rises "
                f"{_mean(clip[0]):.3g} -> {_mean(clip[1]):.3g}"
            )
    return out
