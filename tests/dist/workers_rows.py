"""The step's data plane on 4 gloo ranks: meshes DP4, DP2 x TP2, DP1 x TP4, DP2 x PP2 and DP1 x TP2 x PP2,
1 or 2 engine owners, a batch of 48 rows with MoE routes for every model layer (as SGLang returns them;
layer 0 is dense). Each rank records the global ids of the rows it received, a digest of their tokens,
logprobs and the route columns of its pipeline stage, what the plan says it should hold, and its bytes."""

from __future__ import annotations

from pathlib import Path

import torch

from megagrpo.learner.mesh import DistEnv, MeshConfig, destroy_mesh, init_mesh
from megagrpo.rollout import Completion
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import EngineGroups
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer.rows import RouteSlices, distribute_rows
from tests.dist._common import write_json

N_GROUPS, G, LAYERS, TOPK = 12, 4, 5, 2
MOE_LAYERS = (1, 2, 3, 4)
STAGE_LAYERS = {1: [(0, 1, 2, 3)], 2: [(0, 1), (2, 3)]}  # pp -> MoE layers of each stage
MESHES = {"dp4": {}, "dp2": {"tp": 2}, "dp1": {"tp": 4}, "dp2_pp2": {"pp": 2}, "dp1_pp2": {"tp": 2, "pp": 2}}


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


def digest(c: Completion, route_columns: list[int] | None = None) -> float:
    routes = c.routes if route_columns is None else c.routes[:, route_columns]
    return float(c.output_ids.sum() * 3 + c.prompt_ids.sum() + c.logprobs.sum() + routes.float().sum() * 0.5)


def main(rank: int, world: int, outdir: Path) -> None:
    env = DistEnv.from_environ()
    results = {}
    for name, layout in MESHES.items():
        m = init_mesh(MeshConfig(**layout), env, seed=1)
        pp = layout.get("pp", 1)
        slices = RouteSlices(MOE_LAYERS, LAYERS, tuple(STAGE_LAYERS[pp][s] for s in m.pp_ranks))
        cols = slices.columns(rank, LAYERS)
        for n_engines in (1, 2):
            engines = EngineGroups.current(n_engines)
            share = engines.share(N_GROUPS)
            prompts = [make_group(p) for p in share]
            dyn = DynamicBatch(
                groups=[p.completions for p in prompts], rewards=torch.zeros(N_GROUPS, G),
                prompts=prompts, positions=list(share),
            )  # fmt: skip
            rows = distribute_rows(
                engines, m, dyn, G, num_mini_batches=2, micro_batch_size=2, routes=slices
            )  # fmt: skip
            want = {int(i): digest(make_group(int(i) // G).completions[int(i) % G], cols) for i in rows.local}
            results[f"{name}_e{n_engines}"] = dict(
                dp_rank=m.dp_rank,
                pp_rank=m.pp_ranks[rank],
                local=rows.local.tolist(),
                plan_local=rows.plan.local_rows(m.dp_rank).tolist(),
                got=[digest(c) for c in rows.completions],
                want=[want[int(i)] for i in rows.local],
                texts=sorted({c.text for c in rows.completions}),
                route_widths=sorted({int(c.routes.shape[1]) for c in rows.completions}),
                route_layers=rows.route_layers,
                bytes=rows.bytes_received,
                route_bytes=sum(c.routes.nbytes for c in rows.completions),
                seq_lens=rows.seq_lens.tolist(),
                truncated=rows.truncated.tolist(),
            )
        destroy_mesh()
    write_json(outdir / f"rank{rank}.json", results)
