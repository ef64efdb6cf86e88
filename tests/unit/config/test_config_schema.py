"""Schema rules: defaults, per-variant clips, cross-field checks and check_mesh."""

from __future__ import annotations

import pytest

from megagrpo.config import VARIANT_CLIP_DEFAULTS, Config, check_mesh, config_from_dict
from megagrpo.errors import MegagrpoError

BASE = {"model": {"hf_path": "m"}}


def make(**sections) -> Config:
    return config_from_dict({**BASE, **sections})


def bad(**sections) -> str:
    with pytest.raises(MegagrpoError) as e:
        make(**sections)
    return str(e.value)


def test_defaults_validate_and_every_field_is_documented():
    cfg = make()
    assert cfg.rollout.group_size == 8 and cfg.algo.variant == "grpo" and cfg.replay == "none"
    assert cfg.algo.mis.mode == "mask" and cfg.algo.tis.mode == "truncate"

    def walk(model, prefix=""):
        for name, f in type(model).model_fields.items():
            assert f.description and len(f.description) > 15, f"{prefix}{name} lacks a description"
            sub = getattr(model, name)
            if hasattr(sub, "model_fields"):
                walk(sub, f"{prefix}{name}.")

    walk(cfg)


@pytest.mark.parametrize("variant", sorted(VARIANT_CLIP_DEFAULTS))
def test_variant_clip_defaults_fill_nulls_but_explicit_values_win(variant):
    cfg = make(algo={"variant": variant})
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == VARIANT_CLIP_DEFAULTS[variant]
    cfg = make(algo={"variant": variant, "clip_low": 0.1, "clip_high": 0.3})
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (0.1, 0.3)


def test_gspo_defaults_are_the_paper_values_and_cispo_has_no_lower_bound():
    cfg = make(algo={"variant": "gspo"})
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (3e-4, 4e-4)
    assert make(algo={"variant": "cispo"}).algo.clip_low is None
    assert make(algo={"variant": "gmpo", "clip_low": 1.5}).algo.clip_low == 1.5  # a log-ratio bound


def test_schema_choices_match_the_algorithm_core():
    import typing

    from megagrpo.algo import VARIANTS
    from megagrpo.algo.advantages import METHODS
    from megagrpo.algo.aggregation import AGG_MODES
    from megagrpo.algo.kl import ESTIMATORS
    from megagrpo.config import AlgoConfig, KlConfig

    def choices(model, name):
        return typing.get_args(model.model_fields[name].annotation)

    assert choices(AlgoConfig, "variant") == VARIANTS
    assert choices(AlgoConfig, "agg") == AGG_MODES
    assert choices(KlConfig, "estimator") == ESTIMATORS
    assert choices(AlgoConfig, "advantages") == (*METHODS, "gdpo")  # gdpo: algo.advantages.gdpo()


def test_group_size_below_two_is_rejected_for_group_advantages():
    msg = bad(rollout={"group_size": 1})
    assert msg.splitlines()[1].strip().startswith("rollout.group_size: 1 is below 2")


def test_unknown_variant_lists_allowed_values():
    msg = bad(algo={"variant": "ppo"})
    assert "algo.variant: 'ppo' is not one of grpo, gspo, gspo_token, gmpo, cispo, sapo, reinforce" in msg


@pytest.mark.parametrize(
    "algo, field",
    [
        ({"clip_low": 1.5}, "algo.clip_low"),
        ({"clip_low": 0.0}, "algo.clip_low"),
        ({"clip_high": -0.1}, "algo.clip_high"),
        ({"clip_ratio_c": 1.1}, "algo.clip_ratio_c"),
        ({"tis": {"cap": 0.9}}, "algo.tis.cap"),
        ({"mis": {"cap_low": 1.2}}, "algo.mis.cap_low"),
        ({"mis": {"veto_low": 0.0}}, "algo.mis.veto_low"),
        ({"variant": "gmpo", "clip_low": -0.1}, "algo.clip_low"),
        ({"tis": {"auto": {"clamp": [5.0, 2.0]}}}, "algo.tis.auto.clamp"),
        ({"router_shift_gamma_min": 1.0}, "algo.router_shift_gamma_min"),
    ],
)
def test_insane_clip_and_cap_values_name_their_field(algo, field):
    assert f"\n  {field}: " in bad(algo=algo)


def test_dual_clip_accepts_a_bound_beyond_clip_high():
    assert make(algo={"clip_ratio_c": 3.0}).algo.clip_ratio_c == 3.0


def test_gdpo_needs_both_advantages_and_combine():
    assert "rewards.combine" in bad(algo={"advantages": "gdpo"})
    assert "rewards.combine" in bad(rewards={"combine": "gdpo"})
    cfg = make(algo={"advantages": "gdpo"}, rewards={"combine": "gdpo"})
    assert cfg.rewards.combine == "gdpo"


def test_resolved_defaults_follow_rollout_length():
    cfg = make(algo={"agg": "seq-mean-token-sum-norm"}, rollout={"max_new_tokens": 300})
    assert cfg.algo.agg_constant == 300.0 and cfg.algo.soft_overlong.max_len == 300
    msg = bad(algo={"soft_overlong": {"enabled": True, "max_len": 500}}, rollout={"max_new_tokens": 300})
    assert "algo.soft_overlong.max_len: 500 exceeds rollout.max_new_tokens=300" in msg
    assert "algo.soft_overlong.cache_len" in bad(
        algo={"soft_overlong": {"enabled": True, "cache_len": 300}}, rollout={"max_new_tokens": 300}
    )


def test_mesh_rules_from_megatron():
    assert "mesh.sequence_parallel: true needs tp > 1" in bad(mesh={"sequence_parallel": True})
    assert "mesh.sequence_parallel: false with tp=2 and ep=2" in bad(mesh={"tp": 2, "ep": 2})
    assert make(mesh={"tp": 2, "ep": 2, "sequence_parallel": True}).mesh.ep == 2


def test_data_needs_exactly_one_source_and_rewards_distinct_labels():
    assert "data.train_path: set exactly one" in bad(
        data={"train_path": "x.jsonl", "synthetic": {"task": "addition"}}
    )
    assert "data.train_path: set exactly one" in bad(data={})
    msg = bad(rewards={"functions": [{"name": "format"}, {"name": "format"}]})
    assert "rewards.functions: duplicate reward names ['format']" in msg
    assert "rewards.functions: is empty" in bad(rewards={"functions": []})


def test_mini_batches_must_divide_the_batch():
    assert "algo.ppo_mini_batches: 3 does not divide the batch of 256" in bad(algo={"ppo_mini_batches": 3})


def test_check_mesh_infers_dp_and_rejects_impossible_meshes():
    cfg = make(
        mesh={"tp": 2, "ep": 2, "sequence_parallel": True}, rollout={"prompts_per_step": 8, "group_size": 4}
    )
    sizes = check_mesh(cfg, 4)
    assert (sizes.dp, sizes.expert_dp, sizes.num_engines, sizes.seqs_per_rank_per_minibatch) == (2, 2, 4, 16)
    with pytest.raises(MegagrpoError, match=r"tp\*pp\*cp = 2\*1\*1 = 2 does not divide the world size 3"):
        check_mesh(cfg, 3)
    with pytest.raises(MegagrpoError, match=r"ep\*etp\*pp = 4\*1\*1 = 4 does not divide the world size 6"):
        check_mesh(make(mesh={"ep": 4}), 6)
    with pytest.raises(MegagrpoError, match="rollout.engine_tp: 4 does not divide the world size 2"):
        check_mesh(make(rollout={"engine_tp": 4}), 2)
    with pytest.raises(MegagrpoError, match="does not split over DP=3"):
        check_mesh(make(rollout={"prompts_per_step": 2, "group_size": 2}), 3)
    with pytest.raises(MegagrpoError, match="data parallelism would be 8 ranks, more than the mesh can use"):
        check_mesh(make(rollout={"prompts_per_step": 2, "group_size": 2}), 8)


def test_micro_batch_size_is_a_cap_not_a_divisor():
    # The learner cuts each rank's rows into ceil(rows / micro_batch_size) micro-batches: neither a size
    # that does not divide the rows nor one larger than them makes a mesh impossible.
    small = make(rollout={"prompts_per_step": 4, "group_size": 4}, schedule={"micro_batch_size": 3})
    assert check_mesh(small, 2).seqs_per_rank_per_minibatch == 8
    big = make(rollout={"prompts_per_step": 4, "group_size": 4}, schedule={"micro_batch_size": 16})
    assert check_mesh(big, 2).dp == 2


def test_check_mesh_per_stage():
    cfg = make(rollout={"engine_tp": 4, "prompts_per_step": 3, "group_size": 2}, sft={"batch_size": 8})
    # sft starts no engine and splits sft.batch_size, not the RL batch
    assert check_mesh(cfg, 2, "sft").seqs_per_rank_per_minibatch == 4
    with pytest.raises(MegagrpoError, match=r"sft.batch_size\) does not split over DP=3"):
        check_mesh(cfg, 3, "sft")
    with pytest.raises(MegagrpoError, match="rollout.engine_tp: 4 does not divide the world size 2"):
        check_mesh(cfg, 2, "eval")
    assert check_mesh(cfg, 4, "eval").num_engines == 1  # eval trains nothing: no batch split
    with pytest.raises(ValueError, match="stage"):
        check_mesh(cfg, 1, "submit")


# -- uneven pipeline stages (issue 37 section 4) ----------------------------------------------------------


@pytest.mark.parametrize(
    "layers, pp, first, last, want",
    [
        (4, 2, None, None, (2, 2)),
        (61, 8, 5, None, (5, 8, 8, 8, 8, 8, 8, 8)),  # DeepSeek-V3 on PP8: the first stage lighter
        (61, 16, 1, None, (1,) + (4,) * 15),
        (61, 4, 16, 15, (16, 15, 15, 15)),
        (5, 2, 2, None, (2, 3)),
        (5, 2, None, 1, (4, 1)),
        (3, 2, 1, 2, (1, 2)),
        (7, 3, 1, 2, (1, 4, 2)),
    ],
)
def test_stage_layer_counts_follow_megatron(layers, pp, first, last, want):
    from megagrpo.config.mesh_rules import layers_of_stage, stage_layer_counts

    got = stage_layer_counts(layers, pp, first, last)
    assert got == want and sum(got) == layers
    # the stages tile the layers in order, as megatron's get_transformer_layer_offset numbers them
    assert [i for s in range(pp) for i in layers_of_stage(got, s)] == list(range(layers))


@pytest.mark.parametrize(
    "layers, pp, first, last, words",
    [
        (61, 8, None, None, "set mesh.first_stage_layers and/or mesh.last_stage_layers"),
        (5, 2, 3, 3, "do not add up to the model's 5 layers"),
        (5, 2, 2, 2, "do not add up"),  # both ends set on PP2: no middle stage takes the fifth layer
        (4, 3, 3, None, "each needs at least one"),
        (61, 8, 4, None, "57 layers of the other 7 stage(s) do not split evenly"),
        (4, 1, 2, None, "needs pp > 1"),
    ],
)
def test_stage_layer_counts_refuse_what_cannot_add_up(layers, pp, first, last, words):
    from megagrpo.config.mesh_rules import stage_layer_counts

    with pytest.raises(MegagrpoError, match="mesh") as e:
        stage_layer_counts(layers, pp, first, last)
    assert words in str(e.value)


def test_stage_layer_counts_schema_fields():
    cfg = make(mesh={"pp": 2, "first_stage_layers": 1})
    assert cfg.mesh.first_stage_layers == 1 and cfg.mesh.last_stage_layers is None
    assert "mesh.first_stage_layers" in bad(mesh={"first_stage_layers": 2})  # pp = 1
    assert "needs pp > 1" in bad(mesh={"first_stage_layers": 2})
    assert "mesh.last_stage_layers" in bad(mesh={"pp": 2, "last_stage_layers": 0})
