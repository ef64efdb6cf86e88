"""Issue 27, `megagrpo plan` of a disaggregated config: the learner pool and the engine pool planned
separately, a verdict each and one overall, against the arithmetic of `plan/memory.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.errors import MegagrpoError
from megagrpo.plan.job import plan_memory
from megagrpo.plan.memory import (
    GIB,
    MemoryPlan,
    engine_weight_bytes,
    kv_bytes_per_token,
    learner_state_bytes,
    rows_wire_bytes,
)
from megagrpo.plan.pools import DisaggregatedPlan, plan_disaggregated

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "disaggregated_qwen3_moe.yaml"
QWEN3_30B = arch_from_hf(REPO / "configs" / "models" / "Qwen3-30B-A3B")


def plan(*overrides: str, nodes: int = 3, gpus: int = 8, mem: float = 80.0):
    cfg = load_config(CONFIG, list(overrides), check_paths=False)
    return cfg, plan_memory(cfg, QWEN3_30B, nodes=nodes, gpus_per_node=gpus, gpu_mem_gib=mem)


def test_the_shipped_config_plans_two_pools_that_fit():
    cfg, p = plan()
    assert isinstance(p, DisaggregatedPlan) and p.fits, p.table()
    assert (p.learner.gpus, p.engine.gpus, p.engine.engines, p.engine.first_rank) == (16, 8, 2, 16)
    assert p.learner.workload.mesh.dp == 8  # 16 learner GPUs / tp 2: the engine GPUs are not in the mesh
    assert p.learner.margin >= 8 * GIB and p.engine.margin >= 4 * GIB, p.table()
    assert p.max_micro_batch >= cfg.schedule.micro_batch_size
    assert p.kv_tokens >= cfg.data.max_prompt_tokens + cfg.rollout.response_tokens


def test_learner_pool_holds_no_engine_share_and_three_export_buckets():
    cfg, p = plan()
    lp = p.learner
    bucket = cfg.sync.bucket_mb << 20
    state = learner_state_bytes(QWEN3_30B, cfg.mesh, 16)
    assert (lp.params, lp.grads, lp.optimizer) == (state.params, state.grads, state.optimizer)
    # no engine weights beside it; the bucket the export builds, the one on the wire, the one filled meanwhile
    assert lp.sync_peak == state.total + 3 * bucket
    assert lp.rows_in_flight == rows_wire_bytes(16, 2, 32, 8, 1)  # rows from the 2 engines
    assert lp.train_peak == state.total + lp.activations + lp.logits + lp.rows_in_flight
    assert lp.total == max(lp.train_peak, lp.sync_peak)
    # the same mesh colocated on the same 16 GPUs holds the engine's weights at the sync
    colocated = load_config(CONFIG, ["rollout.placement.kind=colocated"], check_paths=False)
    c = plan_memory(colocated, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    assert isinstance(c, MemoryPlan)
    assert c.sync_peak - lp.sync_peak == engine_weight_bytes(QWEN3_30B, 4) - bucket
    # PP 8 x TP 2 on 16 learner GPUs is 2 replicas for 4 engines: each stage's rank feeds 2 engines
    piped = load_config(CONFIG, ["mesh.pp=8", "mesh.ep=1", "rollout.num_engines=4"], check_paths=False)
    lp2 = plan_disaggregated(piped, QWEN3_30B, nodes=4, gpus_per_node=8, gpu_mem_gib=80).learner
    assert lp2.engines_fed == 2 and lp2.export_buckets == 5 * bucket
    assert "export buckets (5, weight sync)" in "\n".join(lp2.lines())


def test_engine_pool_is_weights_kv_and_one_received_bucket_of_the_whole_gpu():
    cfg, p = plan()
    ep = p.engine
    mem = 80 * GIB
    assert ep.weights == engine_weight_bytes(QWEN3_30B, 4)
    assert ep.pool == int(0.85 * mem) == ep.weights + ep.kv_cache  # mem_fraction_static of the whole GPU
    assert ep.kv_tokens == ep.kv_cache // kv_bytes_per_token(QWEN3_30B, 4)
    assert ep.total == ep.pool + (cfg.sync.bucket_mb << 20)  # one received bucket, not two
    assert ep.budget == mem - 4 * GIB
    assert ep.max_kv_tokens == (ep.budget - ep.received_bucket - ep.weights) // kv_bytes_per_token(
        QWEN3_30B, 4
    )
    assert ep.max_mem_fraction == 0.94  # (76 GiB - 0.5 GiB) / 80 GiB, rounded down


def test_the_cli_prints_both_pools_and_one_verdict(capsys):
    assert main(["plan", str(CONFIG), "--nodes", "3", "--gpus-per-node", "8", "--gpu-mem-gib", "80"]) == 0
    out = capsys.readouterr().out
    for line in (
        "learner pool: 16 GPUs (ranks 0-15), tp=2 pp=1 ep=8",
        "engine pool: 8 GPUs (ranks 16-23), 2 engine(s) of engine_tp=4",
        "export buckets (3, weight sync)",
        "received bucket (weight sync)",
        "engine KV cache",
        "learner pool verdict: FITS",
        "engine pool verdict: FITS",
        "\nverdict: FITS: learner pool margin +",
    ):
        assert line in out, line
    assert "engine weights" not in out.split("engine pool:")[0]  # the learner pool holds none


def test_a_misfit_of_either_pool_is_its_own_verdict(capsys):
    _, engine = plan("rollout.mem_fraction_static=0.97")
    assert engine.learner.fits and not engine.engine.fits and not engine.fits
    assert engine.failing == ["engine pool"]
    assert "lower rollout.mem_fraction_static (at most 0.94)" in engine.engine.reasons[0]
    _, learner = plan("mesh.tp=1", "mesh.ep=1", "mesh.sequence_parallel=false")
    assert not learner.learner.fits and learner.engine.fits and learner.failing == ["learner pool"]
    table = learner.table()
    assert "learner pool verdict: DOES NOT FIT" in table and "engine pool verdict: FITS" in table
    assert "verdict: DOES NOT FIT (learner pool)" in table
    assert (
        main(
            ["plan", str(CONFIG), "rollout.mem_fraction_static=0.97", "--nodes", "3", "--gpus-per-node", "8"]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "engine pool verdict: DOES NOT FIT" in out and "verdict: DOES NOT FIT (engine pool)" in out


def test_an_engine_too_small_for_one_sequence_is_refused():
    _, p = plan("rollout.engine_tp=1", "rollout.num_engines=8", "rollout.mem_fraction_static=0.712")
    assert not p.engine.fits and 0 < p.engine.kv_tokens < 1536  # 57 GiB of weights on one GPU
    assert any("less than one sequence" in r for r in p.engine.reasons), p.engine.reasons


def test_a_launch_with_no_room_to_learn_is_refused():
    with pytest.raises(MegagrpoError, match="rollout.placement.kind=disaggregated.*leaving none to learn"):
        plan(nodes=1)


def test_colocated_output_is_unchanged():
    _, p = plan("rollout.placement.kind=colocated", "rollout.mode=colocated", nodes=2)
    assert isinstance(p, MemoryPlan)
    table = p.table()
    assert table.startswith("mesh: 16 GPUs") and "pool" not in table.replace("engine pool", "")
    assert "\nverdict: FITS (margin" in table
