"""Issue 16, the memory plan against published MoE RL runs: Qwen3-30B-A3B configurations that ran, read
from their own repositories (mesh, micro-batch, sequence length, recompute, offload, engine memory),
must be classified as fitting; variants made deliberately too large must not. The table with figures
is in docs/scaling.md.

Each `Workload` states only what the source sets or what its framework defaults to (noted inline). The
learner knob megagrpo lacks (optimizer CPU offload) is the Workload's `optimizer_offload`; whether the
learner leaves the GPU while the engine samples (megagrpo, NeMo-RL and slime do) is `offload_in_rollout`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.plan.memory import GIB, PlanMesh, Workload, plan_workload

REPO = Path(__file__).resolve().parents[3]
QWEN3_30B_A3B = arch_from_hf(REPO / "configs" / "models" / "Qwen3-30B-A3B")


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    source: str  # repository, path and the commit read
    gpu_mem_gib: float
    workload: Workload


PUBLISHED = [
    Published(
        "verl GRPO, Megatron, 4 nodes",
        "volcengine/verl examples/grpo_trainer/run_qwen3moe-30b_megatron.sh @3f388066",
        80.0,  # not stated in the script; 80 GB H100/A100 assumed
        Workload(
            # TP4 PP2 EP4; ETP unset -> megatron's default ETP = TP; verl turns SP on with TP > 1
            mesh=PlanMesh(32, tp=4, pp=2, ep=4, etp=4, sequence_parallel=True),
            seq_len=1024 + 2048,  # max_prompt_length + max_response_length
            micro_batch_size=4,  # ppo_micro_batch_size_per_gpu
            micro_batches=20,  # ppo_mini_batch_size 64 x n 5 / DP 4 / 4
            recompute="full",  # enable_gradient_checkpointing=True
            reference=True,  # use_kl_loss=True; ref param_offload defaults to False
            offload_in_rollout=False,  # actor param/grad/optimizer_offload default to False
            engine_tp=4,
            engine_mem_fraction=0.6,  # vLLM gpu_memory_utilization
        ),
    ),
    Published(
        "slime GRPO + TIS, colocated, 1 node",
        "THUDM/slime scripts/run-qwen3-30B-A3B.sh @128cb0e7",
        80.0,  # H100 80 GB assumed
        Workload(
            mesh=PlanMesh(8, tp=4, ep=8, etp=1, sequence_parallel=True),
            seq_len=1024 + 8192,  # prompt (assumed) + rollout-max-response-len
            micro_batch_tokens=20480,  # use-dynamic-batch-size, max-tokens-per-gpu 20480
            recompute="full",  # recompute-granularity full, uniform, 1 layer
            reference=True,  # use-kl-loss with ref-load; the reference weights live on the CPU
            ref_offload=True,
            optimizer_offload=1.0,  # optimizer-cpu-offload + use-precision-aware-optimizer
            offload_in_rollout=True,  # --colocate offloads the training model while SGLang samples
            engine_tp=8,  # rollout-num-gpus-per-engine
            engine_mem_fraction=0.7,  # sglang-mem-fraction-static
        ),
    ),
    Published(
        "NeMo-RL GRPO, Megatron, 8 nodes (release test)",
        "NVIDIA-NeMo/RL examples/configs/recipes/llm/grpo-qwen3-30ba3b-8n8g-megatron.yaml @1c4a1f5c "
        "(defaults: examples/configs/grpo_math_1B.yaml)",
        80.0,  # H100 80 GB assumed
        Workload(
            mesh=PlanMesh(64, tp=4, pp=4, ep=4, etp=1, sequence_parallel=True),  # ETP 1 from the defaults
            seq_len=4096,  # max_total_sequence_length
            micro_batch_size=1,  # train_micro_batch_size
            grad_dtype="bfloat16",  # grad_reduce_in_fp32: false
            recompute="none",  # activation_checkpointing: false
            reference=True,  # reference_policy_kl_penalty 0.01; reference weights kept on the CPU
            ref_offload=True,
            offload_in_rollout=True,  # colocated: the policy is offloaded before generation
            engine_tp=4,
            engine_mem_fraction=0.7,
        ),
    ),
    Published(
        "NeMo-RL GRPO, Megatron, 4 nodes (performance recipe)",
        "NVIDIA-NeMo/RL examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-4n8g.yaml @0b88cccc "
        "(defaults: examples/configs/grpo_math_1B.yaml)",
        80.0,
        Workload(
            mesh=PlanMesh(32, tp=1, ep=8, etp=1),
            seq_len=4096,
            micro_batch_size=1,
            grad_dtype="bfloat16",
            recompute="none",
            reference=True,
            ref_offload=True,
            offload_in_rollout=True,
            engine_tp=2,
            engine_mem_fraction=0.6,  # gpu_memory_utilization default
        ),
    ),
]

OVERSIZED = [
    # slime's run without its two memory savers: optimizer state on the GPU and no recompute
    dataclasses.replace(
        PUBLISHED[1],
        name="slime without optimizer offload and recompute",
        workload=dataclasses.replace(PUBLISHED[1].workload, optimizer_offload=0.0, recompute="none"),
    ),
    # verl's run squeezed onto one node without expert or pipeline parallelism
    dataclasses.replace(
        PUBLISHED[0],
        name="verl on 8 GPUs, TP4 only",
        workload=dataclasses.replace(PUBLISHED[0].workload, mesh=PlanMesh(8, tp=4, sequence_parallel=True)),
    ),
    # NeMo-RL's performance recipe with 4x longer sequences and no recompute
    dataclasses.replace(
        PUBLISHED[3],
        name="NeMo-RL 4n8g at 16k tokens",
        workload=dataclasses.replace(PUBLISHED[3].workload, seq_len=16384),
    ),
]


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name)
def test_published_runs_fit(run):
    plan = plan_workload(QWEN3_30B_A3B, run.workload, gpu_mem_gib=run.gpu_mem_gib)
    assert plan.fits, f"{run.name} ({run.source}) ran, but the plan says:\n{plan.table()}"
    assert plan.max_micro_batch >= run.workload.micro_batch_size
    assert plan.kv_tokens >= run.workload.seq_len


@pytest.mark.parametrize("run", OVERSIZED, ids=lambda r: r.name)
def test_oversized_variants_do_not_fit(run):
    plan = plan_workload(QWEN3_30B_A3B, run.workload, gpu_mem_gib=run.gpu_mem_gib)
    assert not plan.fits and plan.reasons
    assert plan.total > plan.budget


def test_runs_without_offload_keep_their_state_resident_while_sampling():
    verl = plan_workload(QWEN3_30B_A3B, PUBLISHED[0].workload, gpu_mem_gib=80.0)
    pool = int(0.6 * 80 * GIB)
    assert verl.rollout_peak == verl.params + verl.grads + verl.optimizer + verl.reference + pool
    nemo = plan_workload(QWEN3_30B_A3B, PUBLISHED[2].workload, gpu_mem_gib=80.0)
    assert nemo.rollout_peak == int(0.7 * 80 * GIB)
