"""Issue 37 section 4: SGLang engines that span nodes (multi-node TP/EP) where one node cannot hold the model.

Planned (the smallest engine and its nodes: DeepSeek-V3 in bf16 or on 80 GB GPUs, Kimi-K2 anywhere),
submitted (which rank starts which engine's SGLang node_rank), started (the engine arguments and the
rendezvous of the nodes' ranks), and refused on the CPU, where SGLang cannot run an engine of two ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.config import load_config
from megagrpo.config.mesh_rules import EngineNode, engine_node_of, engine_nodes, rank_roles
from megagrpo.config.schema import check_mesh
from megagrpo.errors import MegagrpoError
from megagrpo.plan.engines import engine_span, min_engine_tp
from megagrpo.plan.job import plan_memory
from megagrpo.plan.memory import PlanMesh, Workload
from megagrpo.submit.resources import JobShape, check_mesh_fits, role_layout

REPO = Path(__file__).resolve().parents[3]
DISAGG = REPO / "configs" / "disaggregated_qwen3_moe.yaml"

# The public config.json fields of DeepSeek-V3 (671B) and Kimi-K2 (1T, the same shape, wider)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
KIMI_K2 = {
    **DEEPSEEK_V3, "n_routed_experts": 384, "num_attention_heads": 64, "num_key_value_heads": 64,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    "vocab_size": 163840, "routed_scaling_factor": 2.827,
}  # fmt: skip


@pytest.fixture(scope="module")
def archs(tmp_path_factory):
    out = {}
    for name, cfg in (("DeepSeek-V3", DEEPSEEK_V3), ("Kimi-K2", KIMI_K2)):
        d = tmp_path_factory.mktemp(name)
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = arch_from_hf(d)
    return out


@pytest.mark.parametrize(
    "model, fp8, gpu_gib, gpus, nodes",
    [
        ("DeepSeek-V3", False, 141, 16, 2),  # bf16 (1.3 TB) on any 8-GPU node: two nodes
        ("DeepSeek-V3", False, 80, 32, 4),
        ("DeepSeek-V3", True, 80, 16, 2),  # fp8 (0.7 TB) on 80 GB GPUs: two nodes
        ("DeepSeek-V3", True, 141, 8, 1),  # fp8 on an H200 node: one node holds it
        ("Kimi-K2", True, 141, 16, 2),  # Kimi-K2 (1 TB in fp8) needs two nodes anywhere
        ("Kimi-K2", True, 80, 16, 2),
        ("Kimi-K2", False, 141, 32, 4),
    ],
)
def test_the_smallest_engine_and_its_nodes(archs, model, fp8, gpu_gib, gpus, nodes):
    w = Workload(mesh=PlanMesh(8), seq_len=8192, engine_tp=8, engine_fp8=fp8, engine_mem_fraction=0.85)
    assert min_engine_tp(archs[model], w, gpu_gib) == gpus
    span = engine_span(archs[model], w, gpus_per_node=8, gpu_mem_gib=gpu_gib, disaggregated=True)
    assert (span.min_engine_tp, span.min_nodes) == (gpus, nodes)
    if nodes > 1:  # engine_tp=8 is one node: too small, and the reason names the engine that fits
        assert not span.fits
        assert f"set rollout.engine_tp={gpus}: an engine over {nodes} nodes of 8 GPUs" in span.reasons[0]
    else:
        assert span.fits


def test_plan_of_a_disaggregated_engine_over_two_nodes(archs):
    """DeepSeek-V3 in bf16 on 80 GB GPUs with engines of 32 GPUs, 4 nodes each: the plan prints the engine's
    nodes; with engine_tp 8 (one node) it names the size that holds the model."""
    over = [
        "rollout.engine_tp=32", "rollout.num_engines=1", "mesh.tp=8", "mesh.ep=8", "mesh.pp=4",
        "mesh.first_stage_layers=13", "rollout.fp8=false", "rollout.dtype=bfloat16",
    ]  # fmt: skip
    cfg = load_config(DISAGG, over, check_paths=False)
    plan = plan_memory(cfg, archs["DeepSeek-V3"], nodes=8, gpus_per_node=8, gpu_mem_gib=80)
    assert plan.engine_span.nodes == 4 and plan.engine_span.fits
    assert "engine: engine_tp=32 on 4 nodes (SGLang nnodes=4" in plan.table()
    small = load_config(DISAGG, [*over[1:], "rollout.engine_tp=8"], check_paths=False)
    plan = plan_memory(small, archs["DeepSeek-V3"], nodes=5, gpus_per_node=8, gpu_mem_gib=80)
    assert not plan.fits and "engine size" in plan.failing
    assert "set rollout.engine_tp=32: an engine over 4 nodes of 8 GPUs" in plan.table()


def test_which_rank_starts_which_engine_node():
    # disaggregated: 16 learner ranks, then engines of 16 GPUs on nodes of 8: each engine takes two nodes
    assert engine_nodes(16, 8) == 2 and engine_nodes(4, 8) == 1
    starts = {r: engine_node_of(r, 16, 16, 8) for r in range(48)}
    assert {r: n for r, n in starts.items() if n is not None} == {
        16: EngineNode(engine=0, node_rank=0, nnodes=2),
        24: EngineNode(engine=0, node_rank=1, nnodes=2),
        32: EngineNode(engine=1, node_rank=0, nnodes=2),
        40: EngineNode(engine=1, node_rank=1, nnodes=2),
    }
    # an engine within a node: its first rank starts it, as before
    assert engine_node_of(20, 16, 4, 8) == EngineNode(engine=1, node_rank=0, nnodes=1)
    assert engine_node_of(21, 16, 4, 8) is None
    with pytest.raises(MegagrpoError, match=r"rollout.engine_tp=12 spans nodes of 8 GPUs .* use 16"):
        engine_nodes(12, 8)


def test_submit_renders_the_engine_nodes_and_refuses_a_colocated_engine_over_nodes():
    cfg = load_config(DISAGG, ["rollout.engine_tp=16", "rollout.num_engines=1"], check_paths=False)
    shape = JobShape(4, 8, "gpu")
    sizes = check_mesh_fits(cfg, shape)
    assert role_layout(sizes, 16, shape)[2:] == [
        "node 2: rollout GPUs 0-7 (ranks 16-23: engine 0 of engine_tp 16, its SGLang node_rank 0 of nnodes 2, "
        "started by rank 16)",
        "node 3: rollout GPUs 0-7 (ranks 24-31: engine 0 of engine_tp 16, its SGLang node_rank 1 of nnodes 2, "
        "started by rank 24)",
    ]
    colocated = cfg.model_copy(deep=True)
    colocated.rollout.placement.kind = "colocated"
    colocated.rollout.num_engines = None
    colocated.rollout.mode = "colocated"
    with pytest.raises(MegagrpoError, match="runs in the disaggregated placement only"):
        check_mesh_fits(colocated, JobShape(4, 8, "gpu"))


def test_cpu_accepts_an_engine_of_more_than_one_rank():
    """SGLang's CPU engine of 2+ ranks starts once its TP groups ask no PyNccl (`compat.sglang_cpu`): a
    disaggregated CPU launch of 4 ranks gives 2 to the learner and 2 to one engine of engine_tp 2."""
    cfg = load_config(
        DISAGG,
        [
            "mesh={tp: 1, pp: 1, ep: 1, etp: 1, cp: 1, sequence_parallel: false}",
            "rollout.engine_tp=2",
            "rollout.num_engines=1",
        ],
        check_paths=False,
    )
    roles = rank_roles(4, 2, 1, disaggregated=True, on_gpu=False)
    assert (roles.learners, roles.engines, roles.engine_ranks) == (2, 1, 2)
    check_mesh(cfg, 4, on_gpu=False)
    check_mesh_fits(cfg, JobShape(2, 2, "cpu"))
    # an engine over both nodes of a 2-node CPU job leaves no rank to learn: refused by the GPU's rule
    with pytest.raises(MegagrpoError, match="leaving none to learn"):
        rank_roles(4, 4, 1, disaggregated=True, on_gpu=False)


class _Store:
    """The launch store's calls that the rendezvous makes (set, check, get), in a dict."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, k):
        return self.d[k]


def test_the_ranks_of_an_engine_over_two_nodes_start_its_nodes(tmp_path, monkeypatch):
    """`megagrpo train` on 4 nodes x 8 GPUs, disaggregated, one engine of 16 GPUs: ranks 16 and 24 start
    SGLang nodes 0 and 1 of the engine; node 1 meets node 0 where node 0's rank published it."""
    import torch

    import megagrpo.rollout.engines.server as server
    from megagrpo.config import config_from_dict
    from megagrpo.rollout.engines.engine import RolloutEngine
    from megagrpo.trainer.entry import serve_if_engine_rank

    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    cfg = config_from_dict(
        {
            "model": {"hf_path": str(tmp_path)},
            "rollout": {"engine_tp": 16, "num_engines": 1, "placement": {"kind": "disaggregated"}},
        }
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    served = {}
    monkeypatch.setattr(server, "serve", lambda rc, **kw: served.setdefault(kw["rank"], (rc, kw)) and 0)
    for rank in (16, 17, 24, 31):
        env = {"RANK": rank, "WORLD_SIZE": 32, "LOCAL_RANK": rank % 8, "GROUP_RANK": rank // 8}
        for k, v in {**env, "GROUP_WORLD_SIZE": 4, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": 29500}.items():
            monkeypatch.setenv(k, str(v))
        assert serve_if_engine_rank(cfg) == 0
    got = {r: (kw["first"], kw["node_rank"], kw["nnodes"], rc.base_gpu_id) for r, (rc, kw) in served.items()}
    assert got == {16: (True, 0, 2, 0), 17: (False, 0, 1, 1), 24: (True, 1, 2, 0), 31: (False, 0, 1, 7)}

    # the nodes' meeting point, through the store: node 0 publishes, node 1 reads
    store = _Store()
    rc0 = server._node_config(served[16][0], store, 0, "127.0.0.1", 0, 2, timeout_s=1)
    rc1 = server._node_config(served[24][0], store, 0, "10.0.0.4", 1, 2, timeout_s=1)
    assert rc0.dist_init_addr.startswith("127.0.0.1:") and rc1.dist_init_addr == rc0.dist_init_addr
    kw = RolloutEngine(rc1).engine_kwargs()
    assert (kw["tp_size"], kw["nnodes"], kw["node_rank"], kw["dist_init_addr"]) == (
        16,
        2,
        1,
        rc0.dist_init_addr,
    )
    with pytest.raises(MegagrpoError, match="did not publish where its nodes meet"):
        server._node_config(served[24][0], _Store(), 0, "10.0.0.4", 1, 2, timeout_s=0.3)


def test_the_cpu_engine_starts_its_node_of_an_engine_over_nodes(tmp_path):
    """On the CPU too, node 1 of an engine over 2 nodes meets node 0 at dist_init_addr; SGLang's custom
    all-reduce (CUDA IPC) is switched off by its own server argument."""
    from megagrpo.rollout import RolloutConfig
    from megagrpo.rollout.engines.engine import RolloutEngine

    (tmp_path / "config.json").write_text("{}")
    rc = RolloutConfig(str(tmp_path), tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")
    kw = RolloutEngine(rc).engine_kwargs()
    assert (kw["device"], kw["tp_size"], kw["nnodes"], kw["node_rank"], kw["dist_init_addr"]) == (
        "cpu",
        2,
        2,
        1,
        "h:1",
    )
    assert kw["disable_custom_all_reduce"] is True
    with pytest.raises(MegagrpoError, match="needs node_rank in"):
        RolloutEngine(RolloutConfig(str(tmp_path), tp_size=2, nnodes=2, node_rank=1))


def test_a_cpu_engine_of_two_ranks_gets_its_threads_bind(tmp_path, monkeypatch):
    """Unset, SGLang asserts one NUMA node per CPU rank ("SGLANG_CPU_OMP_THREADS_BIND is not set ..."), so
    a TP 2 engine on one socket failed as its schedulers started; the engine sets it from its cores."""
    from megagrpo.rollout import RolloutConfig
    from megagrpo.rollout.engines.engine import THREADS_BIND_ENV, RolloutEngine, cpu_threads_bind

    assert cpu_threads_bind(2, 1, [3, 0, 1, 2]) == "0,1|2,3"  # one node: a run for each rank
    assert cpu_threads_bind(4, 2, range(8)) == "0,1,2,3|4,5,6,7"  # each node holds 2 of the 4 ranks
    assert cpu_threads_bind(2, 2, [0, 1]) == "0,1"
    assert cpu_threads_bind(4, 1, [0, 1]) == "0,1|0,1|0,1|0,1"  # fewer cores than ranks: all, each
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv(THREADS_BIND_ENV, "")  # unset (empty counts so), and restored after the test
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    RolloutEngine(RolloutConfig(str(tmp_path))).export_cpu_threads_bind()
    assert os.environ[THREADS_BIND_ENV] == ""  # one rank: SGLang's default holds
    RolloutEngine(RolloutConfig(str(tmp_path), tp_size=2)).export_cpu_threads_bind()
    assert os.environ[THREADS_BIND_ENV] == "0|1"
    monkeypatch.setenv(THREADS_BIND_ENV, "5|6")  # the user's own
    RolloutEngine(RolloutConfig(str(tmp_path), tp_size=2)).export_cpu_threads_bind()
    assert os.environ[THREADS_BIND_ENV] == "5|6"


def test_the_plan_modules_import_in_one_direction():
    """Issue 43 part 5: `plan/engines.py` imported `plan/memory.py`, which imported it back (for
    `EngineSpan`); the engine's side of the plan now lives in `plan/engine_rank.py`, below both. Every
    import between the plan's modules, the type-checking ones included, runs one way."""
    import ast

    plan = REPO / "megagrpo" / "plan"
    edges = {}
    for path in plan.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megagrpo.plan."):
                found.add(node.module.rsplit(".", 1)[1])
        edges[path.stem] = found

    def reaches(start, goal, seen=()):
        return any(
            n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges.get(start, ())
        )

    assert edges["memory"] and "engine_rank" in edges["engines"]
    assert not [m for m in edges if reaches(m, m)], edges
