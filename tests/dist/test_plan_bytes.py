"""Issue 16, the memory plan's exact bytes: `plan.learner_state_bytes` equals, within 2%, the bytes of
parameters, grad buffers and optimizer state that megatron-core allocates on a CPU learner, for a tiny
MoE, a tiny dense, a tied-embedding model and the DeepSeek-V3 (MLA) and GLM-4.5 families on DP2, TP2, EP2 and PP2, with and without the DistributedOptimizer (one
2-process launch)."""

from __future__ import annotations

import json

import pytest

from tests.dist._harness import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_bytes")
    launch("tests.dist.workers_plan:main", 2, out, timeout=900)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_case_ran(results):
    # x 2 optimizers: MoE on 4 meshes, dense on 3 (no EP), tied on 2 (no EP, no PP on the CPU), and the
    # three DeepSeek-V3 / GLM-4.5 models (MLA with and without a q latent, GQA with biases) on 4 each
    assert len(results[0]) == 42 and results[0].keys() == results[1].keys()


@pytest.mark.parametrize("what", ["params", "grads", "optimizer"])
def test_planned_bytes_match_allocated_bytes(results, what):
    for rank, res in enumerate(results):
        for case, r in res.items():
            got, plan = r["measured"][what], r["planned"][what]
            assert got > 0, f"{case} rank {rank}: nothing measured for {what}"
            assert abs(plan - got) <= 0.02 * got, (
                f"{case} rank {rank} {what}: planned {plan}, allocated {got}"
            )


def test_parameter_counts_are_exact(results):
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert r["planned"]["numel"] == r["measured"]["numel"], f"{case} rank {rank}"
