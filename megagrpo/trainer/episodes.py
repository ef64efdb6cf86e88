"""Multi-turn sampling in the trainer (`rollout.multi_turn`): an engine's share of prompt groups ->
trajectories, each as one learner row (`Trajectory.to_completion`), their rewards and their counters. An
agent session that branched adds a row per other branch (`episode_rows`, `PromptGroup.branches`): the
session keeps one reward, and each of its rows gets the session's advantage (`trainer.rows`).

Everything downstream of sampling (dynamic sampling, the data plane, packing, PP route slices, TIS/MIS,
GSPO, replay) sees a trajectory as a completion whose output is every token after the prompt, with
`output_mask` on the model's tokens: "sequence level" means its model tokens because the loss mask says so.

Rewards. `rollout.multi_turn.reward: environment` takes the environment's last reward, or an agent's return
with `rollout.multi_turn.agent` (an episode it did not score, e.g. a truncated one, gets 0 and is counted as
unscored); `functions` scores the final assistant message with `rewards.functions`, like a single-turn
completion.

Tools. All the trajectories of one engine owner share one bound on their running tool calls
(`rollout.multi_turn.max_concurrent_tools`, `envs.tools.ToolSlots`): each environment's executor is given
the owner's slots. Host cost per owner: at most that many tool threads and, for the python tool, that many
sandboxes at once (`envs.python_tool` module doc: processes, memory, files of one).

Sandbox. `check_multi_turn` probes the code sandbox of an environment that has one (`sandbox_config`)
once per process, at the CLI and on each owner before its first rollout: `rollout.multi_turn.
sandbox_isolation` decides whether what it cannot enforce stops the run. A trajectory whose tool call was
interrupted from outside (`envs.tools.ToolInterrupted`) is dropped: its row takes no loss (its model mask is
cleared, as the overlong filter clears a row); its reward, 0, stays in its group's baseline.

Counters (`MultiTurnStats.counts`) ride with the reward error counts: they are summed over engines and rounds
each step (`Session._reward_counts`), over every generated trajectory, kept by dynamic sampling or not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from megagrpo.config.schema import MultiTurnConfig
from megagrpo.data.sources import RowError
from megagrpo.envs.registry import build_environment, resolve_environment
from megagrpo.envs.sandbox import SandboxConfig, require_isolation
from megagrpo.envs.tools import ToolExecutor, ToolSlots
from megagrpo.rollout.completion import Completion
from megagrpo.rollout.episodes.multi_turn import (
    Episode,
    MultiTurnLimits,
    MultiTurnStats,
    Version,
    rollout_episodes,
)
from megagrpo.rollout.episodes.reasoning import check_reasoning_parser
from megagrpo.rollout.episodes.tool_calls import check_parser_name
from megagrpo.rollout.episodes.trajectory import Trajectory
from megagrpo.rollout.prompt_group import PromptGroup

FIELD = "rollout.multi_turn"
log = logging.getLogger(__name__)


def check_multi_turn(mt: MultiTurnConfig) -> None:
    """MegagrpoError naming the field for an environment that cannot be imported or built with its options,
    an agent that cannot be imported or called with its options (or a command not on PATH), a tool or
    reasoning parser SGLang lacks, or a code sandbox that cannot isolate on this host while
    `sandbox_isolation` is require (best_effort: one warning line). Run by the CLI before any process
    starts, and by each engine owner before its first rollout (the sandbox runs on the owner's host)."""
    if not mt.enabled:
        return
    check_parser_name(mt.tool_parser, where=f"{FIELD}.tool_parser")
    check_reasoning_parser(mt.reasoning_parser, where=f"{FIELD}.reasoning_parser")
    if mt.agent.enabled:
        agent_runner(mt)  # imports the user's agent and checks its signature, or finds its command
        return
    env = build_environment(mt.environment, mt.environment_options, where=f"{FIELD}.environment")
    sandbox = getattr(env, "sandbox_config", None)
    if isinstance(sandbox, SandboxConfig):
        iso = require_isolation(
            sandbox, mt.sandbox_isolation == "best_effort", where=f"{FIELD}.sandbox_isolation"
        )
        if iso.missing:
            log.warning(
                "%s; %s.sandbox_isolation is best_effort: each such call is counted "
                "(rollout/sandbox_unisolated_calls)",
                iso.line(),
                FIELD,
            )


def row_check(mt: MultiTurnConfig) -> Callable[[dict], None] | None:
    """The environment's check of one data row (`check_row`, envs.base), raising `RowError`, so that a row
    it rejects follows `data.malformed` when the data is loaded (file:line, skipped and counted, or an error)
    instead of stopping the run when a step draws it; None without multi-turn or a check."""
    if not mt.enabled or mt.agent.enabled:  # an agent reads its rows itself
        return None
    env = build_environment(mt.environment, mt.environment_options, where=f"{FIELD}.environment")
    check = getattr(env, "check_row", None)
    if check is None:
        return None

    def run(sample: dict) -> None:
        try:
            check(dict(sample))
        except ValueError as e:  # the protocol's way to reject a row
            raise RowError(str(e)) from None

    return run


def agent_runner(mt: MultiTurnConfig):
    """The configured agent (`rollout.agents.endpoint.AgentRunner`), checked; imported only when one is set."""
    from megagrpo.rollout.agents.endpoint import AgentRunner

    a = mt.agent
    return AgentRunner(a.function, a.command, a.options, a.env)


def episode_completion(e: Episode, trajectory: Trajectory | None = None) -> Completion:
    """One episode as a learner row; "length" marks a truncated one (`algo.overlong_filter` drops it). An
    episode with an interrupted tool call, or an agent session that failed under `agent.on_failure: drop`,
    is dropped: its row keeps its tokens and takes no loss. `trajectory`: another branch of the episode's
    session (`Episode.earlier`), made a row by the same rules: truncation and dropping belong to the
    session, so every row of it follows them; only the session's own row carries the final text."""
    t = e.trajectory if trajectory is None else trajectory
    text = e.final_text if trajectory is None else ""
    c = t.to_completion(text=text, finish_reason="length" if e.truncated else "stop")
    if (e.tools.interrupted_calls or e.dropped) and c.output_mask is not None:
        c.output_mask = torch.zeros_like(c.output_mask)
    return c


def episode_rows(e: Episode) -> list[Completion]:
    """The rows of an episode's other branches (`Episode.earlier`, empty for the driver's episodes), in
    the order opened; its own row is `episode_completion(e)`."""
    return [episode_completion(e, t) for t in e.earlier]


class EpisodeSampler:
    """The multi-turn replacement of `RolloutEngine.generate` for one engine owner: the environment driver
    (`rollout.multi_turn`), or an external agent's sessions (`rollout.agents.endpoint`) when
    `rollout.multi_turn.agent` names one."""

    def __init__(self, mt: MultiTurnConfig, template_kwargs: dict | None = None) -> None:
        self.cfg = mt
        self.template_kwargs = dict(template_kwargs or {})  # model.chat_template_kwargs
        check_multi_turn(mt)
        self.agent = agent_runner(mt) if mt.agent.enabled else None
        self.env_cls = (
            None if self.agent else resolve_environment(mt.environment, where=f"{FIELD}.environment")
        )
        self.limits = MultiTurnLimits(max_turns=mt.max_turns, max_tokens=mt.max_tokens)
        self.tool_slots = ToolSlots(mt.max_concurrent_tools)  # this owner's, shared by its trajectories

    def make_env(self):
        env = self.env_cls(**self.cfg.environment_options)
        executor = getattr(env, "executor", None)  # a ToolEnvironment's
        if isinstance(executor, ToolExecutor):
            executor.slots = self.tool_slots
        return env

    def generate(
        self,
        engine,
        prompts: Sequence[PromptGroup],
        sampling,
        group_size: int,
        index_offset: int,
        version: Version,
    ) -> list[list[Completion]]:
        """G trajectories per prompt group, started by the environment from the group's data row; sets each
        group's completions, environment rewards and counters."""
        common = dict(
            tool_parser=self.cfg.tool_parser,
            reasoning_parser=self.cfg.reasoning_parser,
            template_kwargs=self.template_kwargs,
            group_size=group_size,
            index_offset=index_offset,
            version=version,
        )
        rows = [p.sample for p in prompts]
        if self.agent is not None:
            from megagrpo.rollout.agents.endpoint import EndpointOptions, rollout_sessions

            a = self.cfg.agent
            opts = EndpointOptions(
                a.timeout_s, a.on_failure, a.on_departure, a.host, a.max_branches, a.max_concurrent
            )
            episodes, _ = rollout_sessions(
                engine, rows, self.agent, sampling, self.limits, options=opts, **common
            )
        else:
            episodes, _ = rollout_episodes(engine, rows, self.make_env, sampling, self.limits, **common)
        out = []
        for p, eps in zip(prompts, episodes, strict=True):
            p.completions = [episode_completion(e) for e in eps]
            extra = [episode_rows(e) for e in eps]
            p.branches = extra if any(extra) else None
            p.env_rewards = [e.reward for e in eps]
            stats = MultiTurnStats()
            for e in eps:
                stats.add(e)
            p.turn_stats = stats
            out.append(p.completions)
        return out

    def environment_rewards(self, prompts: Sequence[PromptGroup]) -> torch.Tensor:
        """float32 `[n, G]`: each trajectory's environment reward, 0 where it gave none."""
        return torch.tensor(
            [[0.0 if r is None else float(r) for r in p.env_rewards] for p in prompts], dtype=torch.float32
        )

    @staticmethod
    def counts(prompts: Sequence[PromptGroup]) -> dict[str, float]:
        """The groups' counters summed, as `MultiTurnStats.counts` entries."""
        total: dict[str, float] = {}
        for p in prompts:
            for k, v in (p.turn_stats.counts() if p.turn_stats is not None else {}).items():
                total[k] = total.get(k, 0.0) + v
        return total


def multi_turn_metrics(counts: dict[str, float]) -> dict[str, float]:
    """The step's `rollout/` multi-turn metrics from counts summed over engines (empty without any)."""
    stats = MultiTurnStats.from_counts(counts)
    return stats.metrics() if stats.trajectories else {}
