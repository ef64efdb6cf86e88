"""Issue 25, item 7: the step's rows move through device memory (NCCL) while the engine still holds its
pool, so the memory plan's rollout phase counts what the data plane holds there: two wire pieces and the
gathered per-row scalars (`plan.memory.rows_wire_bytes`)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.config import load_config
from megagrpo.plan.job import plan_memory
from megagrpo.plan.memory import (
    GIB,
    GROUP_SCALAR_BYTES,
    ROW_SCALAR_BYTES,
    ROWS_WIRE_CHUNK_BYTES,
    PlanMesh,
    Workload,
    plan_workload,
    rows_wire_bytes,
)
from megagrpo.rollout import Completion
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import WIRE_CHUNK_BYTES
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer.rows import row_scalars

REPO = Path(__file__).resolve().parents[3]
QWEN3_30B = arch_from_hf(REPO / "configs" / "models" / "Qwen3-30B-A3B")


def test_the_plan_s_wire_piece_is_the_data_plane_s():
    assert ROWS_WIRE_CHUNK_BYTES == WIRE_CHUNK_BYTES


def _owner_share(groups: int, G: int, scores: int | None) -> DynamicBatch:
    """An engine owner's kept groups at full length (16k-token rows: the largest ints pickle longest)."""
    prompts = []
    for pos in range(groups):
        comps = [
            Completion(pos, g, torch.zeros(1000, dtype=torch.int64), torch.zeros(15384 + g, dtype=torch.int64),
                       torch.zeros(15384 + g), "length" if g % 2 else "stop", "")
            for g in range(G)
        ]  # fmt: skip
        per_reward = torch.rand(G, scores) if scores else None
        prompts.append(PromptGroup([1], completions=comps, per_reward=per_reward, position=100_000 + pos))
    return DynamicBatch(
        groups=[p.completions for p in prompts], rewards=torch.zeros(groups, G), prompts=prompts,
        positions=[p.position for p in prompts],
    )  # fmt: skip


@pytest.mark.parametrize(("groups", "G", "scores"), [(1, 16, 1), (32, 8, 3), (128, 16, None), (64, 4, 2)])
def test_the_plan_bounds_the_gathered_scalars(groups, G, scores):
    """What one owner contributes to the scalar gather (pickled as `all_gather_object` pickles it) is
    within the plan's per-owner bytes, and not far below them with reward scores (without, the plan still
    counts one score and the tensor around it)."""
    measured = len(pickle.dumps(row_scalars(_owner_share(groups, G, scores))))
    planned = groups * (GROUP_SCALAR_BYTES + G * (ROW_SCALAR_BYTES + 4 * (scores or 1)))
    assert measured <= planned
    assert measured > (0.5 if scores else 0.15) * planned


def test_rows_wire_bytes_by_hand():
    # the docs' example: 16 GPUs, 4 engines, 512 prompts x 16 samples, one reward score
    per_owner = 128 * (512 + 16 * (16 + 4))
    assert rows_wire_bytes(16, 4, 512, 16, 1) == 2 * (64 << 20) + 17 * per_owner
    assert 2 * (64 << 20) < rows_wire_bytes(16, 4, 512, 16, 1) < 2 * (64 << 20) + 2 * (1 << 20)  # +1.7 MiB


def test_the_rollout_phase_counts_the_rows_in_flight():
    cfg = load_config(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml", check_paths=False)
    plan = plan_memory(cfg, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    # 16 GPUs, engine_tp 4: 4 engines; 32 prompts x 8 samples; 2 reward functions (GDPO)
    rows = 2 * (64 << 20) + 17 * 8 * (512 + 8 * (16 + 4 * 2))
    assert plan.rows_in_flight == rows
    assert plan.rollout_peak == int(cfg.rollout.mem_fraction_static * 80 * GIB) + rows
    assert "rows in flight (data plane)" in plan.table()


def test_rows_in_flight_can_decide_the_verdict():
    """A pool that fills the GPU up to 64 MiB below the budget fits alone, and not with the rows in flight;
    the largest KV cache that fits shrinks by the rows' bytes."""
    mesh = PlanMesh(16, tp=2, pp=2, ep=8, sequence_parallel=True)
    budget = 76 * GIB
    w = Workload(mesh=mesh, seq_len=2048, engine_tp=4, engine_mem_fraction=(budget - (64 << 20)) / (80 * GIB))
    alone = plan_workload(QWEN3_30B, w)
    assert alone.rollout_peak <= alone.budget and alone.rows_in_flight == 0
    rows = rows_wire_bytes(16, 4, 512, 16, 1)
    both = plan_workload(QWEN3_30B, Workload(**{**w.__dict__, "rows_in_flight": rows}))
    assert both.rollout_peak == alone.rollout_peak + rows > both.budget
    assert any(r.startswith("rollout:") and "rows in flight 0.1 GiB" in r for r in both.reasons), both.reasons
    kv = 2 * 48 * 1 * 128 * 2  # Qwen3-30B-A3B's KV bytes per token at engine_tp 4 (4 kv heads)
    assert alone.max_kv_tokens - both.max_kv_tokens == pytest.approx(rows / kv, abs=1)
