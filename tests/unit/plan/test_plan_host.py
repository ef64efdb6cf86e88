"""Issue 36 item 4, the host side of the memory plan: each engine owner runs at most
`rollout.multi_turn.max_concurrent_tools` sandboxes at once, each holding its memory limit, its private
tmpfs and its boot processes, and a node holds its owners' sum."""

from __future__ import annotations

from pathlib import Path

import pytest

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.envs.python_tool import SANDBOX_OVERHEAD_MB
from megagrpo.plan.job import plan_memory
from megagrpo.plan.memory import GIB

REPO = Path(__file__).resolve().parents[3]
QWEN3_30B = arch_from_hf(REPO / "configs" / "models" / "Qwen3-30B-A3B")
AGENTIC = REPO / "configs" / "agentic_python_qwen3_moe.yaml"
MIB = 1 << 20


def _plan(path=AGENTIC, overrides=(), host_mem_gib=None, nodes=2):
    cfg = load_config(path, list(overrides), check_paths=False)
    return plan_memory(
        cfg, QWEN3_30B, nodes=nodes, gpus_per_node=8, gpu_mem_gib=80, host_mem_gib=host_mem_gib
    )


def test_a_node_holds_its_owners_times_the_bound_times_one_sandbox():
    plan = _plan()
    h = plan.host
    # engine_tp 4 on 8 GPUs: 2 owners per node; the config's sandbox: memory_mb 1024, scratch_mb 64
    assert (h.owners_per_node, h.tool_slots) == (2, 16)
    assert h.tool_call_bytes == (1024 + 64 + SANDBOX_OVERHEAD_MB) * MIB
    assert h.tools_bytes == 2 * 16 * h.tool_call_bytes
    assert "tool calls (sandboxes)" in plan.table() and "2 owners x 16 at once" in plan.table()
    quarter = _plan(overrides=["rollout.multi_turn.max_concurrent_tools=4"]).host
    assert quarter.tools_bytes * 4 == h.tools_bytes
    bigger = _plan(overrides=["rollout.multi_turn.environment_options.scratch_mb=1088"]).host
    assert bigger.tool_call_bytes == h.tool_call_bytes + 1024 * MIB


def test_the_host_verdict_follows_the_nodes_memory():
    assert _plan(host_mem_gib=64).fits
    plan = _plan(host_mem_gib=16)
    assert not plan.fits
    assert any("max_concurrent_tools=16" in r and "16 GiB" in r for r in plan.reasons), plan.reasons
    assert _plan(overrides=["rollout.multi_turn.max_concurrent_tools=4"], host_mem_gib=16).fits
    single = _plan(overrides=["rollout.multi_turn.enabled=false"], host_mem_gib=1)
    assert single.fits and single.host.tools_bytes == 0 and "sandboxes" not in single.table()


def test_disaggregated_owners_are_counted_on_their_node():
    over = ["rollout.multi_turn.enabled=true", "rollout.multi_turn.environment=python"]
    plan = _plan(REPO / "configs" / "disaggregated_qwen3_moe.yaml", over, host_mem_gib=1, nodes=3)
    assert plan.host.owners_per_node == min(plan.engine.engines, 8)
    assert plan.failing[-1] == "host" and "host, per node" in plan.table()


def test_plan_cli_judges_the_host_side(capsys):
    assert main(["plan", str(AGENTIC), "--nodes", "2", "--gpus-per-node", "8", "--host-mem-gib", "16"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "host:" in out
    assert _plan().host.tools_bytes / GIB == pytest.approx(36.0)
