"""Issue 16, item 6 on CUDA: `Learner.offload()` gives the device memory of parameters, gradients and
optimizer state back while the sampler runs, and `reload()` restores every byte.

Uses the GPU tier's fixtures (`one_rank`, `hf_moe` in tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import grpo_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T = 4, 40


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor([T, 31, 22, 17])
    pos = torch.arange(T).unsqueeze(0)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    ids = torch.where(pos < lens.unsqueeze(1), ids, torch.zeros_like(ids))
    mask = (pos >= 6) & (pos < lens.unsqueeze(1))
    return {
        "input_ids": ids,
        "seq_lens": lens,
        "loss_mask": mask,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "old_logp": torch.full((B, T), -7.0),
    }


def _learner(hf_dir, env, *, distributed_optimizer: bool):
    from megagrpo.bridge.hf_config import arch_from_hf
    from megagrpo.learner.learner import Learner, LearnerConfig
    from megagrpo.learner.optimizer import OptimizerConfig
    from megagrpo.trainer.weights import load_hf_into_learner

    arch = arch_from_hf(hf_dir / "config.json")
    cfg = LearnerConfig(dtype=torch.bfloat16, seed=1, distributed_optimizer=distributed_optimizer)
    learner = Learner(arch, cfg, optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0), env=env)
    load_hf_into_learner(learner, hf_dir)
    return learner


def _snapshot(learner) -> dict[str, torch.Tensor]:
    """Copies of every parameter, DDP grad buffer and optimizer-state tensor, by a stable name."""
    out = {}
    for i, chunk in enumerate(learner.model):
        for name, p in chunk.named_parameters():
            out[f"param/{i}/{name}"] = p.detach().clone()
        for j, buf in enumerate([*chunk.buffers, *chunk.expert_parallel_buffers]):
            out[f"grad_data/{i}/{j}"] = buf.grad_data.clone()
            if buf.param_data is not None:
                out[f"param_data/{i}/{j}"] = buf.param_data.clone()
    subs = getattr(learner.optimizer, "chained_optimizers", None) or [learner.optimizer]
    for k, sub in enumerate(subs):
        for g, group in enumerate(sub.optimizer.param_groups):
            for n, p in enumerate(group["params"]):
                out[f"main/{k}/{g}/{n}"] = p.detach().clone()
                for key, v in sub.optimizer.state[p].items():
                    if torch.is_tensor(v):
                        out[f"state/{k}/{g}/{n}/{key}"] = v.clone()
    return out


def _owned_cuda_bytes(learner) -> int:
    return sum(st.nbytes() for st in learner._device_storages().values())


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_offload_frees_the_learner_and_reload_restores_every_byte(one_rank, hf_moe, distributed_optimizer):
    learner = _learner(hf_moe, one_rank, distributed_optimizer=distributed_optimizer)
    try:
        batch = _batch(1024)
        learner.train_step(batch, grpo_loss(batch))  # Adam state exists and the grad buffers hold grads
        before = _snapshot(learner)
        logp = learner.forward(batch)["logprobs"]
        owned = _owned_cuda_bytes(learner)
        # each parameter: itself, its fp32 grad, two fp32 Adam moments, and an fp32 main copy unless it
        # is fp32 already (megatron keeps some norm weights in fp32)
        expected = sum(
            p.numel() * (p.element_size() + 4 + 8 + (0 if p.dtype == torch.float32 else 4))
            for c in learner.model
            for p in c.parameters()
        )
        assert owned >= expected
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        learner.offload()
        assert learner.offloaded
        assert allocated - torch.cuda.memory_allocated() >= owned
        with pytest.raises(RuntimeError, match="reload"):
            learner.forward(batch)
        learner.offload()  # idempotent
        learner.reload()
        after = _snapshot(learner)
        assert after.keys() == before.keys()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, changed[:5]
        assert torch.equal(learner.forward(batch)["logprobs"], logp)
        # Training goes on from the restored state, through a second offload cycle too.
        learner.train_step(batch, grpo_loss(batch))
        learner.offload()
        learner.reload()
        learner.train_step(batch, grpo_loss(batch))
    finally:
        learner.close()


def test_optimizer_state_exists_before_the_first_step(one_rank, hf_moe):
    """The sampler sizes itself after the learner's steady-state footprint: Adam's moments are created
    by `init_optimizer_state`, not at the first step, and the first step then allocates no more state."""
    learner = _learner(hf_moe, one_rank, distributed_optimizer=True)
    try:
        learner.init_optimizer_state()
        owned = _owned_cuda_bytes(learner)
        state = [
            v
            for sub in getattr(learner.optimizer, "chained_optimizers", None) or [learner.optimizer]
            for st in sub.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.is_cuda
        ]
        assert state and all(torch.count_nonzero(v) == 0 for v in state)
        batch = _batch(1024)
        learner.train_step(batch, grpo_loss(batch))
        assert _owned_cuda_bytes(learner) == owned
    finally:
        learner.close()
