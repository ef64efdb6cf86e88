"""The step's data plane: from the prompt groups that each engine owner kept to the rows that each learner
rank trains on.

1. Every owner publishes a few scalars per row (token count, output length, truncation) and per group
   (per-reward scores); every rank then knows the whole batch's shape without holding a token of it.
2. `RowPlan` decides, from the token counts alone, which rows each DP rank trains on.
3. Each owner sends each row to the leader of the replica that trains on it (`EngineGroups.send_rows`:
   one all-to-all over WORLD), without its decoded text.
4. The leader hands the same bytes to its replica's other ranks (TP, CP and PP peers), within the
   replica's group.

Per-rank cost (B rows of up to T tokens, L MoE layers, top-k K, DP ranks): the rows of its DP rank,
about B/DP x T x (8 + 4 + 4·L·K) bytes with routes, plus O(B) scalars. PP stages still receive every
layer's routes (each stage needs only its own; issue 14 leaves that open).
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass

import torch
from torch import Tensor

from megagrpo.learner.mesh import Mesh
from megagrpo.learner.row_plan import RowPlan
from megagrpo.rollout.completion import Completion
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import EngineGroups, broadcast_bytes


@dataclass
class StepRows:
    plan: RowPlan
    response_len: Tensor  # int64 [B], every row of the batch
    truncated: Tensor  # bool [B]
    per_reward: Tensor | None  # float32 [n, G, R], every kept group (None without reward functions' columns)
    local: Tensor  # int64 [b]: global ids of this rank's rows, in local-batch order
    completions: list[Completion]  # [b] this rank's rows, same order
    bytes_received: int  # this rank's row bytes this step (step 3 or 4 above)

    @property
    def seq_lens(self) -> Tensor:
        return self.plan.seq_lens


def distribute_rows(
    engines: EngineGroups,
    mesh: Mesh,
    dyn: DynamicBatch,
    group_size: int,
    *,
    num_mini_batches: int,
    micro_batch_size: int,
    balance: bool = True,
) -> StepRows:
    """Collective over WORLD (and each replica's group). See the module doc."""
    G, n = group_size, dyn.kept
    B = n * G
    mine = [
        (pos, [(c.num_tokens, c.output_ids.numel(), c.finish_reason == "length") for c in p.completions],
         p.per_reward)
        for pos, p in zip(dyn.positions, dyn.prompts, strict=True)
    ]  # fmt: skip
    seq_lens = torch.zeros(B, dtype=torch.int64)
    response_len = torch.zeros(B, dtype=torch.int64)
    truncated = torch.zeros(B, dtype=torch.bool)
    per_reward: list[Tensor | None] = [None] * n
    for part in engines.gather_from_engines(mine):
        for pos, rows, scores in part or []:
            for g, (tokens, out, trunc) in enumerate(rows):
                i = pos * G + g
                seq_lens[i], response_len[i], truncated[i] = tokens, out, trunc
            per_reward[pos] = scores
    plan = RowPlan.build(
        seq_lens, dp=mesh.dp, num_mini_batches=num_mini_batches, micro_batch_size=micro_batch_size,
        balance=balance,
    )  # fmt: skip
    owned = {
        pos * G + g: dataclasses.replace(c, text="")  # the learner reads tokens, never text
        for pos, p in zip(dyn.positions, dyn.prompts, strict=True)
        for g, c in enumerate(p.completions)
    }
    rows_of = {d: plan.local_rows(d).tolist() for d in range(mesh.dp)}  # once per DP rank, not per rank
    wanted = [rows_of[mesh.dp_ranks[r]] if mesh.leader_of(r) == r else [] for r in range(engines.world)]
    got, received = engines.send_rows(owned, wanted)
    local = plan.local_rows(mesh.dp_rank)
    comps = [got[int(i)] for i in local] if engines.rank == mesh.replica_leader else None
    if mesh.replica is not None:
        payload = pickle.dumps(comps, protocol=pickle.HIGHEST_PROTOCOL) if comps is not None else None
        data = broadcast_bytes(payload, mesh.replica_leader, mesh.replica)
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
    )
