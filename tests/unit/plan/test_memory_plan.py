"""Issue 16, the memory plan: its arithmetic against hand-computed values and megagrpo's own layout
code, every shipped config's verdict on the hardware it is meant for, and the `plan`/`submit` CLI.
(The planned learner bytes against what megatron allocates: tests/dist/test_plan_bytes.py.)"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.cli import main
from megagrpo.config import load_config
from megagrpo.errors import MegagrpoError
from megagrpo.plan.job import plan_memory
from megagrpo.plan.memory import (
    GIB,
    PlanMesh,
    Workload,
    activation_bytes,
    active_numel,
    attention_numels,
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    learner_state_bytes,
    model_numel,
    padded_vocab,
    plan_workload,
    stage_tensor_numels,
)

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "configs" / "models"
QWEN3_30B = arch_from_hf(MODELS / "Qwen3-30B-A3B")

# Every shipped config, the hardware it is written for (nodes, GPUs per node, GiB), its model's
# config.json, and the verdict. The demo runs on a CPU; on a GPU it would need almost nothing.
SHIPPED = {
    "countdown_qwen3_moe_gdpo.yaml": ((2, 8, 80.0), "Qwen3-30B-A3B", True),
    "grpo_math_dense.yaml": ((1, 8, 80.0), "Qwen3-8B", True),
    "demo_qwen3_moe.yaml": ((1, 1, 16.0), "demo-tiny-qwen3-moe", True),
    "agentic_python_qwen3_moe.yaml": ((2, 8, 80.0), "Qwen3-30B-A3B", True),
    "agentic_calculator.yaml": ((1, 1, 16.0), "demo-tiny-qwen3-moe", True),
    # 2 learner nodes + 1 rollout node; the plan's nodes count both pools
    "disaggregated_qwen3_moe.yaml": ((3, 8, 80.0), "Qwen3-30B-A3B", True),
    # the DeepSeek-V3 and GLM-4.5 families (issue 37): one node, the nodes the plan asks for, and the two
    # that need H200s and many nodes (their fewest: test_plan_refuses_fewer_nodes_than_the_layout_needs)
    "gspo_math_moonlight.yaml": ((1, 8, 80.0), "Moonlight-16B-A3B", True),
    "gspo_math_glm45_air.yaml": ((8, 8, 80.0), "GLM-4.5-Air", True),
    "gspo_math_deepseek_v3.yaml": ((32, 8, 141.0), "DeepSeek-V3", True),
    "gspo_math_kimi_k2.yaml": ((36, 8, 141.0), "Kimi-K2", True),  # disaggregated: 32 learner + 4 engine
}


def test_every_shipped_config_has_a_verdict():
    shipped = {p.name for p in (REPO / "configs").glob("*.yaml")} - {"reference.yaml"}
    assert shipped == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_verdict_on_its_hardware(name):
    (nodes, gpus, mem), model, fits = SHIPPED[name]
    cfg = load_config(REPO / "configs" / name, check_paths=False)
    plan = plan_memory(cfg, arch_from_hf(MODELS / model), nodes=nodes, gpus_per_node=gpus, gpu_mem_gib=mem)
    assert plan.fits == fits, plan.table()
    assert plan.max_micro_batch >= cfg.schedule.micro_batch_size
    assert plan.kv_tokens >= cfg.data.max_prompt_tokens + cfg.rollout.response_tokens


def test_countdown_fits_with_margin_where_its_old_mesh_did_not():
    cfg = load_config(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml", check_paths=False)
    plan = plan_memory(cfg, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    assert plan.margin >= 8 * GIB, plan.table()  # 10% of the GPU
    old = ["mesh.pp=1", "mesh.ep=4", "rollout.engine_tp=2"]
    before = load_config(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml", old, check_paths=False)
    plan = plan_memory(before, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    assert not plan.fits and plan.sync_peak > 90 * GIB  # 66 GiB of learner beside 28 GiB of engine weights


def test_model_sizes_match_the_published_parameter_counts():
    assert model_numel(QWEN3_30B) / 1e9 == pytest.approx(30.5, abs=0.05)  # "30.5B in total"
    assert model_numel(arch_from_hf(MODELS / "Qwen3-8B")) / 1e9 == pytest.approx(8.2, abs=0.05)
    assert active_numel(QWEN3_30B) / 1e9 == pytest.approx(3.3, abs=0.1)  # "3.3B activated"


# (model, total, active, whether the card's active figure counts the embedding and output layer, rel. tol.)
# The cards: DeepSeek-V3 "671B total, 37B activated" (arXiv:2412.19437; its 685B on the Hub adds the 14B
# MTP module, which is not counted here); Kimi-K2 "1.04 trillion total, 32 billion activated" (1.026T by
# its config.json: within 1.5%); Moonlight-16B-A3B; GLM-4.5-Air "106B total, 12B active" (its active
# figure leaves out the embedding and output layer: 13.4B with them).
PUBLISHED_SIZES = [
    ("DeepSeek-V3", 671e9, 37e9, True, 0.02),
    ("Kimi-K2", 1.04e12, 32e9, True, 0.03),
    ("Moonlight-16B-A3B", 16e9, 3e9, True, 0.03),
    ("GLM-4.5-Air", 106e9, 12e9, False, 0.02),
]


@pytest.mark.parametrize("name,total,active,with_embeddings,rel", PUBLISHED_SIZES, ids=lambda x: str(x))
def test_v3_family_sizes_match_the_published_counts(name, total, active, with_embeddings, rel):
    arch = arch_from_hf(MODELS / name)
    assert model_numel(arch) == pytest.approx(total, rel=max(rel, 0.015))
    assert active_numel(arch, embeddings=with_embeddings) == pytest.approx(active, rel=rel)


def test_mla_attention_tensors_by_hand():
    # DeepSeek-V3: q latent 1536, kv latent 512 + rotary key 64, 128 heads of 128 + 64 (q/k) and 128 (v)
    v3 = arch_from_hf(MODELS / "DeepSeek-V3")
    H, n = 7168, 128
    q = [1536 // 8 * H, 1536, n * 192 // 8 * 1536]  # q_a (split over TP, local spec), q_a norm, q_b
    kv = [576 // 8 * H, 512, n * (128 + 128) // 8 * 512]  # kv_a_proj_with_mqa, kv_a norm, kv_b_proj
    assert attention_numels(v3, 8) == [*q, *kv, H * n * 128 // 8]
    # Moonlight ships q_lora_rank null: one q projection, no q latent
    moon = arch_from_hf(MODELS / "Moonlight-16B-A3B")
    assert moon.q_lora_rank is None
    assert attention_numels(moon, 1) == [16 * 192 * 2048, 576 * 2048, 512, 16 * 256 * 512, 2048 * 16 * 128]
    # a layer holds its attention, two norms and (first_k_dense_replace = 3) a dense MLP or the MoE block
    dense, expert = stage_tensor_numels(v3, PlanMesh(256, tp=8, ep=256), 0)
    assert sum(expert) == 58 * 3 * H * 2048  # 58 MoE layers of one local expert each
    shared = 3 * H * 2048 // 8
    layers = 61 * (sum(q) + sum(kv) + H * n * 128 // 8 + 2 * H) + 3 * 3 * H * 18432 // 8
    assert sum(dense) == 2 * 129280 // 8 * H + H + layers + 58 * (256 * H + shared)


# How SGLang 0.5.23 holds each HF tensor of a DeepSeek-V3-shaped model on one of `tp` ranks
# (sglang/srt/models/deepseek_v2.py, attention TP = engine TP): ReplicatedLinear (MLA's down projections),
# RMSNorm and MoEGate (the router and its correction bias) whole; ColumnParallelLinear /
# MergedColumnParallelLinear (q_b_proj, q_proj, kv_b_proj, gate/up, experts' w13) split by output rows;
# RowParallelLinear (o_proj, down, experts' w2) by input columns; VocabParallelEmbedding / ParallelLMHead
# by vocab rows padded to 64 (64 x tp when 64 rows do not split).
SGLANG_WHOLE = ("norm.weight", "q_a_proj.weight", "kv_a_proj_with_mqa.weight", "mlp.gate.weight",
                "mlp.gate.e_score_correction_bias")  # fmt: skip
SGLANG_ROWS = ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight")
SGLANG_COLUMNS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def sglang_shard_numel(name: str, shape: tuple[int, ...], tp: int) -> int:
    numel = math.prod(shape)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        pad = 64 if -(-shape[0] // 64) * 64 % tp == 0 else 64 * tp
        return -(-shape[0] // pad) * pad // tp * shape[1]
    if name.endswith(SGLANG_WHOLE):
        return numel
    split = {"experts.gate_up_proj": shape[1]}.get(name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1])
    if split is None:
        split = shape[0] if name.endswith(SGLANG_ROWS) else shape[-1] if name.endswith(SGLANG_COLUMNS) else 0
    assert split, f"{name}: no SGLang layout listed for it"
    assert split % tp == 0, (name, shape, tp)
    return numel // tp


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Moonlight-16B-A3B"])
def test_engine_rank_weights_are_sglangs_shards_on_the_meta_device(name):
    """Issue 43: the plan's weight bytes of one engine rank at TP 8 are the sum of the shards SGLang holds,
    counted from transformers' own model built on the meta device. SGLang replicates MLA's down
    projections, the norms and the routers; the plan divided them by TP, 1.8 GB per rank short on
    DeepSeek-V3 (and Moonlight's kv down projection)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megagrpo.plan.engine_rank import engine_weight_bytes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODELS / name))
    tensors = [*model.named_parameters(), *model.named_buffers()]
    held = sum(sglang_shard_numel(n, tuple(t.shape), 8) for n, t in tensors if ".rotary_emb." not in n)
    assert engine_weight_bytes(arch_from_hf(MODELS / name), 8) == 2 * held
    if name == "DeepSeek-V3":
        replicated = sum(t.numel() for n, t in tensors if n.endswith(SGLANG_WHOLE))
        assert 2 * replicated * 7 / 8 / 1e9 == pytest.approx(1.80, abs=0.01)  # what an even split missed


def test_mla_kv_cache_is_the_latent_not_k_and_v():
    # kv_lora_rank + qk_rope_head_dim per token and layer, on every engine rank (the latent has no heads);
    # full K and V of the 16 heads an engine_tp 8 rank holds, 2 x 16 x 192 x 61 x 2 bytes, are 11x more
    v3 = arch_from_hf(MODELS / "DeepSeek-V3")
    for engine_tp in (1, 8, 16):
        assert kv_bytes_per_token(v3, engine_tp) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(v3, 8, "float32") == 61 * 576 * 4
    moon = arch_from_hf(MODELS / "Moonlight-16B-A3B")
    assert kv_bytes_per_token(moon, 2) == 27 * 576 * 2
    # the plan sizes the engine's cache by it
    cfg = load_config(REPO / "configs" / "gspo_math_deepseek_v3.yaml", check_paths=False)
    plan = plan_memory(cfg, v3, nodes=32, gpus_per_node=8, gpu_mem_gib=141.0)
    assert plan.kv_tokens == plan.kv_cache // (61 * 576 * 2) > 400_000
    # GLM-4.5-Air is GQA: K and V of its 8 kv heads, one per rank at engine_tp 8
    glm = arch_from_hf(MODELS / "GLM-4.5-Air")
    assert kv_bytes_per_token(glm, 8) == 2 * 46 * 1 * 128 * 2


def test_mla_activations_count_the_heads_and_latents():
    v3 = arch_from_hf(MODELS / "DeepSeek-V3")
    m = PlanMesh(8, tp=8)
    n, a = 128, 2
    heads = n * (2 * 192 + 256 + 2 * 128) / 8
    latents = 2 * 1536 + 2 * 512 + 64
    attn = a * (2 * 7168 + heads + latents)
    dense_mlp = a * (2 * 7168 + 3 * 18432 / 8)
    assert layer_activation_bytes_per_token(v3, m, 0, a) == pytest.approx(attn + dense_mlp)


def test_mtp_layers_are_neither_trained_nor_served():
    glm = arch_from_hf(MODELS / "GLM-4.5-Air")
    assert glm.mtp_layers == 1
    without = dataclasses.replace(glm, mtp_layers=0)
    assert model_numel(glm) == model_numel(without)
    assert kv_bytes_per_token(glm, 8) == kv_bytes_per_token(without, 8)


@pytest.mark.parametrize("name", [n for n in SHIPPED if n.startswith("gspo_math_")])
def test_plan_cli_finds_the_shipped_architecture_of_each_new_family_config(capsys, name):
    # the path a user runs: model.hf_path is not downloaded, so `megagrpo plan` reads configs/models/<name>
    (nodes, gpus, mem), model, _ = SHIPPED[name]
    args = ["plan", str(REPO / "configs" / name), "--nodes", str(nodes), "--gpus-per-node", str(gpus)]
    assert main([*args, "--gpu-mem-gib", str(mem)]) == 0
    out = capsys.readouterr().out
    assert f"configs/models/{model}/config.json" in out and "verdict: FITS" in out


@pytest.mark.parametrize(
    "name,nodes,least,next_after",
    [("gspo_math_deepseek_v3.yaml", 16, 32, 64), ("gspo_math_kimi_k2.yaml", 32, 36, 68)],
)
def test_plan_refuses_fewer_nodes_than_the_layout_needs(capsys, name, nodes, least, next_after):
    # DeepSeek-V3 colocated with EP256: the world is a multiple of 256 GPUs. Kimi-K2 disaggregated: 32
    # engine ranks of their own and learner ranks a multiple of EP64 x ETP4 = 256
    cfg = str(REPO / "configs" / name)
    args = ["plan", cfg, "--gpus-per-node", "8", "--gpu-mem-gib", "141"]
    assert main([*args, "--nodes", str(least)]) == 0
    assert "verdict: FITS" in capsys.readouterr().out
    assert main([*args, "--nodes", str(nodes)]) == 2
    err = capsys.readouterr().err
    assert f"--nodes {nodes}: this config needs at least {least} nodes of 8 GPUs" in err
    assert f"pass --nodes {least} or more" in err and "mesh.ep*etp*pp = 256" in err
    assert main([*args, "--nodes", str(least + 4)]) == 2  # more, but not a layout that works
    assert f"the nearest node count above that can: --nodes {next_after}" in capsys.readouterr().err
    assert main([*args, "--nodes", str(next_after)]) == 0


def test_vocab_padding_is_the_learners():
    from megagrpo.learner.model import padded_vocab_size

    for tp in (1, 2, 3, 4, 8):
        assert padded_vocab(QWEN3_30B, tp) == padded_vocab_size(QWEN3_30B, tp)


def test_learner_state_by_hand():
    # Qwen3-30B-A3B on TP2 x EP8 x PP2 over 16 GPUs: experts are split 16 ways, dense tensors 4 ways.
    mesh = PlanMesh(16, tp=2, pp=2, ep=8)
    H, E, Fe, L = 2048, 128, 768, 48
    experts = 3 * H * Fe * (E // 8) * (L // 2)
    dense0, expert0 = stage_tensor_numels(QWEN3_30B, mesh, 0)
    assert sum(expert0) == experts
    attn = (32 + 2 * 4) * 128 * H // 2 + H * 32 * 128 // 2 + 2 * H + 2 * 128 + E * H
    assert sum(dense0) == 151936 * H // 2 + attn * L // 2  # embedding on stage 0
    st = learner_state_bytes(QWEN3_30B, mesh, 16, stage=0)
    assert st.grads == 2 * st.params  # fp32 grad buffer beside bf16 params, same padded length
    assert st.params == pytest.approx(2 * (experts + sum(dense0)), rel=1e-4)  # padding only
    # Adam moments + fp32 master over DP: dense DP = 16 / (2 x 2) = 4, expert-DP = 16 / (8 x 2) = 1
    assert st.optimizer == pytest.approx(12 * (sum(dense0) / 4 + experts), rel=1e-4)
    fp32 = learner_state_bytes(
        QWEN3_30B, mesh, 16, param_dtype="float32", distributed_optimizer=False, stage=0
    )
    assert fp32.optimizer == 2 * fp32.params == 8 * st.numel  # no master copy for fp32 params


def test_kv_cache_per_token_replicates_heads_beyond_engine_tp():
    assert kv_bytes_per_token(QWEN3_30B, 1) == 2 * 48 * 4 * 128 * 2
    assert kv_bytes_per_token(QWEN3_30B, 2) == 2 * 48 * 2 * 128 * 2
    assert kv_bytes_per_token(QWEN3_30B, 8) == kv_bytes_per_token(QWEN3_30B, 4)  # 4 kv heads: 1 per rank


def test_activations_scale_with_tokens_and_shrink_with_recompute_and_sharding():
    mesh = PlanMesh(8, ep=8)
    one = activation_bytes(QWEN3_30B, mesh, 4096)
    assert activation_bytes(QWEN3_30B, mesh, 8192) == pytest.approx(2 * one, rel=1e-6)
    assert activation_bytes(QWEN3_30B, mesh, 4096, recompute="full") < one / 10
    tp4 = activation_bytes(QWEN3_30B, PlanMesh(8, tp=4, ep=2, sequence_parallel=True), 4096)
    assert tp4 == pytest.approx(one / 4, rel=1e-6)
    # per token and layer (docstring formula): attention 2H + 2(n+g)d, MoE 2H + k(2H + 3F_e), bf16,
    # fp32 router input and logits; L + 1 layers (one layer of transient gradients in backward)
    per_layer = 2 * (2 * 2048 + 2 * 36 * 128) + 2 * 2 * 2048 + 4 * (2048 + 256) + 2 * 8 * (2 * 2048 + 3 * 768)
    assert one == int(per_layer * 4096 * 49)


def test_phases_learner_offloaded_while_sampling_and_beside_the_engine_weights_in_the_sync():
    cfg = load_config(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml", check_paths=False)
    plan = plan_memory(cfg, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    assert plan.rollout_peak == int(cfg.rollout.mem_fraction_static * 80 * GIB) + plan.rows_in_flight
    assert plan.train_peak == plan.params + plan.grads + plan.optimizer + plan.activations + plan.logits
    largest = learner_state_bytes(QWEN3_30B, cfg.mesh, 16).total  # the last stage's, with the output layer
    assert plan.sync_peak == largest + plan.engine_weights + 2 * (cfg.sync.bucket_mb << 20)
    assert plan.total == max(plan.rollout_peak, plan.sync_peak, plan.train_peak)


def test_pipeline_in_flight_micro_batches_are_counted_on_the_first_stage():
    w = Workload(mesh=PlanMesh(16, tp=2, pp=2, ep=8, sequence_parallel=True), seq_len=2048, micro_batches=64)
    plan = plan_workload(QWEN3_30B, w)
    assert plan.stage == 0
    single = dataclass_replace(w, micro_batches=1)
    assert plan_workload(QWEN3_30B, single).activations < plan.activations


def dataclass_replace(w: Workload, **kw) -> Workload:
    import dataclasses

    return dataclasses.replace(w, **kw)


def test_max_micro_batch_is_the_largest_that_fits():
    cfg = load_config(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml", check_paths=False)
    plan = plan_memory(cfg, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    k = plan.max_micro_batch
    at = load_config(
        REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml",
        [f"schedule.micro_batch_size={k}"],
        check_paths=False,
    )
    assert plan_memory(at, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80).fits
    over = load_config(
        REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml",
        [f"schedule.micro_batch_size={k + 1}"],
        check_paths=False,
    )
    assert not plan_memory(over, QWEN3_30B, nodes=2, gpus_per_node=8, gpu_mem_gib=80).fits
    # and the largest KV cache: the learner is offloaded while sampling, so all but the engine weights
    # and the rows in flight
    per_token = kv_bytes_per_token(QWEN3_30B, 4)
    assert plan.max_kv_tokens == (plan.budget - plan.engine_weights - plan.rows_in_flight) // per_token


def test_plan_cli_prints_the_table_and_exits_1_when_it_does_not_fit(capsys):
    cfg = str(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml")
    assert main(["plan", cfg, "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "configs/models/Qwen3-30B-A3B/config.json" in out and "verdict: FITS" in out
    for row in (
        "learner parameters",
        "learner gradients",
        "optimizer",
        "activations",
        "reference model",
        "engine weights",
        "engine KV cache",
        "largest micro_batch_size",
    ):
        assert row in out
    assert main(["plan", cfg, "mesh.pp=1", "--nodes", "1", "--gpus-per-node", "8"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", cfg, "--nodes", "2", "--gpus-per-node", "8", "--model-config", "/nonexistent"]) == 2
    assert "--model-config /nonexistent" in capsys.readouterr().err


def _big_model_config(tmp_path: Path, overrides: list[str]) -> list[str]:
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    shutil.copy(MODELS / "Qwen3-30B-A3B" / "config.json", model / "config.json")
    return [str(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml"), f"model.hf_path={model}", *overrides]


def test_submit_refuses_a_plan_that_does_not_fit_unless_forced(tmp_path, capsys, monkeypatch):
    import megagrpo.submit.slurm as slurm

    monkeypatch.setattr(slurm, "have_slurm", lambda: False)
    args = [
        "submit",
        *_big_model_config(tmp_path, ["mesh.pp=1", "mesh.ep=4"]),
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--dry-run",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "memory plan does not fit 80 GiB" in err and "--force" in err
    assert main([*args, "--gpu-mem-gib", "141"]) == 0  # an H200 holds it
    capsys.readouterr()
    assert main([*args, "--force"]) == 0
    assert "--force: the memory plan does not fit" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_names_the_fewest_nodes_that_do(capsys):
    # Qwen3-30B-A3B on TP2 x EP4 without PP: 88 GiB of learner state on one node; Adam's share shrinks
    # with data parallelism, and 3 nodes are the first that hold it
    args = ["plan", str(REPO / "configs" / "countdown_qwen3_moe_gdpo.yaml"), "mesh.pp=1", "mesh.ep=4"]
    args += ["--gpus-per-node", "8"]
    assert main([*args, "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "--nodes 1: the fewest nodes of 8 x 80 GiB GPUs this config fits on are 3" in out
    assert main([*args, "--nodes", "2"]) == 1 and "fits on are 3" in capsys.readouterr().out
    assert main([*args, "--nodes", "3"]) == 0
    capsys.readouterr()
    # GLM-4.5-Air with its experts split only 8 ways: no node count helps, and the plan says what does
    glm = ["plan", str(REPO / "configs" / "gspo_math_glm45_air.yaml"), "mesh.pp=1", "mesh.ep=8"]
    assert main([*glm, "--nodes", "8", "--gpus-per-node", "8"]) == 1
    assert "--nodes 8: more nodes do not make it fit (up to 40 tried)" in capsys.readouterr().out


def test_the_shipped_architecture_facts_are_complete_hf_configs():
    for d in MODELS.iterdir():
        cfg = json.loads((d / "config.json").read_text())
        arch = arch_from_hf(cfg)
        assert arch.num_layers > 0 and math.isfinite(arch.rope_theta)


def test_uneven_pipeline_stages_are_planned_by_their_own_layers():
    """Issue 37 section 4: a layer count that PP does not divide is planned with the first/last stage
    counts (each stage holds its own layers; a GPU is sized by the largest stage), and refused without."""
    import dataclasses

    arch = dataclasses.replace(QWEN3_30B, num_layers=57)  # 57 = 1 + 8 x 7: PP8 does not divide it
    with pytest.raises(MegagrpoError, match="mesh.first_stage_layers"):
        stage_tensor_numels(arch, PlanMesh(64, pp=8, ep=8), 0)
    mesh = PlanMesh(64, pp=8, ep=8, first_stage_layers=1)
    layer = sum(map(sum, stage_tensor_numels(arch, mesh, 3)))  # a middle stage: 8 layers, nothing else
    dense0, expert0 = stage_tensor_numels(arch, mesh, 0)
    assert sum(dense0) + sum(expert0) == padded_vocab(arch, 1) * 2048 + layer // 8  # embedding + 1 layer
    last = stage_tensor_numels(arch, mesh, 7)
    assert sum(map(sum, last)) == layer + 2048 + padded_vocab(arch, 1) * 2048  # + final norm, output layer
    # activations follow the stage's layer count (all layers alike here: MoE with the same shapes)
    a0, a3 = (activation_bytes(arch, mesh, 4096, stage=s) for s in (0, 3))
    assert a3 == pytest.approx(a0 * (8 + 1) / (1 + 1), rel=1e-9)  # its layers + one in backward
    w = Workload(mesh=mesh, seq_len=2048, micro_batches=1)
    plan = plan_workload(arch, w)
    assert plan.stage != 0  # the one-layer first stage is not the largest
    assert "pp=8 (layers per stage: 1+8x7)" in plan.table()
