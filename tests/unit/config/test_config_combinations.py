"""Impossible option combinations fail at validation, naming the fields; one set of defaults and one set
of mesh rules, whoever asks (schema, learner, CLI, submit)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from megagrpo import cli
from megagrpo.config import check_mesh, config_from_dict
from megagrpo.config.schema import HealthThresholds, MeshConfig, RolloutConfig
from megagrpo.errors import MegagrpoError
from megagrpo.learner.mesh import MeshConfig as LearnerMesh
from megagrpo.learner.mesh import world_size_from_environ
from megagrpo.rollout.dynamic import DynamicSamplingConfig
from megagrpo.trainer.health import HealthConfig, health_warnings

BASE = {"model": {"hf_path": "m"}}


def make(**sections):
    return config_from_dict({**BASE, **sections})


def error(**sections) -> str:
    with pytest.raises(MegagrpoError) as e:
        make(**sections)
    return str(e.value)


@pytest.mark.parametrize("name", ["tis", "mis"])
def test_old_logp_rollout_rejects_importance_corrections(name):
    msg = error(algo={"old_logp": "rollout", name: {"enabled": True, "cap": "auto"}})
    assert f"algo.{name}.enabled: true with algo.old_logp=rollout" in msg
    assert "the weight is always 1" in msg


def test_old_logp_rollout_rejects_mismatch_diagnostics_and_works_without_them():
    msg = error(algo={"old_logp": "rollout"})
    assert "diagnostics.mismatch: true with algo.old_logp=rollout" in msg
    cfg = make(algo={"old_logp": "rollout"}, diagnostics={"mismatch": False})
    assert cfg.algo.old_logp == "rollout"


def test_icepop_is_a_token_mask():
    msg = error(algo={"tis": {"enabled": True, "mode": "icepop", "level": "sequence"}})
    assert "algo.tis.level: 'sequence' with mode=icepop" in msg


def test_mis_masks_by_default_even_when_the_section_is_given():
    assert make(algo={"mis": {"enabled": True}}).algo.mis.mode == "mask"
    assert make(algo={"tis": {"enabled": True}}).algo.tis.mode == "truncate"


@pytest.mark.parametrize(
    "sections,key",
    [
        ({"diagnostics": {"shadow_routing": True}}, "diagnostics.shadow_routing"),
        ({"diagnostics": {"shadow_precision": True}}, "diagnostics.shadow_precision"),
        ({"logging": {"jsonl": False}}, "logging.jsonl"),
    ],
)
def test_knobs_that_did_nothing_are_gone(sections, key):
    assert f"{key}: unknown key" in error(**sections)


def test_dynamic_sampling_and_health_have_the_schemas_defaults():
    cfg = make()
    dyn = DynamicSamplingConfig(batch_prompts=4, group_size=2)
    assert (dyn.oversample, dyn.max_rounds) == (RolloutConfig().oversample, RolloutConfig().max_rounds)
    assert DynamicSamplingConfig.from_config(cfg) == DynamicSamplingConfig(
        cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.oversample, cfg.rollout.max_rounds
    )
    off = DynamicSamplingConfig.from_config(make(algo={"dynamic_sampling": False}))
    assert (off.oversample, off.max_rounds) == (1.0, 1)
    assert HealthConfig is HealthThresholds
    assert health_warnings([{}] * 20, make().logging.health) == []


LAYOUTS = [
    dict(tp=tp, pp=pp, ep=ep, etp=1, cp=1, sequence_parallel=sp)
    for tp, pp, ep, sp in itertools.product((1, 2), (1, 2), (1, 2, 4), (False, True))
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{int(v)}" for k, v in d.items()))
def test_schema_and_learner_apply_the_same_mesh_rules(layout):
    def outcome(fn):
        try:
            return fn()
        except MegagrpoError as e:
            return type(e)

    schema_ok = outcome(lambda: make(mesh=layout)) is not MegagrpoError
    learner_ok = outcome(lambda: LearnerMesh(**layout).validate()) is not MegagrpoError
    assert schema_ok == learner_ok
    if not schema_ok:
        return
    cfg = make(mesh=layout, rollout={"prompts_per_step": 8, "group_size": 4})
    for world in (1, 2, 3, 4, 6, 8):
        sizes = outcome(lambda w=world: check_mesh(cfg, w, "eval"))
        dp = outcome(lambda w=world: LearnerMesh(**layout).data_parallel_size(w))
        assert (sizes is MegagrpoError) == (dp is MegagrpoError), world
        if dp is not MegagrpoError:
            assert sizes.dp == dp


def test_the_learner_mesh_has_the_schemas_fields_and_defaults():
    learner = {f.name: f.default for f in dataclasses.fields(LearnerMesh)}
    schema = {k: getattr(MeshConfig(), k) for k in MeshConfig.model_fields}
    assert {k: learner[k] for k in schema} == schema  # vpp: the learner's only extra (no config field)


def _model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return d


@pytest.mark.parametrize("stage", ["train", "sft", "eval"])
def test_the_cli_checks_the_mesh_against_nproc_before_starting_anything(tmp_path, capsys, stage):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{hf_path: {_model_dir(tmp_path)}}}\nmesh: {{tp: 2}}\nsft: {{steps: 1}}\n")
    code = cli.main([stage, str(cfg), "--nproc", "3"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USER_ERROR
    assert "tp*pp*cp = 2*1*1 = 2 does not divide the world size 3" in err and "Traceback" not in err


def test_the_launchers_world_size_is_read_without_starting_anything():
    assert world_size_from_environ({}) == 1
    assert world_size_from_environ({"RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "0"}) == 4
    assert world_size_from_environ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "6"}) == 6
    assert world_size_from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == 8
    assert (
        world_size_from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"}) == 2
    )
    assert world_size_from_environ({"MEGAGRPO_BOOTSTRAP": "mpi4py"}) is None


@pytest.mark.parametrize("kind", ["disaggregated", "colocated"])
def test_checksum_with_a_tp_engine_is_refused_at_validation(kind):
    # Both sync transports hash whole tensors against TP rank 0's parameters: with engine_tp > 1 the check
    # was refused only after the first full sync had run (sync.broadcast.verify_remote).
    msg = error(sync={"checksum": True}, rollout={"engine_tp": 2, "placement": {"kind": kind}})
    assert "sync.checksum: true with rollout.engine_tp=2" in msg
    assert "set sync.checksum=false or rollout.engine_tp=1" in msg
    assert make(sync={"checksum": True}, rollout={"placement": {"kind": kind}}).sync.checksum
    assert make(rollout={"engine_tp": 2, "placement": {"kind": kind}}).rollout.engine_tp == 2
