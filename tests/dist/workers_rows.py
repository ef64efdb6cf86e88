"""The step's data plane on 4 gloo ranks: meshes DP4, DP2 x TP2, DP1 x TP4, DP2 x PP2 and DP1 x TP2 x PP2,
1 or 2 engine owners, a batch of 50 rows (48 sessions, two of which branched) with MoE routes for every model layer (as SGLang returns them;
layer 0 is dense). Each rank records the global ids of the rows it received, a digest of their tokens,
logprobs and the route columns of its pipeline stage, what the plan says it should hold, and its bytes.
Then (issue 25) two meshes again with the wire cut into 4 KiB pieces, recording the largest byte buffer
any collective got; and a row with routes of the wrong width on engine 1's owner, recording what each
rank raised and how long it took."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megagrpo.learner.mesh import DistEnv, MeshConfig, destroy_mesh, init_mesh
from megagrpo.rollout import Completion
from megagrpo.rollout import groups as groups_mod
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import EngineGroups
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer.rows import RouteSlices, distribute_rows
from tests.dist._common import write_json

N_GROUPS, G, LAYERS, TOPK = 12, 4, 5, 2
MOE_LAYERS = (1, 2, 3, 4)
STAGE_LAYERS = {1: [(0, 1, 2, 3)], 2: [(0, 1), (2, 3)]}  # pp -> MoE layers of each stage
MESHES = {"dp4": {}, "dp2": {"tp": 2}, "dp1": {"tp": 4}, "dp2_pp2": {"pp": 2}, "dp1_pp2": {"tp": 2, "pp": 2}}
CHUNKED = ("dp2", "dp1_pp2")  # a stage broadcast within TP peers, and both pipeline stages' leaders
CHUNK = 4096
TIMEOUT_S = 120  # the process groups' timeout: a rank left waiting would wait this long


BRANCHING = (1, 7)  # groups whose session 2 branched once (issue 38): a row more, one on each engine's share


def make_group(pos: int) -> PromptGroup:
    """Group `pos`, a deterministic function of its position (every engine count builds the same one); the
    groups of `BRANCHING` hold a fifth row, session 2's other branch."""
    gen = torch.Generator().manual_seed(pos)
    prompt = torch.randint(0, 50, (3 + pos % 4,), generator=gen)
    comps = []
    for g in range(G + (pos in BRANCHING)):
        n_out = 2 + (pos * G + g) * 7 % 23
        out = torch.randint(0, 50, (n_out,), generator=gen)
        n = prompt.numel() + n_out
        routes = torch.randint(0, 8, (n, LAYERS, TOPK), generator=gen, dtype=torch.int32)
        comps.append(
            Completion(pos, g, prompt, out, -torch.rand(n_out, generator=gen), "length" if g == 0 else "stop",
                       "decoded text the learner never needs " * 20, routes)
        )  # fmt: skip
    branches = [[], [], [comps.pop()], []] if pos in BRANCHING else None
    return PromptGroup(
        prompt.tolist(), completions=comps, per_reward=torch.ones(G, 1), position=pos, branches=branches
    )


def all_rows() -> list[Completion]:
    """Every row of the batch in its global order (`trainer.rows`: group after group, session after session)."""
    return [c for pos in range(N_GROUPS) for _, c in make_group(pos).rows()]


def digest(c: Completion, route_columns: list[int] | None = None) -> float:
    routes = c.routes if route_columns is None else c.routes[:, route_columns]
    return float(c.output_ids.sum() * 3 + c.prompt_ids.sum() + c.logprobs.sum() + routes.float().sum() * 0.5)


def step_rows(rank: int, name: str, m, n_engines: int, *, bad_route: bool = False) -> dict:
    """One `distribute_rows` on mesh `m` and what this rank received. `bad_route`: engine 1's owner holds
    a row whose routes have 3 layers (the model has 5, 4 of them MoE)."""
    pp = MESHES[name].get("pp", 1)
    slices = RouteSlices(MOE_LAYERS, LAYERS, tuple(STAGE_LAYERS[pp][s] for s in m.pp_ranks), TOPK)
    cols = slices.columns(rank, LAYERS)
    engines = EngineGroups.current(n_engines)
    share = engines.share(N_GROUPS)
    prompts = [make_group(p) for p in share]
    if bad_route and engines.engine == 1:
        c = prompts[0].completions[1]
        c.routes = c.routes[:, :3]
    dyn = DynamicBatch(
        groups=[p.completions for p in prompts], rewards=torch.zeros(N_GROUPS, G),
        prompts=prompts, positions=list(share),
    )  # fmt: skip
    rows = distribute_rows(engines, m, dyn, G, num_mini_batches=2, micro_batch_size=2, routes=slices)
    every = all_rows()
    want = {int(i): digest(every[int(i)], cols) for i in rows.local}
    return dict(
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
        session=rows.session.tolist(),
    )


@contextlib.contextmanager
def wire_in_pieces(chunk: int, largest: list[int]):
    """The data plane's pieces cut to `chunk` bytes; `largest[0]` the most bytes of one uint8 buffer that
    a collective moved (sizes and flags are int64, not counted)."""
    real = dist.all_to_all_single, dist.broadcast

    def note(*tensors):
        for t in tensors:
            if torch.is_tensor(t) and t.dtype == torch.uint8:
                largest[0] = max(largest[0], t.numel())

    def all_to_all_single(out, inp, *a, **k):
        note(out, inp)
        return real[0](out, inp, *a, **k)

    def broadcast(t, *a, **k):
        note(t)
        return real[1](t, *a, **k)

    groups_mod.WIRE_CHUNK_BYTES, before = chunk, groups_mod.WIRE_CHUNK_BYTES
    dist.all_to_all_single, dist.broadcast = all_to_all_single, broadcast
    try:
        yield
    finally:
        groups_mod.WIRE_CHUNK_BYTES = before
        dist.all_to_all_single, dist.broadcast = real


def main(rank: int, world: int, outdir: Path) -> None:
    env = DistEnv.from_environ()
    results = {}
    for name, layout in MESHES.items():
        m = init_mesh(MeshConfig(**layout), env, seed=1, timeout_s=TIMEOUT_S)
        for n_engines in (1, 2):
            results[f"{name}_e{n_engines}"] = step_rows(rank, name, m, n_engines)
        if name in CHUNKED:
            largest = [0]
            with wire_in_pieces(CHUNK, largest):
                results[f"{name}_e2_chunked"] = {**step_rows(rank, name, m, 2), "largest_wire": largest[0]}
            largest = [0]
            with wire_in_pieces(1 << 30, largest):  # one piece per pair: the size of the rows
                step_rows(rank, name, m, 2)
            results[f"{name}_e2"]["largest_wire"] = largest[0]
        destroy_mesh()
    # last: one owner's bad row must stop every rank at once, not leave three of them in the exchange
    m = init_mesh(MeshConfig(), env, seed=1, timeout_s=TIMEOUT_S)
    t0 = time.perf_counter()
    try:
        step_rows(rank, "dp4", m, 2, bad_route=True)
        results["bad_route"] = {"error": None}
    except Exception as e:
        results["bad_route"] = {"error": type(e).__name__, "message": str(e)}
    results["bad_route"]["seconds"] = time.perf_counter() - t0
    destroy_mesh()
    write_json(outdir / f"rank{rank}.json", results)
