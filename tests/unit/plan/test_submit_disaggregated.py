"""Issue 27, `megagrpo submit` of a disaggregated config: one launch over learner + rollout nodes, the
roles in the summary and the script, and the refusals (an engine across nodes, a pool that does not fit)
made before anything asks Slurm."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import megagrpo.submit.slurm as slurm
from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.config.schema import check_mesh
from megagrpo.submit.resources import JobShape, role_layout

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "disaggregated_qwen3_moe.yaml"


@pytest.fixture
def no_slurm(monkeypatch):
    """No controller; and a refusal must come before the first question to one."""
    calls = []

    def partitions(*a, **k):
        calls.append(1)
        raise slurm.NoController("no controller in unit tests")

    monkeypatch.setattr(slurm, "partitions", partitions)
    return calls


@pytest.fixture
def submit(tmp_path, capsys, no_slurm):
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    shutil.copy(REPO / "configs" / "models" / "Qwen3-30B-A3B" / "config.json", model / "config.json")

    def run(*extra: str, nodes: int = 3, gpus: int = 8) -> tuple[int, str, str]:
        overrides = [a for a in extra if not a.startswith("--")]
        flags = [a for a in extra if a.startswith("--")]
        args = [
            "submit",
            str(CONFIG),
            f"model.hf_path={model}",
            *overrides,
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            str(gpus),
            "--dry-run",
            "--log-dir",
            str(tmp_path / "logs"),
            *flags,
        ]
        rc = main(args)
        got = capsys.readouterr()
        return rc, got.out, got.err

    return run


def test_one_launch_over_learner_and_rollout_nodes(submit, no_slurm):
    rc, script, err = submit()
    assert rc == 0, err
    assert "#SBATCH --nodes=3" in script and "--nnodes=3 --nproc-per-node=8" in script
    assert "#SBATCH --gres=gpu:8" in script
    assert "memory plan: learner pool 16 GPUs peak" in err and ": fits" in err
    roles = [
        "node 0: learner GPUs 0-7 (ranks 0-7)",
        "node 1: learner GPUs 0-7 (ranks 8-15)",
        "node 2: rollout GPUs 0-7 (ranks 16-23: engines 0-1 of engine_tp 4)",
    ]
    assert "disaggregated: 16 learner and 8 rollout ranks" in err
    for line in roles:
        assert f"\n  {line}" in err, line  # the dry-run summary
        assert f"\n#   {line}" in script, line  # and the script's note of the roles
    # the note sits with the other comments, before the #SBATCH lines that sbatch reads
    assert script.index("# Roles (rollout.placement.kind=disaggregated") < script.index("#SBATCH")
    assert no_slurm == [1]  # the dry run asked once, after every check


def test_an_engine_across_a_node_boundary_is_refused_before_slurm(submit, no_slurm):
    # 3 x 6 GPUs, one engine of TP4 after 14 learner ranks: ranks 14-17 stay on node 2 (12-17)
    ok = ("mesh.ep=2", "rollout.num_engines=1", "rollout.prompts_per_step=28")
    rc, script, err = submit(*ok, "--force", gpus=6)
    assert rc == 0, err
    assert "node 2: learner GPUs 0-1 (ranks 12-13), rollout GPUs 2-5 (ranks 14-17: engine 0 of" in err
    no_slurm.clear()
    # two engines: 10 learner ranks, and engine 0 would take ranks 10-13 across nodes 1 and 2
    rc, _, err = submit("mesh.ep=2", "rollout.num_engines=2", "rollout.prompts_per_step=20", gpus=6)
    assert rc == 2
    assert re.search(r"rollout\.engine_tp=4: engine 0 .* ranks 10-13, across nodes 1 and 2", err), err
    assert "set rollout.engine_tp to a divisor of --gpus-per-node 6" in err
    assert no_slurm == []  # refused before any Slurm call, with --device auto too


@pytest.mark.parametrize(
    ("overrides", "pool"),
    [
        (("rollout.mem_fraction_static=0.97",), "engine pool"),
        (("mesh.tp=1", "mesh.ep=1", "mesh.sequence_parallel=false"), "learner pool"),
    ],
)
def test_a_pool_that_does_not_fit_is_refused_unless_forced(submit, no_slurm, overrides, pool):
    rc, _, err = submit(*overrides)
    assert rc == 2
    assert f"memory plan does not fit 80 GiB per GPU ({pool})" in err and "--force" in err
    assert f"{pool} verdict: DOES NOT FIT" in err
    assert no_slurm == []
    rc, _, err = submit(*overrides, "--force")
    assert rc == 0 and "--force: the memory plan does not fit" in err


def test_too_few_gpus_for_the_engines_and_a_learner_mesh(submit, no_slurm):
    rc, _, err = submit(nodes=1)
    assert rc == 2
    assert (
        "= 8 GPUs is fewer than the mesh needs: at least 16" in err
        and "rollout.num_engines * engine_tp = 2*4 = 8 ranks of their own" in err
    )
    assert no_slurm == []


def test_role_layout_of_a_cpu_job_two_learners_and_one_engine():
    cfg = load_config(
        CONFIG,
        [
            "mesh={tp: 1, pp: 1, ep: 1, etp: 1, cp: 1, sequence_parallel: false}",
            "rollout.engine_tp=1",
            "rollout.num_engines=1",
        ],
        check_paths=False,
    )
    shape = JobShape(1, 3, "cpu")
    sizes = check_mesh(cfg, 3, on_gpu=False)
    assert role_layout(sizes, 1, shape) == [
        "node 0: learner processes 0-1 (ranks 0-1), rollout process 2 (rank 2: engine 0 of engine_tp 1)"
    ]


def test_the_check_stage_runs_every_rank_with_the_learners_tp_only(tmp_path):
    """`--stage check` runs over the whole launch, engine ranks included: the learner's TP divides it, its
    EP 8 and PP would not (24 ranks, 16 of them learners), so those are left to the training job."""
    from megagrpo.submit.command import _program

    cfg = load_config(CONFIG, [f"model.hf_path={tmp_path}"], check_paths=False)
    args = _program("check", cfg, tmp_path / "c.yaml", tmp_path, "job", world=24)
    assert "--tp 2 --ep 1 --pp 1" in args
    colocated = cfg.model_copy(deep=True)
    colocated.rollout.placement.kind = "colocated"
    assert "--tp 2 --ep 8 --pp 1" in _program(
        "check", colocated, tmp_path / "c.yaml", tmp_path, "job", world=16
    )


def test_the_check_stage_builds_uneven_pipeline_stages(tmp_path):
    """Issue 37 section 4: a colocated PP mesh with set first/last stage layer counts is checked with them
    (a layer count that pp does not divide builds only so)."""
    from megagrpo.submit.command import _program

    cfg = load_config(CONFIG, [f"model.hf_path={tmp_path}"], check_paths=False)
    cfg.rollout.placement.kind = "colocated"
    cfg.mesh.pp, cfg.mesh.first_stage_layers = 2, 5
    args = _program("check", cfg, tmp_path / "c.yaml", tmp_path, "job", world=32)
    assert "--pp 2 --first-stage-layers 5 --model" in args and "--last-stage-layers" not in args
