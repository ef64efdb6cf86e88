"""Distributed bring-up check for a new cluster or launcher:

    python -m megagrpo.launch.mesh_check --out R.json [--tp N --ep N --pp N --model HF_DIR]
    python launch/mesh_check.py ...   (the same)

Run it under the launcher a training job would use (torchrun, srun, mpirun, or an sbatch script from
slurm/). Every rank takes its rank/world/local rank through `DistEnv.from_environ()` (the one launcher
path; `MEGAGRPO_BOOTSTRAP=mpi4py` asks for mpi4py), builds the mesh (`--tp`, `--ep`, `--pp`) and checks:
  * the collective works: an all-reduce of the ranks equals world*(world-1)/2 on every rank;
  * megatron's TP/EP/DP group sizes are those the mesh asks for;
  * with `--model HF_DIR`: the learner's per-token logprobs on a fixed batch, computed on the sharded
    mesh, equal the single-process transformers reference within `--atol` (fp32).
Rank 0 writes the result (ranks with their hosts and node ids, group sizes, the logprob error, `ok`) as
JSON to `--out`; the exit status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path


def fixed_batch(vocab: int, B: int = 4, T: int = 24, seed: int = 0):
    """`input_ids [B, T]` (right-padded with 0) and `seq_lens [B]`, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    seq_lens = torch.tensor([T, T - 5, T - 9, T - 2][:B])
    ids[torch.arange(T).unsqueeze(0) >= seq_lens.unsqueeze(1)] = 0
    return {"input_ids": ids, "seq_lens": seq_lens}


def reference_logprobs(model_dir: str, batch) -> object:
    """Single-process transformers logprobs `[B, T]`: column t holds log p(ids[t] | ids[:t]); 0 elsewhere.

    Must run before the CPU compatibility patches (transformers' modeling code does not import after).
    """
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ids, lens = batch["input_ids"], batch["seq_lens"]
    with torch.no_grad():
        logits = hf.eval()(ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros_like(ids, dtype=torch.float32)
    out[:, 1:] = logp
    valid = torch.arange(ids.shape[1]).unsqueeze(0) < lens.unsqueeze(1)
    valid[:, 0] = False
    return out * valid, valid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result JSON (written by rank 0)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--first-stage-layers", type=int, default=None, help="as mesh.first_stage_layers")
    p.add_argument("--last-stage-layers", type=int, default=None, help="as mesh.last_stage_layers")
    p.add_argument("--model", default=None, help="HF directory: also check the learner's logprobs")
    p.add_argument("--atol", type=float, default=1e-4)
    a = p.parse_args(argv)

    from megagrpo.learner.mesh import DistEnv

    env = DistEnv.from_environ()
    ref = batch = None
    if a.model:
        from megagrpo.bridge.hf_config import arch_from_hf

        arch = arch_from_hf(a.model)
        batch = fixed_batch(arch.vocab_size)
        ref = reference_logprobs(a.model, batch)

    import torch
    import torch.distributed as dist

    from megagrpo.compat import apply_cpu_compat
    from megagrpo.learner.mesh import MeshConfig, destroy_mesh, init_mesh

    apply_cpu_compat(megatron=True, sglang=False)
    # Sequence parallelism wherever TP: legal for every layout and required with EP (config.mesh_rules,
    # which MeshConfig.validate applies before any group is built).
    mesh_cfg = MeshConfig(
        tp=a.tp, ep=a.ep, pp=a.pp, sequence_parallel=a.tp > 1,
        first_stage_layers=a.first_stage_layers, last_stage_layers=a.last_stage_layers,
    )  # fmt: skip
    result: dict = {"launcher": env.launcher, "world": env.world_size, "tp": a.tp, "ep": a.ep, "pp": a.pp}
    if a.model:
        from megagrpo.learner.learner import Learner, LearnerConfig
        from megagrpo.trainer.weights import load_hf_into_learner

        learner = Learner(arch, LearnerConfig(mesh=mesh_cfg), env=env)
        load_hf_into_learner(learner, a.model)
        got = learner.forward(batch, with_entropy=False)["logprobs"].cpu()
        want, valid = ref
        result["logprob_max_abs_diff"] = float(((got - want).abs() * valid).max())
        result["logprob_tokens"] = int(valid.sum())
    else:
        init_mesh(mesh_cfg, env)

    from megatron.core import parallel_state as ps

    total = torch.tensor([float(env.rank)])
    dist.all_reduce(total)
    me = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "node_rank": env.node_rank,
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "pid": os.getpid(),
        "sum_ok": float(total) == env.world_size * (env.world_size - 1) / 2,
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_size": ps.get_data_parallel_world_size(),
    }
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, me)
    result["ranks"] = ranks
    checks = {
        "all_reduce": all(r["sum_ok"] for r in ranks),
        "group_sizes": all((r["tp_size"], r["ep_size"], r["pp_size"]) == (a.tp, a.ep, a.pp) for r in ranks),
        "ranks": sorted(r["rank"] for r in ranks) == list(range(env.world_size)),
    }
    if a.model:
        checks["logprobs"] = result["logprob_max_abs_diff"] <= a.atol
    result["checks"] = checks
    result["ok"] = all(checks.values())
    if env.rank == 0:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
        print(f"mesh check: {'ok' if result['ok'] else 'FAILED'} {json.dumps(checks)}", flush=True)
    destroy_mesh(process_group=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
