"""Smoke proof (a) of issue 2: a tiny megatron-core MoE GPTModel, forward+backward, as one full model
(TP1, no communication) and on a TP=2 sequence-parallel mesh; same loss and grads to 1e-6 in fp32."""

from __future__ import annotations

from pathlib import Path

import torch

from megagrpo.compat import HITS
from megagrpo.learner.mesh import DistEnv, MeshConfig, destroy_mesh, init_mesh
from megagrpo.learner.model import build_gpt_model, wrap_ddp
from tests.dist._common import (
    TINY_MOE,
    load_params,
    local_values,
    max_abs_diff,
    read_as_local,
    save_params,
    write_json,
)


def _loss(model, batch) -> torch.Tensor:
    ids = batch["input_ids"]
    B, T = ids.shape
    labels = torch.roll(ids, -1, dims=1)
    per_token = model(ids, torch.arange(T).expand(B, T), None, labels=labels)  # [B, T] vocab-parallel CE
    return per_token[:, :-1].mean()


def main(rank: int, world: int, outdir: Path) -> None:
    env = DistEnv.from_environ()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, TINY_MOE.vocab_size, (4, 16), generator=g)}

    # Reference: the full model in this process (TP1; no DDP, so no cross-rank communication at all).
    init_mesh(MeshConfig(), env, seed=3)
    [ref] = build_gpt_model(TINY_MOE, MeshConfig())
    loss_ref = _loss(ref, batch)
    loss_ref.backward()
    save_params([ref], outdir / "weights")
    save_params([ref], outdir / "grads", source="grad")
    destroy_mesh()

    mesh = MeshConfig(tp=2, sequence_parallel=True)
    init_mesh(mesh, env, seed=4)
    chunks = build_gpt_model(TINY_MOE, mesh)
    load_params(chunks, outdir / "weights")
    [model] = wrap_ddp(chunks, distributed_optimizer=False)
    loss = _loss(model, batch)
    loss.backward()
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([model])
    grads_ref = read_as_local(chunks, outdir / "grads")
    grad_err, where = max_abs_diff(local_values(chunks, source="grad"), grads_ref)
    write_json(
        outdir / f"rank{rank}.json",
        {
            "loss_ref": float(loss_ref),
            "loss_tp2": float(loss),
            "grad_err": grad_err,
            "grad_err_at": where,
            "n_params": len(grads_ref),
            "hits": dict(HITS),
        },
    )
    destroy_mesh()


FAMILIES = {
    "llama": dict(family="llama", tie_embeddings=True),
    "qwen2": dict(family="qwen2", qkv_bias=True),
    "qwen3": dict(family="qwen3", qk_norm=True),
    "mixtral": dict(family="mixtral", num_experts=4, moe_topk=2, moe_ffn_hidden_size=32),
    "qwen3_moe_unnormalised": dict(
        family="qwen3_moe",
        qk_norm=True,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=32,
        moe_renormalize_topk=False,
    ),
    "shared_expert": dict(
        family="qwen3_moe",
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_ffn_hidden_size=48,
        moe_shared_expert_gate=True,
        moe_layer_pattern=(0, 1),
    ),  # fmt: skip
}


def families(rank: int, world: int, outdir: Path) -> dict:
    """Each architecture shape: builds, names its parameters as documented, and TP2(+SP) == TP1 logprobs."""
    import dataclasses

    from megagrpo.learner.forward import RunOptions, forward_logprobs
    from tests.dist._common import make_batch

    env = DistEnv.from_environ()
    batch = make_batch(B=4, T=12, seed=1)
    out = {}
    for name, kw in FAMILIES.items():
        base = dict(num_layers=2, qk_norm=False, num_experts=0, moe_topk=0)
        arch = dataclasses.replace(TINY_MOE, **{**base, **kw})
        init_mesh(MeshConfig(), env, seed=5)
        ref = build_gpt_model(arch, MeshConfig())
        names = sorted(n for n, _ in ref[0].named_parameters())
        save_params(ref, outdir / f"fam_{name}")
        lp_ref = forward_logprobs(ref, batch, RunOptions(vocab_size=arch.vocab_size))["logprobs"]
        destroy_mesh()
        mesh = MeshConfig(tp=2, sequence_parallel=True)
        init_mesh(mesh, env, seed=6)
        chunks = build_gpt_model(arch, mesh)
        load_params(chunks, outdir / f"fam_{name}")
        lp = forward_logprobs(chunks, batch, RunOptions(vocab_size=arch.vocab_size))["logprobs"]
        destroy_mesh()
        out[name] = {
            "names": names,
            "logp_err": float((lp - lp_ref).abs().max()),
            "logp_mean": float(lp_ref.mean()),
        }
    return out


def learner(rank: int, world: int, outdir: Path) -> dict:
    """Learner on TP2+SP with a frozen reference: reference == policy before a step, only the policy moves."""
    from megagrpo.algo.aggregation import loss_normaliser
    from megagrpo.algo.losses import policy_loss
    from megagrpo.learner.learner import Learner, LearnerConfig
    from tests.dist._common import make_batch
    from tests.dist.workers_meshes import build_optimizer

    batch = make_batch(B=4, T=12, seed=2)
    cfg = LearnerConfig(
        mesh=MeshConfig(tp=2, sequence_parallel=True), reference_model=True, num_micro_batches=2
    )
    lrn = Learner(
        TINY_MOE, cfg, optimizer_factory=lambda m: (build_optimizer(m), None), env=DistEnv.from_environ()
    )
    pol0 = lrn.forward(batch)
    ref0 = lrn.forward(batch, reference=True)
    batch["old_logp"] = pol0["logprobs"]
    norm = loss_normaliser(batch["loss_mask"], "token-mean")

    def loss_fn(logp, entropy, mb):
        return policy_loss(
            logp, mb["old_logp"], mb["advantages"], mb["loss_mask"], variant="grpo", clip_low=0.2, clip_high=0.2,
            agg="token-mean", normaliser=norm,
        )  # fmt: skip

    metrics = lrn.train_step(batch, loss_fn)
    pol1 = lrn.forward(batch)
    ref1 = lrn.forward(batch, reference=True)
    # Save after one step, train on, then resume: the resumed learner repeats the second step exactly.
    lrn.save(outdir / "learner_ckpt")
    m2 = lrn.train_step(batch, loss_fn)
    pol2 = lrn.forward(batch)
    lrn.load(outdir / "learner_ckpt")
    resumed_step = lrn.step
    m2b = lrn.train_step(batch, loss_fn)
    pol2b = lrn.forward(batch)
    lrn.close()
    return {
        "resume_logp_err": float((pol2b["logprobs"] - pol2["logprobs"]).abs().max()),
        "resume_loss_err": abs(m2b["loss/total"] - m2["loss/total"]),
        "resumed_step": resumed_step,
        "ref_eq_policy_before": float((pol0["logprobs"] - ref0["logprobs"]).abs().max()),
        "ref_unchanged": float((ref1["logprobs"] - ref0["logprobs"]).abs().max()),
        "policy_moved": float((pol1["logprobs"] - pol0["logprobs"]).abs().max()),
        "metrics": metrics,
    }


def all_checks(rank: int, world: int, outdir: Path) -> None:
    main(rank, world, outdir)
    res = {
        "families": families(rank, world, outdir),
        "learner": learner(rank, world, outdir),
        "routes": routes(rank, world, outdir),
    }
    res["hits_all"] = dict(HITS)
    write_json(outdir / f"extra_rank{rank}.json", res)
    destroy_mesh(process_group=True)


class _RecordRoutes:
    """ForwardHooks that records megatron's RouterReplay top-k per micro-batch and maps every router
    token back to its (sample, position) with layout.router_token_positions."""

    def __init__(self, B: int, T: int, layers: int, topk: int):
        self.routes = torch.full((B, T, layers, topk), -1, dtype=torch.int64)

    def before_forward(self, mb, chunk):
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)

    def after_forward(self, mb, chunk):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from megagrpo.learner import layout

        tp, rank = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
        sample, pos = layout.router_token_positions(
            mb.seq_lens,
            T=None if mb.packed is not None else mb.input_ids.shape[1],
            packed=mb.packed,
            tp_rank=rank,
            sp_size=tp,
        )
        keep = sample >= 0
        for layer, idx in enumerate(RouterReplay.get_recorded_data()):
            self.routes[mb.samples[sample[keep]], pos[keep], layer] = idx[keep].sort(-1).values


def routes(rank: int, world: int, outdir: Path) -> dict:
    """Routes recorded on TP2+SP (packed and padded), mapped back through layout, equal TP1's."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megagrpo.learner.forward import RunOptions, forward_logprobs
    from tests.dist._common import make_batch

    env = DistEnv.from_environ()
    batch = make_batch(B=4, T=12, seed=3)
    B, T = batch["input_ids"].shape
    got = {}
    for name, mesh in (("tp1", MeshConfig()), ("tp2", MeshConfig(tp=2, sequence_parallel=True))):
        RouterReplay.clear_global_router_replay_instances()
        init_mesh(mesh, env, seed=8)
        chunks = build_gpt_model(TINY_MOE, mesh, routing_replay=True)
        if name == "tp1":
            save_params(chunks, outdir / "routes_w")
        else:
            load_params(chunks, outdir / "routes_w")
        for packed in (True, False):
            hook = _RecordRoutes(B, T, TINY_MOE.num_layers, TINY_MOE.moe_topk)
            forward_logprobs(
                chunks,
                batch,
                RunOptions(vocab_size=TINY_MOE.vocab_size, packed=packed, num_micro_batches=2),
                hooks=hook,
            )
            got[f"{name}_{'packed' if packed else 'padded'}"] = hook.routes
        destroy_mesh()
    RouterReplay.clear_global_router_replay_instances()
    valid = torch.arange(T).unsqueeze(0) < batch["seq_lens"].unsqueeze(1)
    cover = {}
    for k, v in got.items():
        # Each rank saw only its DP samples (tp1: DP2) or its sequence shard (tp2+SP): the max over ranks
        # (missing = -1) is the full picture, and partial coverage is measured before merging.
        cover[k] = float(((v[..., 0, 0] >= 0) & valid).sum() / valid.sum())
        torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX)
    ref = got["tp1_padded"]
    return {
        "complete": all(bool((v[valid] >= 0).all()) for v in got.values()),
        "coverage": cover,
        "all_equal": all(torch.equal(v[valid], ref[valid]) for v in got.values()),
        "experts_used": int(ref[valid].unique().numel()),
    }
