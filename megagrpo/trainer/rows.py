"""The step's data plane: from the prompt groups that each engine owner kept to the rows that each learner
rank trains on.

1. Every owner publishes a few scalars per row (token count, output length, truncation) and per group
   (per-reward scores); every rank then knows the whole batch's shape without holding a token of it.
2. `RowPlan` decides, from the token counts alone, which rows each DP rank trains on.
3. Each owner sends each row to the leader of every pipeline stage of the replica that trains on it
   (`EngineGroups.send_rows`: one all-to-all over WORLD), without its decoded text and with the routes of
   that stage's MoE layers only (`RouteSlices`).
4. The stage leader hands the same bytes to its stage's other ranks (TP and CP peers), within the stage's
   group.

Rows and sessions. A group holds G sessions (samples) and at least G rows: an agent session that branched
trains each of its branches as a row of its own (`PromptGroup.rows`), so B = the sum over groups of their
rows, between n x G and more. Rows are numbered group after group in batch order, session after session
within a group; `StepRows.session` maps each row to its session (position x G + g), whose reward and
advantage it takes. Nothing below step 1 knows about groups: the plan and the exchange see B rows.

Per-rank cost (B rows of up to T tokens, L MoE layers, top-k K, DP ranks, PP stages): the rows of its DP
rank, about B/DP x T x (8 + 4 + 4·K·L/PP) bytes with routes, plus O(B) scalars (with branches, one more
int per row of a group that has any).

Device memory. On GPUs the groups are NCCL, which moves only device buffers, and this runs before the
engine releases its pool. The rows therefore travel in pieces of at most `rollout.groups.WIRE_CHUNK_BYTES`
each way (steps 3 and 4), so the data plane holds two pieces of device memory whatever B x T, and the
gathered scalars of step 1 (world x the largest owner's, about 2 MB at 16 GPUs and B 8192); `megagrpo plan`
counts both in the rollout phase (`plan.memory.rows_wire_bytes`). Why pieces rather than the other two
ways out: gloo would keep the bytes off the device, but moves 26 GB per stage leader (docs/scaling.md's
example) over TCP instead of NVLink and InfiniBand; moving the rows after `engine.release` would put the
whole DP rank's rows on the device beside the learner's reload instead, and reorder the step.

Failures. A row whose routes do not fit the learner's model is found on the owner that sampled it, before
any bytes move, and every rank learns of it there (`dist.agree`): the owner raises the error, the
others name the owner, instead of waiting in the exchange until `dist.timeout_minutes`.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megagrpo.dist.agree import agreed
from megagrpo.errors import MegagrpoError
from megagrpo.learner.mesh import Mesh
from megagrpo.learner.row_plan import RowPlan
from megagrpo.rollout.completion import Completion
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import EngineGroups, broadcast_bytes


@dataclass(frozen=True)
class RouteSlices:
    """Which of the sampler's route columns each rank's pipeline stage needs. The sampler returns one
    column per model layer (SGLang's routed_experts) or per MoE layer; a stage's routers read only its own
    MoE layers, so every other column is bytes that no router of that rank reads."""

    moe_layers: tuple[int, ...]  # model layer index of each MoE layer
    num_layers: int
    stage: tuple[tuple[int, ...], ...]  # per global rank: the MoE-layer indices its routers read
    topk: int | None = None  # experts per token of the learner's routers (None: not checked)

    def columns(self, rank: int, width: int) -> list[int]:
        """The columns of a `[tokens, width, K]` route table that `rank` needs, in MoE-layer order."""
        mine = self.stage[rank]
        if width == len(self.moe_layers):
            return list(mine)
        if width == self.num_layers:
            return [self.moe_layers[i] for i in mine]
        raise MegagrpoError(
            f"the sampler returned routes of {width} layers; the learner's model has {len(self.moe_layers)} "
            f"MoE layers ({self.num_layers} layers in all): the sampler and the learner run different models "
            "(check model.path and the engine's model directory)"
        )

    def check(self, c: Completion) -> None:
        """MegagrpoError naming the row when its routes are not int `[tokens, width, topk]` for the learner's
        model (O(1): shapes only; the expert ids are checked where replay reads them)."""
        r = c.routes
        if r is None:
            return
        where = f"the routes of prompt {c.prompt_index} sample {c.sample_index}"
        if r.dim() != 3 or r.dtype.is_floating_point or int(r.shape[0]) != c.num_tokens:
            raise MegagrpoError(
                f"{where} are {r.dtype} {tuple(r.shape)}; expected int [{c.num_tokens} tokens, layers, topk] "
                "(the engine's routed_experts, decoded by rollout.completion)"
            )
        if self.topk is not None and int(r.shape[2]) != self.topk:
            raise MegagrpoError(
                f"{where} have top-k {int(r.shape[2])}; the learner's model routes each token to "
                f"{self.topk} experts: the sampler and the learner run different models"
            )
        try:
            self.columns(0, int(r.shape[1]))
        except MegagrpoError as e:
            raise MegagrpoError(f"{where}: {e}") from None

    def slice(self, rank: int, c: Completion) -> Completion:
        """`c` as `rank` receives it: no decoded text, only its stage's route columns."""
        routes = c.routes
        if routes is not None:
            routes = routes[:, self.columns(rank, int(routes.shape[1]))].contiguous()
        return dataclasses.replace(c, text="", routes=routes)


def route_slices(learner) -> RouteSlices | None:
    """Every rank's route columns (one small object gather over WORLD, once per run); None for a dense
    model. Read from the router taps, so any split of layers over stages and virtual chunks is right."""
    from megagrpo.moe.routers import router_taps

    if not learner.arch.is_moe:
        return None
    taps = router_taps(learner)  # a stage of dense layers only (uneven stages) has none: its columns are ()
    mine = tuple(sorted({s.moe for s in taps.slots}))
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    return RouteSlices(
        tuple(taps.moe_layers), int(taps.config.num_layers), tuple(tuple(x) for x in every), int(taps.topk)
    )


@dataclass
class StepRows:
    plan: RowPlan
    response_len: Tensor  # int64 [B], every row of the batch
    truncated: Tensor  # bool [B]
    per_reward: Tensor | None  # float32 [n, G, R], every kept group (None without reward functions' columns)
    local: Tensor  # int64 [b]: global ids of this rank's rows, in local-batch order
    completions: list[Completion]  # [b] this rank's rows, same order
    bytes_received: int  # this rank's row bytes this step (step 3 or 4 above)
    session: Tensor  # int64 [B]: each row's session, position x G + g (module doc: rows and sessions)
    session_response_len: Tensor  # int64 [n x G]: each session's own row's output length
    route_layers: list[int] | None = None  # MoE-layer index of each route column; None = every MoE layer

    @property
    def seq_lens(self) -> Tensor:
        return self.plan.seq_lens


def row_scalars(dyn: DynamicBatch) -> list:
    """Step 1's payload of this rank: per kept group its position, (tokens, output length, truncated)
    per row, its per-reward scores, and each row's session g (None when the group has one row per
    session, as every group without a branching agent session has)."""
    out = []
    for pos, p in zip(dyn.positions, dyn.prompts, strict=True):
        rows = p.rows()
        scalars = [(c.num_tokens, c.output_ids.numel(), c.finish_reason == "length") for _, c in rows]
        out.append((pos, scalars, p.per_reward, [g for g, _ in rows] if p.branches else None))
    return out


def row_sessions(
    parts: list[tuple[int, list, object, list[int] | None]], n: int, group_size: int
) -> tuple[Tensor, list[int]]:
    """(int64 `[B]` session of every row, the first row id of each group) from every owner's `row_scalars`
    (module doc: rows and sessions). Host cost O(B)."""
    G = group_size
    counts = [-1] * n
    for pos, rows, _, sessions in parts:
        counts[pos] = len(rows)
        if (sessions is None and len(rows) != G) or (
            sessions is not None and sorted(set(sessions)) != list(range(G))
        ):
            raise ValueError(f"group {pos} has rows of sessions {sessions} for {G} sessions")
    if min(counts, default=0) < 0:
        raise ValueError(f"no owner published group {counts.index(-1)} of {n}")
    first = [0] * n
    for pos in range(1, n):
        first[pos] = first[pos - 1] + counts[pos - 1]
    session = torch.empty(sum(counts), dtype=torch.int64)
    for pos, rows, _, sessions in parts:
        g = torch.arange(G) if sessions is None else torch.tensor(sessions, dtype=torch.int64)
        session[first[pos] : first[pos] + len(rows)] = pos * G + g
    return session, first


def distribute_rows(
    engines: EngineGroups,
    mesh: Mesh,
    dyn: DynamicBatch,
    group_size: int,
    *,
    num_mini_batches: int,
    micro_batch_size: int,
    balance: bool = True,
    routes: RouteSlices | None = None,
) -> StepRows:
    """Collective over WORLD (and each stage's group). See the module doc. Without `routes`, every rank
    receives every route column the sampler returned. Raises on every rank when an owner holds a row
    whose routes do not fit (`RouteSlices.check`): that owner its MegagrpoError, the others `PeerFailed`."""
    G, n = group_size, dyn.kept
    parts = [x for part in engines.gather_from_engines(row_scalars(dyn)) for x in part or []]
    session, first = row_sessions(parts, n, G)
    B = int(session.numel())
    seq_lens = torch.zeros(B, dtype=torch.int64)
    response_len = torch.zeros(B, dtype=torch.int64)
    truncated = torch.zeros(B, dtype=torch.bool)
    per_reward: list[Tensor | None] = [None] * n
    for pos, rows, scores, _ in parts:
        for j, (tokens, out, trunc) in enumerate(rows):
            i = first[pos] + j
            seq_lens[i], response_len[i], truncated[i] = tokens, out, trunc
        per_reward[pos] = scores
    # a session's own row comes after its other branches (`PromptGroup.rows`): its highest row id
    own = torch.zeros(n * G, dtype=torch.int64).scatter_reduce(0, session, torch.arange(B), "amax")
    session_response_len = response_len[own]
    plan = RowPlan.build(
        seq_lens, dp=mesh.dp, num_mini_batches=num_mini_batches, micro_batch_size=micro_batch_size,
        balance=balance,
    )  # fmt: skip
    owned = {
        first[pos] + j: c
        for pos, p in zip(dyn.positions, dyn.prompts, strict=True)
        for j, (_, c) in enumerate(p.rows())
    }
    if routes is not None:  # an MoE model (on every rank): a bad row stops every rank before the exchange
        with agreed("the step's rows (a sampled row's routes do not fit the learner's model)"):
            for c in owned.values():
                routes.check(c)
    rows_of = {d: plan.local_rows(d).tolist() for d in range(mesh.dp)}  # once per DP rank, not per rank
    leaders = set(mesh.stage_leaders().values())
    wanted = [rows_of[mesh.dp_ranks[r]] if r in leaders else [] for r in range(engines.world)]
    got, received = engines.send_rows(
        owned, wanted, routes.slice if routes is not None else lambda _, c: dataclasses.replace(c, text="")
    )
    local = plan.local_rows(mesh.dp_rank)
    comps = [got[int(i)] for i in local] if engines.rank == mesh.stage_leader else None
    if mesh.stage is not None:
        payload = pickle.dumps(comps, protocol=pickle.HIGHEST_PROTOCOL) if comps is not None else None
        data = broadcast_bytes(payload, mesh.stage_leader, mesh.stage)
        if comps is None:
            comps, received = pickle.loads(data), len(data)
    scores = per_reward if all(s is not None for s in per_reward) else None
    return StepRows(
        plan=plan,
        response_len=response_len,
        truncated=truncated,
        per_reward=torch.stack(scores) if scores else None,
        local=local,
        completions=comps,
        bytes_received=received,
        session=session,
        session_response_len=session_response_len,
        route_layers=list(routes.stage[engines.rank]) if routes is not None else None,
    )
