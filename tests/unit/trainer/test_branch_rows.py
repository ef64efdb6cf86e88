"""Agent sessions that branched (issue 38): every branch is a learner row, the group's advantages are its
G sessions', as without branching, and each row takes its session's advantage. Built through the step's
own data plane (`trainer.rows.distribute_rows`, one process) and batch assembly (`trainer.grpo.
local_batch`), with hand-made rows: session 0 of a group of G = 3 has one extra branch."""

from __future__ import annotations

import types

import pytest
import torch

from megagrpo.algo.advantages import METHODS, group_advantages
from megagrpo.algo.filters import overlong_mask
from megagrpo.algo.kl import kl_penalised_rewards
from megagrpo.config import config_from_dict
from megagrpo.diagnostics.reduce import LocalReducer
from megagrpo.learner.mesh import DistEnv, Mesh, MeshConfig
from megagrpo.rollout.completion import Completion
from megagrpo.rollout.dynamic import DynamicBatch
from megagrpo.rollout.groups import EngineGroups
from megagrpo.rollout.prompt_group import PromptGroup
from megagrpo.trainer.grpo import GRPOTrainer, length_shaped_rewards, local_batch
from megagrpo.trainer.rows import distribute_rows, row_sessions

G = 3


def step_rows(groups: list[PromptGroup], group_size: int = G, **kw):
    """`distribute_rows` of `groups` (kept in this order) in one process: one engine, DP 1."""
    for pos, p in enumerate(groups):
        p.position = pos
    dyn = DynamicBatch(
        groups=[p.completions for p in groups], rewards=torch.zeros(len(groups), group_size),
        prompts=groups, positions=list(range(len(groups))),
    )  # fmt: skip
    mesh = Mesh(MeshConfig(), DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), 1, torch.device("cpu"))
    engines = EngineGroups(world=1, rank=0, num_engines=1)
    return distribute_rows(engines, mesh, dyn, group_size, num_mini_batches=1, micro_batch_size=8, **kw)


def row(prompt: list[int], out: list[int], mask: list[bool], g: int, finish: str = "stop") -> Completion:
    n = len(out)
    return Completion(
        0, g, torch.tensor(prompt), torch.tensor(out), -torch.rand(n), finish, "",
        output_mask=torch.tensor(mask), output_versions=torch.where(torch.tensor(mask), 0, -1),
    )  # fmt: skip


def group(branching: bool, finish0: str = "stop") -> PromptGroup:
    """Session 0's own row (its last branch: a new prompt, one model turn) and, with `branching`, its
    first branch (two model turns around a tool result); sessions 1 and 2 plain."""
    own = [
        row([1, 2, 3, 9, 9], [5, 6], [True, True], 0, finish0),
        row([1, 2, 3], [7, 8, 9, 4], [True, False, False, True], 1),
        row([1, 2, 3], [7], [True], 2),
    ]
    first = row([1, 2, 3], [5, 6, 30, 31, 32, 7], [True, True, False, False, False, True], 0, finish0)
    return PromptGroup([1, 2, 3], completions=own, branches=[[first], [], []] if branching else None)


def test_the_branch_rows_carry_their_session_and_their_masks():
    rows = step_rows([group(True), group(False)])
    assert rows.plan.num_rows == 7 and rows.session.tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert rows.session_response_len.tolist() == [2, 4, 1, 2, 4, 1]  # each session's own row
    by_id = dict(zip(rows.local.tolist(), rows.completions, strict=True))
    assert by_id[0].output_ids.tolist() == [5, 6, 30, 31, 32, 7] and by_id[1].output_ids.tolist() == [5, 6]
    batch = local_batch(rows, torch.zeros(2, G), torch.zeros(2, G), pad_id=0)
    order = rows.local.tolist()
    first, own = order.index(0), order.index(1)
    # the loss is on the engine's outputs only: the tool result of the first branch takes none
    assert batch["input_ids"][first][batch["loss_mask"][first]].tolist() == [5, 6, 7]
    assert batch["input_ids"][own][batch["loss_mask"][own]].tolist() == [5, 6]
    # without branches the rows are exactly the old one-row-per-session layout
    plain = step_rows([group(False)])
    assert plain.session.tolist() == [0, 1, 2] and plain.local.tolist() == [0, 1, 2]


@pytest.mark.parametrize("method", METHODS)
def test_advantages_are_the_sessions_and_every_branch_gets_its_session_s(method):
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 1.0]])
    adv = group_advantages(rewards, method)
    with_branch, without = step_rows([group(True), group(False)]), step_rows([group(False), group(False)])
    got = local_batch(with_branch, adv, rewards, pad_id=0)
    ref = local_batch(without, adv, rewards, pad_id=0)
    by_row = dict(zip(with_branch.local.tolist(), got["advantages"].tolist(), strict=True))
    flat = adv.reshape(-1).tolist()
    assert [by_row[i] for i in range(7)] == [flat[0], flat[0], *flat[1:]]
    ref_by_row = dict(zip(without.local.tolist(), ref["advantages"].tolist(), strict=True))
    assert [ref_by_row[i] for i in range(6)] == flat
    assert got["rewards"][with_branch.local.tolist().index(0)] == rewards[0, 0]
    # length shaping reads each session's own row: the same rewards as without the branch
    so = types.SimpleNamespace(enabled=True, max_len=4, cache_len=2, factor=1.0)
    torch.testing.assert_close(
        length_shaped_rewards(rewards, with_branch.session_response_len, so),
        length_shaped_rewards(rewards, without.session_response_len, so),
    )


def test_a_truncated_session_is_filtered_with_all_its_branches():
    rows = step_rows([group(True, finish0="length")])
    keep = overlong_mask([c.finish_reason for c in rows.completions])
    by_row = dict(zip(rows.local.tolist(), keep.tolist(), strict=True))
    assert [by_row[i] for i in range(4)] == [False, False, True, True]


def test_kl_in_reward_penalises_a_session_by_the_kl_of_all_its_rows():
    cfg = config_from_dict(
        {
            "model": {"hf_path": "m"},
            "rollout": {"group_size": G},
            "algo": {"advantages": "grpo", "kl": {"coef": 0.3, "estimator": "k2", "placement": "reward"}},
        }
    )
    rows = step_rows([group(True)])
    rewards = torch.tensor([[1.0, 0.0, 1.0]])
    batch = local_batch(rows, torch.zeros(1, G), rewards, pad_id=0)
    g = torch.Generator().manual_seed(0)
    T = batch["input_ids"].shape[1]
    batch["old_logp"], batch["ref_logp"] = -torch.rand(4, T, generator=g), -torch.rand(4, T, generator=g)
    _, pen = kl_penalised_rewards(batch["rewards"], batch["old_logp"], batch["ref_logp"], batch["loss_mask"],
                                  0.3, "k2")  # fmt: skip
    sessions = rows.session[rows.local]
    per_session = torch.zeros(G).index_add_(0, sessions, pen)
    want = group_advantages((rewards.reshape(-1) - per_session).view(1, G), "grpo").reshape(-1)
    trainer = types.SimpleNamespace(cfg=cfg, _dp_reducer=LocalReducer)
    m = GRPOTrainer._kl_in_reward(trainer, batch, rows)
    torch.testing.assert_close(batch["advantages"], want[sessions])
    assert m["reward/kl_penalty_mean"] == pytest.approx(float(per_session.mean()))


def test_a_group_must_hold_a_row_of_every_session():
    with pytest.raises(ValueError, match="group 0 has rows of sessions"):
        row_sessions([(0, [(3, 1, False)] * 2, None, [0, 0])], 1, 2)
    with pytest.raises(ValueError, match="no owner published group 1"):
        row_sessions([(0, [(3, 1, False)] * 2, None, None)], 2, 2)
