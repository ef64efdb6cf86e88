"""The memory plan against what a CPU learner allocates: for tiny models of each family on several 2-process
meshes, with the DistributedOptimizer on and off, each rank sums the bytes of the storages behind its
parameters, its main grads and its optimizer state (after one step, so Adam's state exists), and
writes them beside `plan.learner_state_bytes` for its pipeline stage. The pytest side compares."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from megagrpo.config.model import ModelArch
from megagrpo.learner.mesh import DistEnv, MeshConfig, destroy_mesh, init_mesh
from megagrpo.learner.model import build_gpt_model, wrap_ddp
from megagrpo.learner.optimizer import OptimizerConfig, build_optimizer
from megagrpo.plan.memory import learner_state_bytes
from tests.dist._common import TINY_DEEPSEEK_V3, TINY_GLM4_MOE, TINY_MOE, write_json

TINY_DENSE = dataclasses.replace(
    TINY_MOE, family="qwen2", qk_norm=False, qkv_bias=True, num_experts=0, moe_topk=0, moe_ffn_hidden_size=0
)
TINY_TIED = dataclasses.replace(TINY_DENSE, family="llama", qkv_bias=False, tie_embeddings=True)

# the DeepSeek-V3 family's multi-latent attention with a q latent and without one (Moonlight), its shared
# expert and dense first layer; GLM-4.5's GQA with q/k/v biases and q/k norms beside the same MoE block
MODELS = {
    "moe": TINY_MOE,
    "dense": TINY_DENSE,
    "tied": TINY_TIED,
    "deepseek_v3": TINY_DEEPSEEK_V3,
    "deepseek_v3_no_q_latent": dataclasses.replace(TINY_DEEPSEEK_V3, q_lora_rank=None),
    "glm4_moe": TINY_GLM4_MOE,
}
MESHES = {
    "dp2": MeshConfig(),
    "tp2": MeshConfig(tp=2, sequence_parallel=True),
    "ep2": MeshConfig(ep=2),
    "pp2": MeshConfig(pp=2),
}


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view into a buffer counts the whole buffer)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Adam's state tensors and fp32 master copies of every (chained) megatron optimizer."""
    out: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            out += [v for v in state.values() if torch.is_tensor(v)]
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(opt, name, []) or []:
                out += [p for p in group if p is not None]
    return out


def measure(arch: ModelArch, mesh: MeshConfig, distributed: bool) -> dict[str, int]:
    chunks = build_gpt_model(arch, mesh)
    model = wrap_ddp(chunks, distributed_optimizer=distributed)
    optimizer, _ = build_optimizer(
        model, OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed, total_steps=2)
    )
    params = [p for c in chunks for p in c.parameters()]
    for p in params:
        p.main_grad.normal_()  # a step with real grads; Adam creates its state on the first step
    optimizer.step()
    grads = [p.main_grad for p in params]
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    # with fp32 params the DistributedOptimizer's shard "main params" are views of the params: not new
    opt = [t for t in _optimizer_tensors(optimizer) if t.untyped_storage().data_ptr() not in param_ptrs]
    return {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(grads),
        "optimizer": _storage_bytes(opt),
        "numel": sum(p.numel() for p in params),
    }


def main(rank: int, world: int, outdir: Path) -> None:
    from megatron.core import parallel_state

    env = DistEnv.from_environ()
    results = {}
    for mname, arch in MODELS.items():
        for meshname, mesh in MESHES.items():
            if (not arch.is_moe and mesh.ep > 1) or (arch.tie_embeddings and mesh.pp > 1):
                continue  # tied embeddings across stages call .cuda() in megatron: GPU only
            for distributed in (True, False):
                init_mesh(mesh, env, seed=0)
                got = measure(arch, mesh, distributed)
                stage = parallel_state.get_pipeline_model_parallel_rank()
                plan = learner_state_bytes(
                    arch,
                    mesh,
                    world,
                    param_dtype="float32",
                    grad_dtype="float32",
                    distributed_optimizer=distributed,
                    stage=stage,
                )
                results[f"{mname}/{meshname}/{'distopt' if distributed else 'adam'}"] = {
                    "measured": got,
                    "planned": {
                        "params": plan.params,
                        "grads": plan.grads,
                        "optimizer": plan.optimizer,
                        "numel": plan.numel,
                    },
                }
                destroy_mesh()
    write_json(outdir / f"rank{rank}.json", results)
