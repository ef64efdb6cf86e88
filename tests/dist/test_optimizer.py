"""`megagrpo.learner.optimizer` without a mesh: config validation, the LR schedule, argument checks.

The optimizer itself (megatron Adam / DistributedOptimizer on 1 process, DP2 and TP2, with resume) is
exercised in tests/dist/test_checkpoint.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.learner.optimizer import OptimizerConfig, build_optimizer, build_scheduler


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.0),
        ("min_lr", 2.0),
        ("weight_decay", -0.1),
        ("betas", (0.9, 1.0)),
        ("eps", 0.0),
        ("clip_grad", -1.0),
        ("decay_style", "exponential"),
        ("total_steps", 0),
        ("warmup_steps", 10),
    ],
)
def test_invalid_config_names_the_field(field, value):
    cfg = OptimizerConfig(**{"lr": 1.0, "total_steps": 10, field: value})
    with pytest.raises(MegagrpoError, match=rf"optimizer\.{field}="):
        cfg.validate()


def _lrs(cfg: OptimizerConfig, steps: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(1)
    return out


def test_warmup_is_linear_and_never_zero_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=3, decay_style="cosine", total_steps=7)
    lrs = _lrs(cfg, 9)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for k in range(3, 8):  # cosine from lr at the end of warm-up to min_lr at total_steps
        ratio = (k - 3) / 4
        assert lrs[k] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * ratio)))
    assert lrs[8] == pytest.approx(0.1)


def test_constant_schedule_and_weight_decay():
    cfg = OptimizerConfig(lr=3e-6, weight_decay=0.05, total_steps=4)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    build_scheduler(opt, cfg)
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-6)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.05)
    assert _lrs(cfg, 4) == pytest.approx([3e-6] * 4)


def test_build_optimizer_needs_megatron_ddp_chunks():
    with pytest.raises(ValueError, match="wrap_ddp"):
        build_optimizer([torch.nn.Linear(2, 2)], OptimizerConfig())
    with pytest.raises(ValueError, match="empty"):
        build_optimizer([], OptimizerConfig())
