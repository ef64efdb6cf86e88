"""The turn driver of multi-turn rollouts: one coroutine per trajectory against one engine, tools in between.

`rollout_episodes(engine, rows, make_env, sampling, limits, ...)` runs G trajectories per data row, each its
own coroutine, all gathered on the engine's own loop (`engine.loop.run_until_complete`), so that while one
trajectory waits on a tool (`envs.tools` runs tools on threads, off the loop) the others decode. Per
trajectory:

  env.reset(row) -> messages -> ChatDeltas.prompt (the model's chat template, tools= the env's) -> prompt ids
  per turn k = 0, 1, ...:
    engine.generate_turn(ids so far + the environment's ids, routed_experts_start_len = the rows held)
      -> Trajectory.add_engine_output: the model segment (ids as generated, sampler logprobs, the policy
         version, the new route rows only; and, when the engine recomputed an evicted prefix, the rows of
         that recompute in place of the held ones, counted: `rollout.episodes.trajectory` module doc)
    ChatDeltas.close_model_turn -> the turn's text; ReasoningSplitter (SGLang's reasoning parser) -> its
      reasoning and content; ToolCallParser (SGLang's) on the content -> the assistant message
    env.step(assistant message) -> done / reward, or messages -> ChatDeltas.append -> the next environment ids
      (the template's glue after the model's turn, the messages, the generation prompt)
  until the environment says done, `max_turns` model turns, or `max_tokens`.

The recorder (`Trajectory`) knows nothing of this loop: anything that can say "these ids were inserted, then
the engine returned this" can build one; the OpenAI-compatible session endpoint (`rollout.agents.endpoint`,
`rollout.agents.session`) drives it from an external agent's requests instead of an environment.

Limits (`MultiTurnLimits`). `max_tokens` bounds a trajectory's tokens after its prompt (model and environment
tokens: the learner row's response length); each turn asks for at most `min(sampling.max_new_tokens, what is
left)`. A trajectory is truncated, and counted, when its `max_turns`-th turn leaves the environment not done
(the environment has seen that turn: its tool calls ran, their results are dropped), when the budget runs out
inside a model turn (the cut turn is not sent to the environment, whose reward stays None), or when the
environment's next messages would not leave one token for the model (they are not appended). A model turn cut
by `sampling.max_new_tokens` alone is not a truncation: the environment answers it, like any other.

Reasoning (`reasoning_parser`, `rollout.episodes.reasoning` module doc). The environment reads the turn's content
only: a tool call or an `<answer>` inside the reasoning is neither run nor scored, and a turn cut inside its
reasoning has no content. The ids train whole. Counted: turns cut at their token limit
(`rollout/cut_turns_frac`) and those cut inside their reasoning (`rollout/cut_in_reasoning_frac`).

Seeds. Turn k of the trajectory with global index i (`index_offset + row * G + sample`, as in
`RolloutEngine.generate`) samples with `turn_seed(sampling.seed, i, k)`; `sampling.seed` is the step's base
(the trainer's `request_seed_base(seed, step, call)`), so the number of engines changes no trajectory.

Failure policy. What the model writes (bad calls, unknown tools, failing tools, cut or odd reasoning) is
answered by the environment and counted, never raised; the model's text never goes through the chat
template (`rollout.episodes.chat_delta`). A chat template that is not append-only for an environment step's messages
ends that trajectory there, truncated and counted (`rollout/template_breaks`, with one warning per template
naming it): it may depend on what the tools returned. An environment that breaks its protocol and an engine
error are raised; the other trajectories of the batch finish first, so that no request is left running on
the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from megagrpo.envs.base import Environment
from megagrpo.envs.tools import ToolCounters
from megagrpo.errors import MegagrpoError
from megagrpo.rollout.config import SamplingConfig
from megagrpo.rollout.episodes.chat_delta import ChatDeltas, TemplateBreak
from megagrpo.rollout.episodes.reasoning import ReasoningSplitter, SplitTurn
from megagrpo.rollout.episodes.tool_calls import ParsedTurn, ToolCallParser, check_parser_name
from megagrpo.rollout.episodes.trajectory import Trajectory

Version = int | Callable[[], int]
log = logging.getLogger(__name__)
_WARNED_TEMPLATES: set[str] = set()  # templates a TemplateBreak was logged for (once each per process)


class TurnEngine(Protocol):
    """What the driver needs of an engine (`RolloutEngine`, or a test's fake)."""

    tokenizer: Any
    num_layers: int
    topk: int
    context_len: int

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def routes_num_experts(self) -> int | None: ...

    async def generate_turn(
        self,
        input_ids: Sequence[int],
        sampling: SamplingConfig,
        *,
        seed: int | None,
        routed_experts_start_len: int = 0,
        max_new_tokens: int | None = None,
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class MultiTurnLimits:
    """Per-trajectory limits (module doc): model turns, and tokens after the prompt."""

    max_turns: int = 4
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise MegagrpoError(f"rollout.multi_turn.max_turns={self.max_turns} must be >= 1")
        if self.max_tokens < 1:
            raise MegagrpoError(f"rollout.multi_turn.max_tokens={self.max_tokens} must be >= 1")


@dataclass
class Episode:
    """One driven trajectory and what the environment said about it.

    `reward`: the environment's (None leaves scoring to the reward functions); `done`: the environment ended
    the episode; `truncation`: "max_turns" or "max_tokens" when a limit ended it instead, "template" when
    the chat template could not append the environment's messages, "max_branches" when an agent session
    departed from its recording once more than `agent.max_branches` allows; `tools`: its tool outcomes; `info`: the
    last step's info; `cut_turns`: its model turns that stopped at their token limit, `cut_in_reasoning`
    those of them that stopped inside their reasoning."""

    trajectory: Trajectory
    reward: float | None = None
    done: bool = False
    truncation: str | None = None
    tools: ToolCounters = field(default_factory=ToolCounters)
    info: dict[str, Any] = field(default_factory=dict)
    # the last model turn's content, reasoning split off (what `rewards.functions` score)
    final_text: str = ""
    cut_turns: int = 0
    cut_in_reasoning: int = 0
    # an agent session's (`rollout.agents.session`): branches past the first, departures refused, requests
    # answered 400, how the agent failed ("timeout", "error", "no_request", "start"), and whether its row is dropped
    branches: int = 0
    branch_refusals: int = 0
    bad_requests: int = 0
    undelivered: int = 0  # turns taken back: the client went away before their reply
    agent_failure: str | None = None
    dropped: bool = False
    # an agent session's other branches that hold a model turn, in the order opened: each trains as a row
    # of its own, with the session's reward and advantage (`trainer.episodes.episode_rows`)
    earlier: list[Trajectory] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.truncation is not None

    @property
    def env_tokens(self) -> int:
        """Tokens the environment inserted after the prompt (glue, tool results, user turns)."""
        t = self.trajectory
        return t.num_tokens - t.prompt_ids.numel() - t.num_model_tokens


COUNT_PREFIX = "multi_turn/"


@dataclass
class MultiTurnStats:
    """Counters of a batch of episodes; `metrics()` names them for the step's log."""

    trajectories: int = 0
    turns: int = 0
    tools: ToolCounters = field(default_factory=ToolCounters)
    truncated_max_turns: int = 0
    truncated_max_tokens: int = 0
    truncated_template: int = 0
    truncated_max_branches: int = 0  # agent sessions ended by `agent.max_branches`
    cut_turns: int = 0
    cut_in_reasoning: int = 0
    model_tokens: int = 0
    env_tokens: int = 0
    route_bytes_received: int = 0
    route_rows_received: int = 0
    route_rows_if_resent: int = 0
    r3_prefix_recomputed: int = (
        0  # turns whose held prefix the engine recomputed (`rollout.episodes.trajectory`)
    )
    r3_prefix_recomputed_rows: int = 0  # held route rows those turns replaced
    r3_prefix_inexact: int = 0  # turns whose recomputed rows could not be read back as the turn used them
    unscored: int = 0  # episodes whose environment gave no reward
    branches: int = 0  # agent sessions: branches past the first (`rollout.agents.session`)
    branch_refusals: int = 0
    agent_bad_requests: int = 0
    agent_undelivered: int = 0
    agent_timeouts: int = 0
    agent_errors: int = 0
    agent_no_request: int = 0
    agent_start_failures: int = 0
    agent_dropped: int = 0

    def add(self, e: Episode) -> None:
        t = e.trajectory
        self.trajectories += 1
        self.branches += e.branches
        self.branch_refusals += e.branch_refusals
        self.agent_bad_requests += e.bad_requests
        self.agent_undelivered += e.undelivered
        self.agent_timeouts += e.agent_failure == "timeout"
        self.agent_errors += e.agent_failure == "error"
        self.agent_no_request += e.agent_failure == "no_request"
        self.agent_start_failures += e.agent_failure == "start"
        self.agent_dropped += e.dropped
        self.unscored += e.reward is None
        self.tools.add(e.tools)
        self.truncated_max_turns += e.truncation == "max_turns"
        self.truncated_max_tokens += e.truncation == "max_tokens"
        self.truncated_template += e.truncation == "template"
        self.truncated_max_branches += e.truncation == "max_branches"
        self.cut_turns += e.cut_turns
        self.cut_in_reasoning += e.cut_in_reasoning
        for b in (t, *e.earlier):  # an agent session's other branches trained and were received too
            self.turns += b.turns
            self.model_tokens += b.num_model_tokens
            self.env_tokens += b.num_tokens - b.prompt_ids.numel() - b.num_model_tokens
            self.route_bytes_received += b.route_bytes_received
            self.route_rows_received += b.route_rows_received
            self.route_rows_if_resent += b.route_rows_if_resent
            self.r3_prefix_recomputed += b.prefix_recomputed_turns
            self.r3_prefix_recomputed_rows += b.prefix_recomputed_rows
            self.r3_prefix_inexact += b.prefix_inexact_turns

    def counts(self) -> dict[str, float]:
        """The counters as `multi_turn/<name>` floats: they add up over engines and rounds
        (`EngineGroups.sum_counts`), and `from_counts` reads the sums back."""
        flat = {k: v for k, v in vars(self).items() if k != "tools"}
        flat.update(vars(self.tools))
        return {f"{COUNT_PREFIX}{k}": float(v) for k, v in flat.items()}

    @classmethod
    def from_counts(cls, counts: dict[str, float]) -> MultiTurnStats:
        """The stats whose `counts()` are the `multi_turn/` entries of `counts` (other keys ignored)."""
        got = {k[len(COUNT_PREFIX) :]: int(v) for k, v in counts.items() if k.startswith(COUNT_PREFIX)}
        tools = ToolCounters(**{k: got.pop(k) for k in list(got) if k in vars(ToolCounters())})
        return cls(tools=tools, **got)

    def metrics(self) -> dict[str, float]:
        n = max(self.trajectories, 1)
        turns = max(self.turns, 1)
        tc = self.tools
        return {
            "rollout/turns_mean": self.turns / n,
            "rollout/tool_calls_per_traj": tc.tool_calls / n,
            "rollout/tool_errors": float(tc.tool_errors),
            "rollout/tool_timeouts": float(tc.tool_timeouts),
            "rollout/malformed_calls": float(tc.malformed_calls),
            "rollout/unknown_tools": float(tc.unknown_tools),
            "rollout/oversize_results": float(tc.oversize_results),
            "rollout/tool_interrupted": float(tc.interrupted_calls),
            "rollout/sandbox_unisolated_calls": float(tc.unisolated_calls),
            "rollout/sandbox_refused_calls": float(tc.refused_calls),
            "rollout/truncated_max_turns_frac": self.truncated_max_turns / n,
            "rollout/truncated_max_tokens_frac": self.truncated_max_tokens / n,
            "rollout/template_breaks": float(self.truncated_template),
            "rollout/truncated_max_branches_frac": self.truncated_max_branches / n,
            "rollout/cut_turns_frac": self.cut_turns / turns,
            "rollout/cut_in_reasoning_frac": self.cut_in_reasoning / turns,
            "rollout/env_token_frac": self.env_tokens / max(self.env_tokens + self.model_tokens, 1),
            "rollout/route_bytes_per_traj": self.route_bytes_received / n,
            "rollout/r3_prefix_recomputed": float(self.r3_prefix_recomputed),
            "rollout/r3_prefix_recomputed_rows": float(self.r3_prefix_recomputed_rows),
            "rollout/r3_prefix_inexact": float(self.r3_prefix_inexact),
            "rollout/unscored_frac": self.unscored / n,
            "rollout/branches": float(self.branches),
            "rollout/branch_refusals": float(self.branch_refusals),
            "rollout/agent_bad_requests": float(self.agent_bad_requests),
            "rollout/agent_undelivered": float(self.agent_undelivered),
            "rollout/agent_timeouts": float(self.agent_timeouts),
            "rollout/agent_errors": float(self.agent_errors),
            "rollout/agent_no_request": float(self.agent_no_request),
            "rollout/agent_start_failures": float(self.agent_start_failures),
            "rollout/agent_dropped_frac": self.agent_dropped / n,
        }


def turn_seed(base: int | None, index: int, turn: int) -> int | None:
    """The sampling seed of turn `turn` of the trajectory with global index `index`: a hash of the three, so
    no two (index, turn) pairs of a step share a seed; None when the step has no seed."""
    if base is None:
        return None
    digest = hashlib.blake2b(f"{base}:{index}:{turn}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def new_trajectory(
    engine: TurnEngine, prompt: Sequence[int], prompt_index: int, sample_index: int
) -> Trajectory:
    """An empty trajectory for `prompt` on `engine`, with routes when the engine returns them."""
    experts = engine.routes_num_experts
    L, K = (engine.num_layers, engine.topk) if experts is not None else (0, 0)
    return Trajectory(prompt, L, K, experts, prompt_index, sample_index)


class ParserCache:
    """One `ToolCallParser` per distinct tool set (environments of a batch usually share theirs)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cache: dict[str, ToolCallParser] = {}

    def get(self, tools: list[dict[str, Any]]) -> ToolCallParser | None:
        if not tools:
            return None
        key = json.dumps(tools, sort_keys=True, default=str)
        if key not in self._cache:
            self._cache[key] = ToolCallParser(self.name, tools)
        return self._cache[key]


async def run_episode(
    engine: TurnEngine,
    env: Environment,
    row: dict[str, Any],
    sampling: SamplingConfig,
    limits: MultiTurnLimits,
    parsers: ParserCache,
    *,
    index: int,
    prompt_index: int = 0,
    sample_index: int = 0,
    version: Version = 0,
    template_kwargs: dict[str, Any] | None = None,
    reasoning: ReasoningSplitter | None = None,
) -> Episode:
    """Drive one trajectory to its end (module doc); awaited on the engine's loop."""
    messages = await env.reset(row)
    tools = list(env.tool_schemas() or [])
    chat = ChatDeltas(engine.tokenizer, tools=tools, **(template_kwargs or {}))
    prompt = chat.prompt(messages)
    opened = reasoning is not None and reasoning.opens(chat.generation_prompt)

    def read(text: str, cut: bool) -> SplitTurn:
        split = (
            reasoning.split(text, cut=cut, opened=opened) if reasoning is not None else SplitTurn("", text)
        )
        ep.cut_turns += cut
        ep.cut_in_reasoning += cut and split.unclosed
        return split

    traj = new_trajectory(engine, prompt, prompt_index, sample_index)
    parser = parsers.get(tools)
    own = ToolCounters()
    ep = Episode(traj)
    P, env_ids = len(prompt), []
    for turn in range(limits.max_turns):
        held = traj.num_tokens + len(env_ids)
        budget = min(sampling.max_new_tokens, limits.max_tokens - (held - P), engine.context_len - held)
        if budget < 1 and turn == 0:
            raise MegagrpoError(
                f"data row {prompt_index}: its prompt has {P} tokens, which leaves no room to generate within the "
                f"engine context of {engine.context_len} tokens (rollout.max_context_len); shorten the prompt"
            )
        if budget < 1:
            ep.truncation = "max_tokens"
            break
        out = await engine.generate_turn(
            traj.next_input_ids(env_ids),
            sampling,
            seed=turn_seed(sampling.seed, index, turn),
            routed_experts_start_len=traj.routed_experts_start_len,
            max_new_tokens=budget,
        )
        traj.add_engine_output(out, env_ids, version=version() if callable(version) else version)
        env_ids = []
        cut = traj.finish_reason == "length"
        if cut and budget < sampling.max_new_tokens:  # the trajectory's budget, not the turn's, ended it
            ep.truncation = "max_tokens"
            ep.final_text = read(engine.tokenizer.decode(out["output_ids"]), cut).content
            break
        split = read(chat.close_model_turn(out["output_ids"]), cut)
        ep.final_text = split.content
        parsed = parser.parse(split.content) if parser is not None else ParsedTurn(split.content)
        own.tool_calls += len(parsed.calls)
        own.malformed_calls += len(parsed.malformed)
        message = parsed.assistant_message(f"call_{turn}")
        if split.reasoning:
            message["reasoning_content"] = split.reasoning
        step = await env.step(message)
        ep.info = dict(step.info)
        if step.done:
            ep.done, ep.reward = True, step.reward
            break
        if turn + 1 == limits.max_turns:
            ep.truncation = "max_turns"
            break
        if not step.messages:
            raise MegagrpoError(
                f"environment {type(env).__name__} returned no message and done=False at turn {turn}; a step "
                "either appends messages (tool results, a user turn) or ends the episode"
            )
        try:
            env_ids = chat.append(step.messages)
        except TemplateBreak as e:  # the environment has seen the turn; its messages cannot be inserted
            if chat.template_name not in _WARNED_TEMPLATES:
                _WARNED_TEMPLATES.add(chat.template_name)
                log.warning("%s; such trajectories end there (rollout/template_breaks)", e)
            ep.truncation = "template"
            break
    counted = getattr(env, "counters", None)  # a ToolEnvironment counts every call it answered
    ep.tools = counted if isinstance(counted, ToolCounters) else own
    return ep


def rollout_episodes(
    engine: TurnEngine,
    rows: Sequence[dict[str, Any]],
    make_env: Callable[[], Environment],
    sampling: SamplingConfig,
    limits: MultiTurnLimits,
    *,
    tool_parser: str = "qwen25",
    reasoning_parser: str | None = None,
    group_size: int = 1,
    index_offset: int = 0,
    version: Version = 0,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[list[Episode]], MultiTurnStats]:
    """G = `group_size` episodes per data row, as `[n_rows][G]`, all concurrent on the engine's loop, and
    their counters. `make_env()` builds a fresh environment per trajectory; `version` is the policy version
    (or a callable read after each turn's request, for async mode); `template_kwargs`: the chat template's
    options (`model.chat_template_kwargs`), which `reasoning_parser` reads too. Seeds: module doc.

    Cost, between this process and its engine: each turn sends the trajectory's ids so far (so O(turns x T)
    ints per trajectory, as any engine without sessions needs) and receives its new tokens and only its new
    route rows: (T - 1) x L x K int32 on the wire per trajectory of T tokens whatever the turns, stored in
    `route_dtype(num_experts)`. Nothing crosses ranks here; `rollout.groups` splits rows over engines."""
    if not rows:
        raise MegagrpoError("rollout_episodes() got no data rows; pass at least one")
    if group_size < 1:
        raise MegagrpoError(f"group_size={group_size} must be >= 1")
    check_parser_name(tool_parser)
    parsers = ParserCache(tool_parser)
    reasoning = ReasoningSplitter(reasoning_parser, template_kwargs) if reasoning_parser else None

    async def gather() -> list[Episode | BaseException]:
        coros = [
            run_episode(
                engine,
                make_env(),
                dict(row),
                sampling,
                limits,
                parsers,
                index=index_offset + i * group_size + g,
                prompt_index=i,
                sample_index=g,
                version=version,
                template_kwargs=template_kwargs,
                reasoning=reasoning,
            )  # fmt: skip
            for i, row in enumerate(rows)
            for g in range(group_size)
        ]
        return await asyncio.gather(*coros, return_exceptions=True)

    results = engine.loop.run_until_complete(gather())
    for r in results:
        if isinstance(r, BaseException):
            raise r
    flat: list[Episode] = results  # type: ignore[assignment]
    stats = MultiTurnStats()
    for e in flat:
        stats.add(e)
    groups = [flat[i * group_size : (i + 1) * group_size] for i in range(len(rows))]
    return groups, stats
