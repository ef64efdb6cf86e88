"""Issue 25, item 3: TIS and MIS on together weigh a kept token by the ratio once, min(r, C) * 1[kept],
through the trainer's own path (`GRPOTrainer._importance`), at every level; the product of the two
sections' weights gave min(r, C) * r, above the TIS cap. Every shipped config computes its rule."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

from megagrpo.algo.importance import combine_corrections, importance_masks
from megagrpo.config import config_from_dict, load_config
from megagrpo.diagnostics.reduce import LocalReducer
from megagrpo.errors import MegagrpoError
from megagrpo.trainer.grpo import GRPOTrainer, correction_caps, correction_masks

REPO = Path(__file__).resolve().parents[3]

# Token ratios pi_learner / pi_sampler per row; None is padding. Sequence ratio = product, geometric =
# exp(mean log): row 0: 1.62 / 1.174, row 1: 3.0 / 1.316, row 2: 0.24 / 0.490, row 3: 2.2 / 1.483.
RATIOS = [[1.5, 1.2, 0.9, None], [3.0, 1.0, 1.0, 1.0], [0.3, 0.8, None, None], [2.2, 1.0, None, None]]


def batch():
    mask = torch.tensor([[r is not None for r in row] for row in RATIOS])
    ratio = torch.tensor([[r if r is not None else 1.0 for r in row] for row in RATIOS], dtype=torch.float64)
    sampler = torch.full(mask.shape, -1.5, dtype=torch.float64)
    return sampler + ratio.log(), {"sampler_logp": sampler, "loss_mask": mask}


def level_ratio(row: list, level: str, t: int) -> float:
    """The ratio at `level` that token t of `row` carries, from the table above."""
    tokens = [r for r in row if r is not None]
    if level == "token":
        return row[t]
    seq = math.prod(tokens)
    return seq if level == "sequence" else seq ** (1 / len(tokens))


def trainer(algo: dict | None = None, cfg=None):
    """The state `_importance` reads, from a validated config."""
    cfg = cfg or config_from_dict({"model": {"hf_path": "m"}, "algo": algo})
    tis_cap, mis_cap = correction_caps(cfg.algo)
    return types.SimpleNamespace(cfg=cfg, tis_cap=tis_cap, mis_cap=mis_cap, _dp_reducer=LocalReducer)


def run(t) -> tuple[torch.Tensor, dict]:
    old_logp, b = batch()
    metrics: dict = {}
    return GRPOTrainer._importance(t, old_logp, b, metrics), metrics


def expected(tis: dict, mis: dict) -> torch.Tensor:
    """min(r_tis, C) * 1[cap_low <= r_mis <= cap] token by token (tis truncates, mis masks)."""
    out = torch.zeros(len(RATIOS), len(RATIOS[0]), dtype=torch.float64)
    for i, row in enumerate(RATIOS):
        for t, r in enumerate(row):
            if r is None:
                continue
            r_mis = level_ratio(row, mis["level"], t)
            kept = 1 / mis["cap"] <= r_mis <= mis["cap"]
            out[i, t] = min(level_ratio(row, tis["level"], t), tis["cap"]) if kept else 0.0
    return out


@pytest.mark.parametrize(
    "tis,mis",
    [
        # token IS with token rejection (verl's token preset)
        ({"level": "token", "cap": 2.0}, {"level": "token", "cap": 2.5}),
        ({"level": "sequence", "cap": 2.0}, {"level": "sequence", "cap": 2.5}),
        ({"level": "geometric", "cap": 1.25}, {"level": "geometric", "cap": 1.45}),
        # sequence TIS with geometric rejection (verl's sequence preset)
        ({"level": "sequence", "cap": 2.0}, {"level": "geometric", "cap": 1.45}),
    ],
    ids=["token", "sequence", "geometric", "seq_tis_geo_mis"],
)
def test_tis_with_mis_weighs_a_kept_token_by_the_truncated_ratio_once(tis, mis):
    t = trainer({"tis": {"enabled": True, "mode": "truncate", **tis}, "mis": {"enabled": True, **mis}})
    assert t.cfg.algo.mis.mode == "mask"
    w, metrics = run(t)
    want = expected(tis, mis)
    torch.testing.assert_close(w, want.to(w.dtype))
    # The case is not trivial: a token is truncated at the cap, one kept below it, one rejected.
    _, b = batch()
    m = b["loss_mask"]
    assert (want == tis["cap"]).any() and ((want > 0) & (want < tis["cap"])).any() and (m & (want == 0)).any()
    assert float(w.max()) <= tis["cap"]
    assert "mismatch/is_weight_mean" in metrics and "mismatch/mis_weight_mean" in metrics


def test_a_masking_tis_with_a_truncating_mis_takes_the_weight_from_mis():
    # tis mask at sequence level (cap 2.5, floor 0.4) keeps rows 0 and 3; mis truncates the geometric mean.
    w, _ = run(
        trainer(
            {
                "tis": {"enabled": True, "mode": "mask", "level": "sequence", "cap": 2.5},
                "mis": {"enabled": True, "mode": "truncate", "level": "geometric", "cap": 1.25},
            }
        )
    )
    want = expected({"level": "geometric", "cap": 1.25}, {"level": "sequence", "cap": 2.5})
    torch.testing.assert_close(w, want.to(w.dtype))
    assert float(w.max()) <= 1.25


def test_two_masks_keep_tis_s_ratio_where_both_keep():
    w, _ = run(
        trainer(
            {
                "tis": {"enabled": True, "mode": "mask", "level": "token", "cap": 2.5},
                "mis": {"enabled": True, "mode": "mask", "level": "sequence", "cap": 2.5},
            }
        )
    )
    tok = expected({"level": "token", "cap": math.inf}, {"level": "token", "cap": 2.5})  # r * 1[tis keeps]
    seq_kept = expected({"level": "token", "cap": math.inf}, {"level": "sequence", "cap": 2.5}) != 0
    torch.testing.assert_close(w, torch.where(seq_kept, tok, 0.0).to(w.dtype))


def test_one_section_alone_keeps_its_own_weight():
    old_logp, b = batch()
    for algo in ({"tis": {"enabled": True, "cap": 2.0}}, {"mis": {"enabled": True, "cap": 2.5}}):
        w, _ = run(trainer(algo))
        spec = next(v for v in algo.values())
        mode = "truncate" if "tis" in algo else "mask"
        low = None if mode == "truncate" else 1 / spec["cap"]
        ref = importance_masks(
            old_logp,
            b["sampler_logp"],
            b["loss_mask"],
            level="token",
            mode=mode,
            cap_high=spec["cap"],
            cap_low=low,
        )
        torch.testing.assert_close(w, ref.weights)
    assert run(trainer({}))[0] is None


def test_two_truncations_are_refused():
    with pytest.raises(MegagrpoError, match=r"algo\.mis\.mode: 'truncate' with algo\.tis\.mode=truncate"):
        config_from_dict(
            {
                "model": {"hf_path": "m"},
                "algo": {"tis": {"enabled": True}, "mis": {"enabled": True, "mode": "truncate"}},
            }
        )
    old_logp, b = batch()
    m = importance_masks(
        old_logp, b["sampler_logp"], b["loss_mask"], level="token", mode="truncate", cap_high=2.0
    )
    with pytest.raises(ValueError, match="two truncating"):
        combine_corrections([("truncate", m), ("truncate", m)])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates_and_computes_its_rule(path):
    """Each shipped config (its `auto` caps at their starting value): one section alone keeps its own
    weight; both give the lead section's weight times the other's mask. None ships both on today."""
    t = trainer(cfg=load_config(path, check_paths=False))
    a = t.cfg.algo
    w, _ = run(t)
    old_logp, b = batch()
    masks = {}
    for name, spec, auto in (("tis", a.tis, t.tis_cap), ("mis", a.mis, t.mis_cap)):
        if spec.enabled:
            cap = auto.cap if auto is not None else float(spec.cap)
            masks[name] = correction_masks(spec, cap, old_logp, b["sampler_logp"], b["loss_mask"])
    if not masks:
        assert w is None
    elif len(masks) == 1:
        torch.testing.assert_close(w, next(iter(masks.values())).weights)
    else:
        lead, other = ("mis", "tis") if a.mis.mode == "truncate" else ("tis", "mis")
        torch.testing.assert_close(w, torch.where(masks[other].zero_weight, 0.0, masks[lead].weights))
        assert float(w.max()) <= float(masks[lead].weights.max())
