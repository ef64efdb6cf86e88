"""The step's data plane on 4 gloo ranks: meshes DP4, DP2 x TP2 and DP1 x TP4, 1 or 2 engine owners, a
batch of 48 rows with MoE routes. Each rank records the global ids of the rows it received, a digest
of their tokens, logprobs and routes, what the plan says it should hold, and its bytes received."""

from __future__ import annotations

from pathlib import Path

import torch

from megagrpo.learner.mesh import DistEnv, MeshConfig, destroy_mesh, init_mesh
from megagrpo.rollout import Completion
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import EngineGroups
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer.rows import distribute_rows
from tests.dist._common import write_json

N_GROUPS, G, LAYERS, TOPK = 12, 4, 3, 2


def make_group(pos: int) -> PromptGroup:
    """Group `pos`, a deterministic function of its position (every engine count builds the same one)."""
    gen = torch.Generator().manual_seed(pos)
    prompt = torch.randint(0, 50, (3 + pos % 4,), generator=gen)
    comps = []
    for g in range(G):
        n_out = 2 + (pos * G + g) * 7 % 23
        out = torch.randint(0, 50, (n_out,), generator=gen)
        n = prompt.numel() + n_out
        routes = torch.randint(0, 8, (n, LAYERS, TOPK), generator=gen, dtype=torch.int32)
        comps.append(
            Completion(pos, g, prompt, out, -torch.rand(n_out, generator=gen), "length" if g == 0 else "stop",
                       "decoded text the learner never needs " * 20, routes)
        )  # fmt: skip
    return PromptGroup(prompt.tolist(), completions=comps, per_reward=torch.ones(G, 1), position=pos)


def digest(c: Completion) -> float:
    return float(c.output_ids.sum() * 3 + c.prompt_ids.sum() + c.logprobs.sum() + c.routes.sum() * 0.5)


def main(rank: int, world: int, outdir: Path) -> None:
    env = DistEnv.from_environ()
    results = {}
    for tp in (1, 2, 4):
        m = init_mesh(MeshConfig(tp=tp), env, seed=1)
        for n_engines in (1, 2):
            engines = EngineGroups.current(n_engines)
            share = engines.share(N_GROUPS)
            prompts = [make_group(p) for p in share]
            dyn = DynamicBatch(
                groups=[p.completions for p in prompts], rewards=torch.zeros(N_GROUPS, G),
                prompts=prompts, positions=list(share),
            )  # fmt: skip
            rows = distribute_rows(engines, m, dyn, G, num_mini_batches=2, micro_batch_size=2)
            want = {int(i): digest(make_group(int(i) // G).completions[int(i) % G]) for i in rows.local}
            results[f"dp{m.dp}_e{n_engines}"] = dict(
                dp_rank=m.dp_rank,
                local=rows.local.tolist(),
                plan_local=rows.plan.local_rows(m.dp_rank).tolist(),
                got=[digest(c) for c in rows.completions],
                want=[want[int(i)] for i in rows.local],
                texts=sorted({c.text for c in rows.completions}),
                bytes=rows.bytes_received,
                seq_lens=rows.seq_lens.tolist(),
                truncated=rows.truncated.tolist(),
            )
        destroy_mesh()
    write_json(outdir / f"rank{rank}.json", results)
