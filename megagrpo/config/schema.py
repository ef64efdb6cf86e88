"""The one validated megagrpo config schema (pydantic v2, strict types, unknown keys rejected).

Every field carries its default and a description; `tools/gen_config_docs.py` turns this module into
`docs/config.md`, so the description is the field's documentation and must say why the field exists.
Cross-field rules that need no runtime facts live in validators here; the rule that needs the world
size lives in `check_mesh`. Validators raise `invalid(field, message)` so that the loader can name the
full dotted path of the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from megagrpo.config.mesh_rules import Roles, layout_problems, mesh_sizes, rank_roles
from megagrpo.errors import MegagrpoError

Variant = Literal["grpo", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "reinforce"]
AdvantageMethod = Literal["grpo", "dr_grpo", "rloo", "batch_std", "rank", "gdpo"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
DType = Literal["auto", "float32", "bfloat16", "float16"]

# (clip_low, clip_high) used when the YAML leaves them null. Ratio-clipped variants need very different
# scales: a sequence ratio (GSPO) is a geometric mean and moves ~1000x less than a token ratio.
VARIANT_CLIP_DEFAULTS: dict[str, tuple[float | None, float]] = {
    "grpo": (0.2, 0.28),  # PPO clip 0.2 with DAPO clip-higher 0.28 (DAPO, arXiv 2503.14476, Sec. 3.1)
    "gspo": (3e-4, 4e-4),  # GSPO paper (arXiv 2507.18071, Sec. 5.1)
    "gspo_token": (3e-4, 4e-4),  # same value as gspo; only the gradient routing differs
    "gmpo": (0.4, 0.4),  # GMPO clips token LOG-ratios to (-0.4, 0.4) (arXiv 2507.20673, Sec. 4)
    "cispo": (None, 0.28),  # CISPO caps the IS weight at 1+clip_high and has no lower bound (MiniMax-M1)
    "sapo": (0.2, 0.28),  # SAPO replaces clipping with soft gates; clips are unused
    "reinforce": (0.2, 0.28),  # no ratio; clips are unused
}

# Fields left null in YAML that validators fill from other fields; docs show them as null (their YAML default).
RESOLVED_FIELDS = frozenset(
    {"algo.clip_low", "algo.clip_high", "algo.agg_constant", "algo.soft_overlong.max_len"}
)

# Every advantage estimator in megagrpo.algo is group-relative, so a group of one has no baseline.
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "batch_std", "rank", "gdpo")


def invalid(field: str, message: str) -> PydanticCustomError:
    """A validation error whose `field` (relative to the validated model) the loader joins to the path."""
    return PydanticCustomError("megagrpo_invalid", "{message}", {"field": field, "message": message})


class Section(BaseModel):
    """Base of every section: strict types (no "8" -> 8 coercion) and no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


# --------------------------------------------------------------------------------------------- model


# Arguments of `apply_chat_template` that megagrpo sets itself: not template options a config may pass.
RENDER_ARGUMENTS = frozenset(
    {"messages", "conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "chat_template", "documents"}
)  # fmt: skip


class ModelConfig(Section):
    hf_path: str = Field(
        description="Hugging Face model directory (config.json, safetensors, tokenizer) the run starts "
        "from; the learner and the SGLang engine both load it. Required: there is no sensible default."
    )
    tokenizer_path: str | None = Field(
        default=None,
        description="Tokenizer directory when it differs from hf_path; null uses hf_path. Lets a "
        "checkpoint reuse the base model's tokenizer and chat template.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Let transformers and SGLang run the Python the checkpoint ships (its config.json / "
        "tokenizer_config.json `auto_map`: Kimi-K2's configuration_deepseek.py and tiktoken tokenizer "
        "tokenization_kimi.py), in every process that loads the model or its tokenizer (trainer, learner "
        "ranks, engines). Off by default because that is arbitrary code execution from the model directory; "
        "the preflight names the files and classes when a model needs it.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the tokenizer's chat template, passed wherever it is rendered: prompts, "
        "multi-turn rollouts and SFT rows, single-turn and tool traces alike (e.g. {enable_thinking: "
        "false} for Qwen3). Here rather than under data or rollout because the template is the model's, "
        "and SFT (sft.data) must render exactly as the RL stage samples; rollout.multi_turn."
        "reasoning_parser reads it too, as SGLang does (Qwen3 reasons unless enable_thinking is false).",
    )
    dtype: DType = Field(
        default="auto",
        description="Learner parameter/compute dtype. auto = bfloat16 on GPU, float32 on CPU (CPU kernels "
        "are fp32-only, and the distributed tests compare to fp32 tolerance).",
    )
    fp8: Literal["none", "hybrid", "e4m3"] | None = Field(
        default=None,
        description="Learner FP8 training via megatron-core fp8 (GPU + Transformer Engine only); "
        "null/none disables. hybrid = e4m3 forward, e5m2 backward.",
    )
    fp8_recipe: Literal["delayed", "blockwise"] = Field(
        default="delayed",
        description="FP8 scaling recipe when fp8 is on: delayed (amax history) or blockwise (per-block "
        "scales, needed by recent FP8 MoE checkpoints).",
    )
    layer_spec: Literal["auto", "local", "transformer_engine"] = Field(
        default="auto",
        description="megatron-core layer implementation. auto = transformer_engine on a GPU where it is "
        "installed, except for an fp32 learner without fp8 (TE computes fp32 GEMMs in TF32) and for "
        "multi-latent attention (its TE names are not mapped yet): local there, and on CPU (Transformer "
        "Engine has no CPU build). transformer_engine insists on TE.",
    )
    recompute_activations: bool = Field(
        default=False,
        description="Full activation recompute in the learner: trades compute for memory on long "
        "responses. With replay R2 the recorded routes are replayed in the recompute too.",
    )
    ref_offload: bool = Field(
        default=False,
        description="Keep the frozen KL reference model's weights on CPU between uses (GPU memory saver). "
        "Only used when algo.kl.coef > 0.",
    )
    router_bias_update_rate: float = Field(
        default=0.0,
        ge=0.0,
        description="Routers with a correction bias (deepseek_v3, glm4_moe: HF e_score_correction_bias): "
        "per optimizer step, megatron's auxiliary-loss-free rule moves each expert's bias by this rate "
        "towards balance (b_e += rate * sign(mean load - load_e) over the step's training tokens; "
        "DeepSeek-V3 arXiv:2412.19437 section 2.1.2). 0 keeps the checkpoint's bias frozen: the default, "
        "because the bias decides the selection, so a learner whose bias moved routes differently from a "
        "sampler that did not receive it (the weight sync must then carry it every step). The updated bias "
        "is exported with the weights. A model without a correction bias refuses a rate above 0.",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        taken = sorted(set(self.chat_template_kwargs) & RENDER_ARGUMENTS)
        if taken:
            raise invalid(
                "chat_template_kwargs",
                f"{taken} are set by megagrpo itself when it renders the template (it passes "
                f"{', '.join(sorted(RENDER_ARGUMENTS))}); remove them and keep only the template's own options",
            )
        return self


# ---------------------------------------------------------------------------------------------- mesh


class MeshConfig(Section):
    tp: int = Field(default=1, ge=1, description="Tensor-parallel size (attention + dense MLP + vocab).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel size (layers split into stages).")
    first_stage_layers: int | None = Field(
        default=None,
        description="Decoder layers on the first pipeline stage (megatron-core's "
        "num_layers_in_first_pipeline_stage); null = an even share. The stages between the first and the "
        "last split the remaining layers evenly. For a layer count that divides by no pipeline size "
        "(DeepSeek-V3's 61 on pp=8: first 5 + 7 x 8), or to lighten the stage that also holds the "
        "embedding. Checked against the model's layer count before any process starts.",
    )
    last_stage_layers: int | None = Field(
        default=None,
        description="Decoder layers on the last pipeline stage (num_layers_in_last_pipeline_stage); null = "
        "an even share of what the first stage leaves. The last stage also computes the output layer and "
        "the loss, so a smaller count balances it.",
    )
    ep: int = Field(default=1, ge=1, description="Expert-parallel size (experts split across ranks).")
    etp: int = Field(
        default=1,
        ge=1,
        description="Expert tensor-parallel size (each expert's MLP split); 1 keeps experts whole, which "
        "is what small experts want.",
    )
    cp: int = Field(default=1, ge=1, description="Context-parallel size (sequence split for long inputs).")
    sequence_parallel: bool = Field(
        default=False,
        description="Megatron sequence parallelism within the TP group: shards layer-norm/dropout "
        "activations. Needs tp > 1; megatron-core requires it when both tp > 1 and ep > 1.",
    )

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        problems = layout_problems(
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            etp=self.etp,
            cp=self.cp,
            sequence_parallel=self.sequence_parallel,
            first_stage_layers=self.first_stage_layers,
            last_stage_layers=self.last_stage_layers,
        )
        if problems:
            raise invalid(*problems[0])
        return self


# ------------------------------------------------------------------------------------------- rollout


class PlacementConfig(Section):
    """Where the samplers run: on the learner's devices, or on ranks of their own."""

    kind: Literal["colocated", "disaggregated"] = Field(
        default="colocated",
        description="colocated: every engine is owned by a learner rank and shares its devices (GPUs: the "
        "learner and the engine take turns; CPU: the same process, optionally pinned by engine_cores). "
        "disaggregated: the last rollout.num_engines * rollout.engine_tp ranks of the launch run only "
        "SGLang servers, on GPUs (a node of their own, or GPUs beside the learner's) or CPU processes "
        "of their own; the learner is the other ranks, and weights go over a broadcast group (gloo on "
        "the CPU, NCCL on GPUs) with SGLang's update_weights_from_distributed (docs/disaggregated.md). "
        "The way to run rollout.mode=async on GPUs.",
    )
    engine_timeout_s: float = Field(
        default=1800.0,
        gt=0.0,
        description="disaggregated: the longest wait for one answer of an engine (its start, a request, a "
        "weight update, a checksum); past it the run stops with an error naming the engine. A dead "
        "engine is found at once (its connection fails). The default matches dist.timeout_minutes': "
        "a whole round of long generations may take many minutes.",
    )
    engine_cores: list[int] | None = Field(
        default=None,
        description="CPU: the cores the engines' processes are pinned to (colocated: each engine's; "
        "disaggregated: every engine rank's, with its server's processes); the learner keeps the other "
        "cores. null = colocated: no pinning; async or disaggregated: the last core for the engines and "
        "the rest for the learner (two cores at least; disaggregated on one core: no pinning). Set in "
        "colocated mode too, it gives a benchmark the same placement in both modes. Ignored on GPUs.",
    )

    @model_validator(mode="after")
    def _check(self) -> PlacementConfig:
        if self.engine_cores is not None and (not self.engine_cores or any(c < 0 for c in self.engine_cores)):
            raise invalid(
                "engine_cores", f"{self.engine_cores} must be a non-empty list of core numbers >= 0"
            )
        return self

    @property
    def disaggregated(self) -> bool:
        return self.kind == "disaggregated"


# What a command agent gets of the trainer's environment by default (`AgentConfig.env`): enough to find and
# run a program and its Python, no credentials.
AGENT_ENV_DEFAULT = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH",
                     "VIRTUAL_ENV")  # fmt: skip


class AgentConfig(Section):
    """Bring your own agent: an OpenAI-compatible endpoint per trajectory instead of an environment."""

    function: str | None = Field(
        default=None,
        description="The agent as a Python callable 'my_pkg.agent:run', called once per trajectory (on a "
        "thread of the engine owner) as run(base_url, row, **options) with its session's base URL "
        "(http://<rollout host>:<port>/s/<token>/v1: point the OpenAI client at it) and the data row; it "
        "returns the reward (a number), a dict with 'reward', or None to leave scoring to rewards.functions. "
        "Each request it sends is recorded token for token (docs/agentic.md, 'Bring your own agent'). When "
        "set (or command), the agent drives the trajectories and environment is not used.",
    )
    command: str | None = Field(
        default=None,
        description="The agent as a command, run once per trajectory with MEGAGRPO_BASE_URL and "
        "OPENAI_BASE_URL (its session's base URL), OPENAI_API_KEY (its session's own key, never the "
        "trainer's), MEGAGRPO_ROW_FILE (a file holding the data row as JSON, also its standard input) and "
        "the variables named in env, nothing else of the trainer's environment; the last line of its "
        "standard output is its return, as JSON (a number, an object with 'reward', or null). When its "
        "session ends, its whole process tree ends with it (children in sessions of their own included). "
        "Exclusive with function.",
    )
    env: list[str] = Field(
        default_factory=lambda: list(AGENT_ENV_DEFAULT),
        description="Names of the trainer's environment variables that a command agent gets (those set). "
        "Nothing else is passed: a secret of the trainer (HF_TOKEN, a real OPENAI_API_KEY) reaches an "
        "agent only when named here, and OPENAI_API_KEY, MEGAGRPO_BASE_URL, OPENAI_BASE_URL and "
        "MEGAGRPO_ROW_FILE are always the session's own. The default is what a program needs to run.",
    )
    max_branches: int = Field(
        default=4,
        ge=1,
        description="Branches per session (on_departure: branch): a departure that would open one more "
        "ends the session, truncated (rollout/truncated_max_branches_frac). A session trains at most "
        "min(max_branches, max_turns) rows, which is what megagrpo plan counts per session; 1 never "
        "branches.",
    )
    max_concurrent: int = Field(
        default=64,
        ge=1,
        description="Agents running at once on one engine owner (sessions past it wait to start; a "
        "session's timeout_s starts when its agent does). Each running command agent holds processes and "
        "file descriptors, each function agent a thread; an agent that cannot start (the process table "
        "or the file table full) fails its own session, counted (rollout/agent_start_failures).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the function, checked against its signature before any process "
        "starts (e.g. {max_turns: 2, system_prompt: ''}).",
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Wall budget of one session, from its agent's start: an agent still running after it is "
        "ended (a command's whole process tree killed; a function's thread left behind, its requests "
        "refused) and counted (rollout/agent_timeouts), so that no agent can hang a step.",
    )
    on_failure: Literal["drop", "zero"] = Field(
        default="drop",
        description="A session whose agent crashed, ran past timeout_s, never sent a request or could not "
        "start (counted: rollout/agent_errors, agent_timeouts, agent_no_request, agent_start_failures): "
        "drop = its row takes no loss (reward 0 in its group's baseline); zero = it trains with reward 0. "
        "A session with no answered request is always dropped.",
    )
    on_departure: Literal["branch", "refuse"] = Field(
        default="branch",
        description="A request whose history departs from the session's recording (the agent dropped, "
        "edited or summarised earlier messages): branch = record it as a new branch (its history rendered "
        "as the branch's prompt, no loss on it; rollout/branches); every branch with a model turn trains as a "
        "row of its own with the session's advantage; refuse = answer HTTP 409 naming the message that differs "
        "(rollout/branch_refusals). Never re-tokenised into the old branch either way.",
    )
    host: str = Field(
        default="127.0.0.1",
        description="The address the endpoint listens on, on the engine owner's host (a free port is "
        "taken per rollout). The default keeps it to agents on that host; every session's URL carries an "
        "unguessable token, and a request without one is answered 404.",
    )

    @model_validator(mode="after")
    def _one_agent(self) -> AgentConfig:
        if self.function is not None and self.command is not None:
            raise invalid("function", "and command are both set; name the agent by one of them")
        if self.options and self.command is not None:
            raise invalid("options", "are keyword arguments of a function; a command takes its own arguments")
        bad = [n for n in self.env if not n or "=" in n or "\0" in n]
        if bad:
            raise invalid("env", f"{bad} are not variable names; list names (PATH, HOME), not NAME=value")
        return self

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.command is not None


class MultiTurnConfig(Section):
    """Agentic rollouts: each sample is a trajectory of model turns and environment turns (tools, users)."""

    enabled: bool = Field(
        default=False,
        description="Sample multi-turn trajectories instead of one completion per prompt: the environment "
        "starts each conversation from a data row, answers every model turn (tool results, user turns), "
        "and scores it. A trajectory is one learner row whose environment tokens take no loss "
        "(docs/agentic.md).",
    )
    environment: str = Field(
        default="calculator",
        description="The environment: a built-in name (calculator) or an import path 'package.module:Class' "
        "of a class with async reset(row) and step(assistant_message) (megagrpo.envs.base.Environment). "
        "One instance per trajectory.",
    )
    environment_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the environment's constructor, checked against its signature "
        "before any process starts (e.g. {max_turns: 3, question_key: prompt}).",
    )
    tool_parser: str = Field(
        default="qwen25",
        description="SGLang's function-call parser for the model family's tool-call format (qwen25: "
        "Qwen2.5/Qwen3's <tool_call> JSON; others: llama3, mistral, deepseekv3, ...). A call it cannot "
        "parse is answered to the model as an error and counted (rollout/malformed_calls).",
    )
    reasoning_parser: str | None = Field(
        default=None,
        description="SGLang's reasoning parser for the model family (qwen3: Qwen3's <think>...</think>; "
        "deepseek-r1, glm45, ...), checked against SGLang's names before any process starts. It splits "
        "each model turn's reasoning off before tool calls and <answer> are read, so neither counts inside "
        "the reasoning, and a turn cut inside it has none (rollout/cut_in_reasoning_frac). null: the whole "
        "turn is content, for a model that does not reason. The turn's ids train whole either way.",
    )
    max_turns: int = Field(
        default=4,
        ge=1,
        description="Model turns per trajectory (an agent session: over all its branches). A trajectory "
        "whose last allowed turn leaves the environment not done is truncated "
        "(rollout/truncated_max_turns_frac) and treated like an overlong response (algo.overlong_filter).",
    )
    max_tokens: int = Field(
        default=1024,
        ge=1,
        description="Tokens per trajectory after its prompt, model and environment tokens together (the "
        "learner row's response length; an agent session: over all its branches, each after its own "
        "prompt). Each turn generates at most min(rollout.max_new_tokens, what is "
        "left); running out is a truncation (rollout/truncated_max_tokens_frac).",
    )
    reward: Literal["environment", "functions"] = Field(
        default="environment",
        description="environment: the trajectory's reward is the one the environment's last step returns "
        "(a trajectory it did not score, e.g. a truncated one, gets 0 and is counted as "
        "rollout/unscored_frac). functions: rewards.functions score the final assistant message against "
        "the data row, as a single-turn completion is scored.",
    )
    max_concurrent_tools: int = Field(
        default=16,
        ge=1,
        description="Tool calls running at once on one engine owner, shared by all the trajectories it "
        "samples (calls past it wait; a call's deadline starts when it runs). Each running python-tool "
        "call is a sandbox: the memory plan counts this many sandboxes' memory on the host "
        "(megagrpo plan; docs/sandbox.md gives one sandbox's cost).",
    )
    agent: AgentConfig = Field(
        default_factory=AgentConfig,
        description="An external agent that drives each trajectory through an OpenAI-compatible endpoint "
        "instead of the environment (docs/agentic.md, 'Bring your own agent').",
    )
    sandbox_isolation: Literal["require", "best_effort"] = Field(
        default="require",
        description="require: probe the code sandbox once at start (the CLI and each engine owner) and "
        "refuse to run, in one line naming what it cannot enforce (network isolation, PID namespace, "
        "private mounts, IPC namespace), where the kernel denies namespaces (a container without "
        "CAP_SYS_ADMIN); later, a call whose isolation fails is refused, its code never run, and counted "
        "(rollout/sandbox_refused_calls; its trajectory is dropped). best_effort: run the code anyway, "
        "with that line printed at start and every such call counted (rollout/sandbox_unisolated_calls). "
        "Only environments with a sandbox (python) read it.",
    )

    @property
    def rows_per_session(self) -> int:
        """The most learner rows one trajectory trains: 1, or an agent session's branches, each with at least
        one model turn of the session's `max_turns` (`rollout.agents.session`)."""
        a = self.agent
        if not self.enabled or not a.enabled or a.on_departure == "refuse":
            return 1
        return min(a.max_branches, self.max_turns)

    @model_validator(mode="after")
    def _agent_needs_multi_turn(self) -> MultiTurnConfig:
        if self.agent.enabled and not self.enabled:
            raise invalid(
                "agent", "names an agent while rollout.multi_turn.enabled=false; set enabled=true to run it"
            )
        return self


class FaultToleranceConfig(Section):
    """How an engine owner watches its colocated engine, and replaces it (docs/reliability.md)."""

    max_restarts: int = Field(
        default=0,
        ge=0,
        description="Replacements each engine may have in a run: a failed engine is ended, a new one "
        "started in its place, given the learner's current weights (checksummed with engine_tp 1) and the round's "
        "requests again with their seeds, so the completions are the ones the lost engine would have "
        "made. 0 = none: an engine loss ends the run with exit 69, to resume from the last "
        "checkpoint. Default 0: a replacement costs an engine start (minutes at scale) and would hide "
        "a recurring fault; and it covers only colocated, synchronous, single-turn rounds so far.",
    )
    probe_interval_s: float = Field(
        default=1.0,
        gt=0.0,
        description="Seconds between two looks of the owner's watch at its engine's processes and requests "
        "(a few /proc reads each: free next to a round).",
    )
    probe_deadline_s: float = Field(
        default=10.0,
        gt=0.0,
        description="Liveness: a process of the engine (a scheduler, the detokenizer) that has exited, or "
        "has been stopped (SIGSTOP, a frozen cgroup) for this long, fails the engine. A dead process "
        "fails it at the next look; a stop gets this grace because a debugger or a job-control stop "
        "may be brief.",
    )
    hang_s: float = Field(
        default=1800.0,
        gt=0.0,
        description="Hang detector: requests in flight and no answer from the engine for this long fail "
        "it, whatever its processes look like (a scheduler alive but stuck). SGLang answers a "
        "non-streamed request only when it finishes, so a round whose requests all run to "
        "max_new_tokens is silent to its end: the default matches dist.timeout_minutes and "
        "placement.engine_timeout_s, longer than any round of long generations.",
    )

    @model_validator(mode="after")
    def _check(self) -> FaultToleranceConfig:
        if self.probe_deadline_s < self.probe_interval_s:
            raise invalid(
                "probe_deadline_s",
                f"{self.probe_deadline_s} is below probe_interval_s={self.probe_interval_s}; the watch "
                "looks only every probe_interval_s, so raise probe_deadline_s or lower probe_interval_s",
            )
        return self


class RolloutConfig(Section):
    engine_tp: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel size of each colocated SGLang engine. On GPUs world_size / engine_tp "
        "engines run, each on its own engine_tp GPUs of one node and owned by the first rank of them. "
        "Independent of the learner mesh: inference usually wants less sharding.",
    )
    num_engines: int | None = Field(
        default=None,
        ge=1,
        description="Number of samplers. null = world_size / engine_tp on GPUs (one per colocation group) "
        "and 1 on the CPU. On the CPU any count up to the world size runs, on evenly spaced ranks, through "
        "the same data-parallel path as on GPUs: the distributed tests use it to prove that the number of "
        "engines changes no completion. On GPUs only world_size / engine_tp is accepted.",
    )
    mem_fraction_static: float = Field(
        default=0.5,
        gt=0.0,
        lt=1.0,
        description="SGLang's share of device memory for weights + KV cache, sized at engine start with "
        "the learner offloaded. The rest holds what stays resident (CUDA contexts, NCCL buffers) and, "
        "during the weight sync, the learner beside the engine's weights (docs/architecture.md).",
    )
    max_total_tokens: int | None = Field(
        default=None,
        ge=1,
        description="KV-cache size of the engine in tokens. null: on GPU SGLang sizes it from "
        "mem_fraction_static; on the CPU (where that fraction would be of all RAM, gigabytes for a tiny "
        "model) it defaults to what one step can hold: prompts_per_step * oversample * group_size * "
        "(data.max_prompt_tokens + max_new_tokens, or multi_turn.max_tokens), at least 4096.",
    )
    dtype: DType = Field(
        default="auto",
        description="Sampler dtype. auto = bfloat16 on GPU, float32 on CPU. A dtype differing from the "
        "learner's is a mismatch source that TIS/MIS corrects.",
    )
    fp8: bool = Field(
        default=False,
        description="FP8 rollout (SGLang quantization='fp8', GPU only): faster sampling at the cost of "
        "a larger train/inference mismatch.",
    )
    deterministic: bool = Field(
        default=False,
        description="GPU: start SGLang with enable_deterministic_inference, so each request's seed is "
        "honoured and batch-invariant kernels make a completion and its logprobs independent of how "
        "requests are batched: a seeded run repeats its rollouts. Off by default because it costs "
        "throughput (pytorch sampling, a deterministic attention backend, batch-invariant matmuls); "
        "off, GPU rollouts do not repeat. CPU: no effect, the CPU engine always honours the seeds "
        "(docs/architecture.md, Reproducibility).",
    )
    group_size: int = Field(
        default=8,
        ge=1,
        description="G, completions sampled per prompt. Group-relative advantages need G >= 2; larger G "
        "gives lower-variance baselines and fewer all-equal groups.",
    )
    prompts_per_step: int = Field(
        default=32,
        ge=1,
        description="Prompts per training step (the global batch is prompts_per_step * group_size "
        "completions after dynamic sampling refills it).",
    )
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        description="Sampling temperature for training rollouts. 1.0 samples the policy being optimised; "
        "other values make the rollout off-policy.",
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling for training rollouts. 1.0 keeps them on-policy (truncation makes "
        "sampler and learner distributions differ).",
    )
    max_new_tokens: int = Field(default=1024, ge=1, description="Maximum response length in tokens.")
    stop: list[str] = Field(
        default_factory=list,
        description="Extra stop strings (the tokenizer's EOS always stops). E.g. ['</answer>'] ends a "
        "response at its strict answer tag.",
    )
    oversample: float = Field(
        default=1.25,
        ge=1.0,
        description="Dynamic sampling: each refill round requests ceil(missing_prompts * oversample) "
        "prompts, anticipating that some groups are dropped for zero reward variance.",
    )
    max_rounds: int = Field(
        default=3,
        ge=1,
        description="Dynamic sampling: cap on sampling rounds per step; after it the step trains on the "
        "groups it has (logged as rollout/rounds and rollout/dropped_frac) instead of looping forever.",
    )
    eval_temperature: float = Field(
        default=0.0,
        ge=0.0,
        description="Temperature for held-out evaluation; 0 = greedy so accuracy is comparable across steps.",
    )
    mode: Literal["colocated", "async"] = Field(
        default="colocated",
        description="colocated: sampler and learner take turns on the same devices (on-policy, no "
        "overlap). async: the samplers run on their own devices (rollout.placement) and generate the "
        "next max_staleness steps' first rounds while the learner trains; each completion records its "
        "policy version, and the loss corrects the lag (docs/async.md).",
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        description="async: the learner trains step n only on samples of policy versions >= n - k "
        "(version = learner steps applied to the sampler's weights). Step n's first round is generated "
        "with version max(0, n - k), so the lag is exactly k once the pipeline is full: deterministic, "
        "seeded runs repeat. 0 = no overlap, the same completions as colocated mode; 1 = one-step-off "
        "(verl, NeMo-RL); larger only deepens the queue.",
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig,
        description="Where the samplers run: colocated with the learner or on ranks of their own.",
    )
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="Agentic multi-turn trajectories with tools."
    )
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig,
        description="Colocated engines: the owner's watch, which fails a dead, stopped or hung engine "
        "with an error naming it instead of waiting on it, and the engine's replacement, or the run's "
        "end with exit 69 (docs/reliability.md).",
    )

    @model_validator(mode="after")
    def _check_fault_tolerance(self) -> RolloutConfig:
        if self.fault_tolerance.max_restarts > 0:
            other = (
                "rollout.multi_turn.enabled=true"
                if self.multi_turn.enabled
                else "rollout.mode=async"
                if self.mode == "async"
                else "rollout.placement.kind=disaggregated"
                if self.placement.disaggregated
                else None
            )
            if other is not None:
                raise invalid(
                    "fault_tolerance.max_restarts",
                    f"{self.fault_tolerance.max_restarts} with {other}: engines are replaced only in "
                    "colocated, synchronous, single-turn rollouts so far (docs/reliability.md); set "
                    "rollout.fault_tolerance.max_restarts=0",
                )
        return self

    @property
    def response_tokens(self) -> int:
        """The most tokens a learner row holds after its prompt: a completion's `max_new_tokens`, or a
        trajectory's `multi_turn.max_tokens` (model and environment tokens)."""
        return self.multi_turn.max_tokens if self.multi_turn.enabled else self.max_new_tokens


# ---------------------------------------------------------------------------------------------- algo


class KlConfig(Section):
    coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the KL penalty to the frozen reference model. 0 disables it and skips "
        "the reference model entirely (DAPO and Dr. GRPO drop KL for verifiable rewards).",
    )
    estimator: KlEstimator = Field(
        default="low_var_kl",
        description="Per-token KL estimator: k1 (log-ratio), k2 (squared), k3 (unbiased, non-negative), "
        "low_var_kl (k3 clamped to [-10, 10], robust to rare huge ratios).",
    )
    placement: Literal["loss", "reward"] = Field(
        default="loss",
        description="loss: add coef*KL(pi_theta||pi_ref) to the objective, as in GRPO (DeepSeekMath Eq. "
        "3). reward: subtract coef * sum_t KL_t of each response from its reward before advantages, the "
        "RLHF shaping of Ziegler et al. 2019 / InstructGPT; KL_t compares the old policy (the sampler's "
        "logprobs with algo.old_logp=rollout) with the reference, and the loss then carries no KL term "
        "(loss/kl is still logged). With a std-normalised estimator (grpo, batch_std, rank) a group of "
        "equal raw rewards is then ordered by its KL penalties alone, at full advantage scale. Not with "
        "algo.advantages=gdpo.",
    )


class SoftOverlongConfig(Section):
    enabled: bool = Field(
        default=False,
        description="DAPO soft overlong punishment: a length penalty ramping linearly over the last "
        "cache_len tokens before max_len, so truncation is discouraged smoothly.",
    )
    max_len: int | None = Field(
        default=None,
        ge=1,
        description="Length at which the full penalty applies; null = rollout.max_new_tokens (multi-turn: "
        "rollout.multi_turn.max_tokens, a trajectory's tokens after its prompt).",
    )
    cache_len: int = Field(
        default=256,
        ge=1,
        description="Width of the penalty ramp in tokens (DAPO's L_cache); must be below max_len.",
    )
    factor: float = Field(
        default=1.0,
        ge=0.0,
        description="Penalty at max_len (the ramp goes from 0 to -factor).",
    )


class AutoCapConfig(Section):
    quantile: float = Field(
        default=0.999,
        gt=0.5,
        lt=1.0,
        description="cap 'auto': the cap is this quantile of measured token ratios over the window "
        "(p99.9 leaves the bulk untouched and cuts only the tail).",
    )
    window: int = Field(
        default=10,
        ge=1,
        description="cap 'auto': number of recent steps whose ratios feed the quantile; smooths the cap.",
    )
    clamp: list[float] = Field(
        default_factory=lambda: [1.5, 10.0],
        description="cap 'auto': [low, high] bounds on the computed cap, so a calm or wild step cannot "
        "set an absurd cap. Needs 1 <= low <= high.",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoCapConfig:
        if len(self.clamp) != 2 or not 1.0 <= self.clamp[0] <= self.clamp[1]:
            raise invalid("clamp", f"{self.clamp} must be [low, high] with 1 <= low <= high")
        return self


class ImportanceConfig(Section):
    """Train/inference importance correction (TIS truncates, MIS masks); both may be on at once, and then
    one ratio weighs a token, times the other section's mask (`megagrpo.algo.importance.combine_corrections`)."""

    enabled: bool = Field(default=False, description="Apply this correction to the policy loss.")
    level: Literal["token", "sequence", "geometric"] = Field(
        default="token",
        description="Ratio level: token ratio, sequence product, or geometric mean of token ratios "
        "(length-independent sequence ratio).",
    )
    mode: Literal["truncate", "mask", "icepop"] = Field(
        default="truncate",
        description="truncate: w=min(ratio, cap) (TIS); mask: zero weight outside [cap_low, cap] (MIS); "
        "icepop: two-sided token mask.",
    )
    cap: float | Literal["auto"] = Field(
        default=2.0,
        description="Upper ratio bound (> 1), or 'auto' to set it every step from measured mismatch "
        "(see auto; logged as mismatch/tis_cap).",
    )
    cap_low: float | None = Field(
        default=None,
        description="Lower ratio bound in (0, 1): mask/icepop zero tokens below it, truncate raises weights "
        "to it. null = 1/cap for mask/icepop (symmetric in log space), no lower bound for truncate.",
    )
    veto_low: float | None = Field(
        default=None,
        description="Sequence veto: drop a whole sequence when any of its token ratios is below this "
        "(catches a catastrophic token that a mean would hide); null disables.",
    )
    auto: AutoCapConfig = Field(
        default_factory=AutoCapConfig, description="Rule that sets the cap when cap is 'auto'."
    )

    @model_validator(mode="after")
    def _check(self) -> ImportanceConfig:
        if self.cap != "auto" and self.cap <= 1.0:
            raise invalid(
                "cap", f"{self.cap} must be > 1 (a ratio cap at or below 1 rejects on-policy tokens)"
            )
        if self.cap_low is not None and not 0.0 < self.cap_low < 1.0:
            raise invalid("cap_low", f"{self.cap_low} must be in (0, 1)")
        if self.veto_low is not None and not 0.0 < self.veto_low < 1.0:
            raise invalid("veto_low", f"{self.veto_low} must be in (0, 1)")
        if self.mode == "icepop" and self.level != "token":
            raise invalid("level", f"{self.level!r} with mode=icepop; IcePop masks tokens: use level=token")
        return self


class MaskedImportanceConfig(ImportanceConfig):
    """`algo.mis`: the same correction with masking as its default, also when the YAML gives the section
    (`mis: {enabled: true}` must not mean truncation)."""

    mode: Literal["truncate", "mask", "icepop"] = Field(
        default="mask",
        description="truncate: w=min(ratio, cap) (TIS); mask: zero weight outside [cap_low, cap] (MIS); "
        "icepop: two-sided token mask.",
    )


class AlgoConfig(Section):
    variant: Variant = Field(
        default="grpo",
        description="Policy objective: grpo (PPO token clip), gspo (sequence ratio), gspo_token, gmpo "
        "(geometric mean), cispo (clipped IS weight, no token dropped), sapo (soft gates), reinforce.",
    )
    clip_low: float | None = Field(
        default=None,
        description="Lower clip epsilon (ratio >= 1-clip_low; for gmpo a log-ratio bound). null = the "
        "variant's published default: grpo 0.2, gspo 3e-4, gmpo 0.4, cispo none (no lower bound).",
    )
    clip_high: float | None = Field(
        default=None,
        description="Upper clip epsilon (ratio <= 1+clip_high); above clip_low = DAPO clip-higher. "
        "null = variant default: grpo/cispo 0.28, gspo 4e-4, gmpo 0.4 (log-ratio).",
    )
    clip_ratio_c: float | None = Field(
        default=None,
        description="Dual-clip bound c > 1 for negative advantages (ratio capped at c); null disables.",
    )
    sapo_tau_pos: float = Field(
        default=1.0, gt=0.0, description="SAPO gate temperature for positive advantages."
    )
    sapo_tau_neg: float = Field(
        default=1.05,
        gt=0.0,
        description="SAPO gate temperature for negative advantages (slightly larger: negative updates "
        "spread to many tokens and are damped faster).",
    )
    agg: AggMode = Field(
        default="token-mean",
        description="Loss aggregation. token-mean (DAPO) weighs every token equally so long responses "
        "are not under-weighted; seq-mean-token-sum-norm divides by agg_constant (Dr. GRPO).",
    )
    agg_constant: float | None = Field(
        default=None,
        gt=0.0,
        description="Fixed denominator for seq-mean-token-sum-norm; null = rollout.max_new_tokens "
        "(multi-turn: rollout.multi_turn.max_tokens).",
    )
    advantages: AdvantageMethod = Field(
        default="grpo",
        description="Advantage estimator: grpo (group z-score), dr_grpo (mean-centred, no std), rloo "
        "(leave-one-out), batch_std (batch std), rank (GOPO ranks), gdpo (per-reward group "
        "normalisation; needs rewards.combine=gdpo).",
    )
    adv_eps: float = Field(
        default=1e-6, gt=0.0, description="Added to the group std so all-equal groups do not divide by 0."
    )
    kl: KlConfig = Field(default_factory=KlConfig, description="KL to a frozen reference model.")
    entropy_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Entropy bonus weight; 0 off. Usually unnecessary with clip-higher and can blow up.",
    )
    dynamic_sampling: bool = Field(
        default=True,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, "
        "no gradient) and refill the batch (see rollout.oversample, max_rounds).",
    )
    overlong_filter: bool = Field(
        default=False,
        description="DAPO overlong filtering: exclude truncated (finish_reason=length) responses from the "
        "loss, since their reward judges an unfinished answer.",
    )
    soft_overlong: SoftOverlongConfig = Field(
        default_factory=SoftOverlongConfig, description="DAPO soft overlong length penalty on the reward."
    )
    tis: ImportanceConfig = Field(
        default_factory=ImportanceConfig,
        description="Truncated importance sampling between sampler and learner probabilities. With algo.mis "
        "also on, this section's weight min(ratio, cap) is the token's weight, times mis's mask only: "
        "min(ratio, cap) x 1[kept by mis], the ratio counted once (e.g. tis level sequence + mis level "
        "geometric, or both token).",
    )
    mis: MaskedImportanceConfig = Field(
        default_factory=MaskedImportanceConfig,
        description="Masked importance sampling: drops tokens/sequences whose sampler/learner ratio is "
        "out of range (default mode mask). With algo.tis also on, it contributes its mask only (which "
        "tokens/sequences it keeps), never its ratio; the weight is the truncating section's (tis's when "
        "neither truncates). tis and mis may not both have mode truncate.",
    )
    router_shift: bool = Field(
        default=False,
        description="RSPO: multiply each token's objective by the stop-gradient router-shift weight "
        "gamma (MoE only), down-weighting tokens whose routing moved since the old policy.",
    )
    router_shift_gamma_min: float = Field(
        default=0.8,
        ge=0.0,
        lt=1.0,
        description="RSPO lower-bound floor: gamma = max(gamma, gamma_min), so a token whose routing moved "
        "a lot is down-weighted but never silenced (RSPO, arXiv 2510.23027, Sec. 3).",
    )
    old_logp: Literal["recompute", "rollout"] = Field(
        default="recompute",
        description="recompute: old-policy logprobs from a learner forward (ratios exclude sampler "
        "mismatch); rollout: use the sampler's logprobs (saves a forward; the ratio carries the mismatch, "
        "so TIS, MIS and diagnostics.mismatch, which compare that forward with the sampler, must be off).",
    )
    ppo_mini_batches: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per rollout batch (the batch is split into this many mini-batches). "
        "1 = strictly on-policy.",
    )
    ppo_epochs: int = Field(
        default=1, ge=1, description="Passes over the rollout batch; >1 reuses samples (more off-policy)."
    )

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        low, high = VARIANT_CLIP_DEFAULTS[self.variant]
        if self.clip_low is None:
            self.clip_low = low  # stays None for cispo: no lower bound
        if self.clip_high is None:
            self.clip_high = high
        if self.variant == "gmpo" and self.clip_low <= 0.0:
            raise invalid(
                "clip_low", f"{self.clip_low} must be > 0: gmpo bounds the token log-ratio by -clip_low"
            )
        if self.variant != "gmpo" and self.clip_low is not None and not 0.0 < self.clip_low < 1.0:
            raise invalid(
                "clip_low", f"{self.clip_low} must be in (0, 1): the lower ratio bound is 1-clip_low"
            )
        if self.clip_high <= 0.0:
            raise invalid("clip_high", f"{self.clip_high} must be > 0: the upper ratio bound is 1+clip_high")
        for name in ("tis", "mis"):
            if self.old_logp == "rollout" and getattr(self, name).enabled:
                raise invalid(
                    f"{name}.enabled",
                    f"true with algo.old_logp=rollout; {name.upper()} weighs tokens by the learner/sampler "
                    "ratio of the old policy, and with old_logp=rollout the old policy IS the sampler, so "
                    f"the weight is always 1: set algo.old_logp=recompute or algo.{name}.enabled=false",
                )
        if self.tis.enabled and self.mis.enabled and self.tis.mode == self.mis.mode == "truncate":
            raise invalid(
                "mis.mode",
                "'truncate' with algo.tis.mode=truncate; with both sections on, one ratio weighs a token "
                "and the other section contributes its mask only, so two truncations would leave one of "
                "them without effect: set algo.mis.mode=mask (or icepop), or algo.mis.enabled=false",
            )
        if self.kl.placement == "reward" and self.advantages == "gdpo":
            raise invalid(
                "kl.placement",
                "'reward' with algo.advantages=gdpo; GDPO z-scores each reward component within its group, "
                "so a penalty folded into the summed reward has no component to live in: set "
                "algo.kl.placement=loss or choose another algo.advantages",
            )
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0 + self.clip_high:
            raise invalid(
                "clip_ratio_c",
                f"{self.clip_ratio_c} must exceed 1+clip_high={1 + self.clip_high:g} (dual clip is a "
                "bound beyond the normal clip; 3.0 is the usual value) or be null",
            )
        return self


# -------------------------------------------------------------------------------------- data, rewards


class SyntheticConfig(Section):
    task: Literal["addition", "countdown", "tool_arithmetic"] = Field(
        description="Synthetic verifiable task: addition (a + b, strict <answer>N</answer>), countdown "
        "(reach a target with + - * and given numbers) or tool_arithmetic (a * b, for the calculator "
        "environment: each row carries a gold tool-use trace, which the SFT stage trains on when "
        "rollout.multi_turn is enabled)."
    )
    min_digits: int = Field(
        default=2, ge=1, description="addition, tool_arithmetic: fewest digits per operand."
    )
    max_digits: int = Field(
        default=3, ge=1, description="addition, tool_arithmetic: most digits per operand."
    )
    tool_fraction: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="tool_arithmetic: share of rows whose gold trace calls the calculator; the others answer "
        "at once, as in a cold-start set mixed from sources with and without tool use.",
    )
    reverse_answer: bool = Field(
        default=False,
        description="addition: write the sum least-significant digit first. Each output digit then depends "
        "only on digits already seen plus a carry, which a tiny transformer learns in a few hundred steps "
        "rather than thousands (Lee et al. 2023, arXiv 2307.03381).",
    )
    num_numbers: int = Field(default=3, ge=2, description="countdown: how many numbers are given.")
    max_number: int = Field(default=20, ge=2, description="countdown: numbers are drawn from 1..max_number.")
    num_train: int = Field(default=2000, ge=1, description="Number of generated training problems.")
    num_eval: int = Field(
        default=200, ge=0, description="Number of generated held-out problems (disjoint from training)."
    )
    seed: int = Field(
        default=1234,
        description="Generator seed; the same seed always gives the same problems (independent of "
        "schedule.seed so the data stay fixed while the training seed varies).",
    )

    @model_validator(mode="after")
    def _check(self) -> SyntheticConfig:
        if self.min_digits > self.max_digits:
            raise invalid("min_digits", f"{self.min_digits} exceeds max_digits={self.max_digits}")
        return self


class DataConfig(Section):
    train_path: str | None = Field(
        default=None,
        description="Training prompts: a local .jsonl or .parquet file (read offline). Exactly one of "
        "train_path and synthetic must be set.",
    )
    synthetic: SyntheticConfig | None = Field(
        default=None, description="Generate a synthetic task instead of reading train_path."
    )
    eval_path: str | None = Field(
        default=None,
        description="Held-out prompts file; null splits heldout_fraction off train_path instead.",
    )
    heldout_fraction: float = Field(
        default=0.05,
        ge=0.0,
        lt=1.0,
        description="Share of train_path held out for evaluation when eval_path is null (seeded split).",
    )
    max_eval_prompts: int = Field(
        default=256, ge=0, description="Cap on held-out prompts evaluated, to bound evaluation time."
    )
    prompt_key: str = Field(
        default="prompt",
        description="Row field with the prompt: a string, or a list of {role, content} chat messages.",
    )
    answer_key: str = Field(
        default="answer", description="Row field with the reference answer the verifiers compare against."
    )
    completion_key: str = Field(
        default="completion",
        description="Row field with the target response (SFT data only; a row with a tool-use 'trace' "
        "needs none when rollout.multi_turn is enabled: docs/agentic.md).",
    )
    prompt_template: str = Field(
        default="{prompt}",
        description="Python format string applied to a string prompt with the row's fields, e.g. "
        "'{prompt}\\nAnswer in <answer></answer> tags.'",
    )
    system_prompt: str | None = Field(
        default=None, description="System message prepended when the chat template is used; null = none."
    )
    use_chat_template: bool = Field(
        default=True,
        description="Wrap prompts with the tokenizer's chat template (with the generation prompt), as "
        "the model saw in instruction tuning. false sends the raw template text.",
    )
    max_prompt_tokens: int = Field(
        default=512,
        ge=1,
        description="Prompts longer than this (after templating) are malformed rows (see malformed).",
    )
    malformed: Literal["skip", "fatal"] = Field(
        default="skip",
        description="A malformed row (bad JSON, bytes that are not UTF-8, missing/empty field, too long) "
        "is reported with file:line, then skipped and counted (skip) or stops loading with an error (fatal).",
    )
    shuffle: bool = Field(
        default=True, description="Reshuffle the training prompts every epoch (seeded by schedule.seed)."
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if (self.train_path is None) == (self.synthetic is None):
            which = "both are set" if self.train_path else "neither is set"
            raise invalid(
                "train_path", f"set exactly one of train_path and synthetic in this data section ({which})"
            )
        return self


class RewardFnConfig(Section):
    name: str = Field(
        description="Built-in verifier (math, exact_match, format, arithmetic, countdown) or a dotted "
        "import path 'package.module:function' (or 'package.module.function') of a user reward."
    )
    weight: float = Field(default=1.0, description="Weight in the combined reward (and in GDPO's sum).")
    timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        description="Per-completion time limit; a call that exceeds it scores 0 and counts in "
        "reward/timeouts instead of stalling the step.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Options for the reward: passed to a built-in's factory, or, when non-empty, the user "
        "callable is treated as a factory and called with them to get the reward function.",
    )
    label: str | None = Field(
        default=None,
        description="Name in metrics (reward/<label>/mean); null = the built-in name or the function name.",
    )


class RewardsConfig(Section):
    functions: list[RewardFnConfig] = Field(
        default_factory=lambda: [RewardFnConfig(name="math")],
        description="Reward functions scored on every completion.",
    )
    combine: Literal["weighted", "gdpo"] = Field(
        default="weighted",
        description="weighted: reward = sum of weight * score; gdpo: keep the [n, G, K] scores and let "
        "GDPO normalise each reward within its group before weighting (needs algo.advantages=gdpo).",
    )
    num_workers: int = Field(
        default=2,
        ge=1,
        description="Reward worker threads. Verifiers are short Python calls; threads let a deadline "
        "abandon a stuck one without pickling user functions into processes.",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardsConfig:
        if not self.functions:
            raise invalid("functions", "is empty; give at least one reward function")
        labels = [f.label or f.name for f in self.functions]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise invalid("functions", f"duplicate reward names {dup}; give each a distinct label")
        return self


# ---------------------------------------------------------------------------------- optimisation, run


class OptimizerConfig(Section):
    lr: float = Field(
        default=1e-6,
        gt=0.0,
        description="Peak learning rate (RL fine-tuning uses ~1e-6 on large models). A resume may change it "
        "(and min_lr): the checkpoint's Adam moments are kept, the schedule takes the new values.",
    )
    min_lr: float = Field(default=0.0, ge=0.0, description="Floor the decay schedule ends at.")
    weight_decay: float = Field(default=0.01, ge=0.0, description="AdamW decoupled weight decay.")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], description="AdamW (beta1, beta2).")
    eps: float = Field(
        default=1e-8, gt=0.0, description="AdamW epsilon added to the second-moment root (numerical safety)."
    )
    clip_grad: float = Field(
        default=1.0, ge=0.0, description="Global grad-norm clip; 0 disables. Guards against rare huge ratios."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear LR warmup steps.")
    decay: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="LR decay after warmup. constant is the RL norm (the data distribution moves).",
    )
    distributed: bool = Field(
        default=True,
        description="megatron DistributedOptimizer: shard optimizer state across data-parallel ranks.",
    )

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise invalid("betas", f"{self.betas} must be two numbers in [0, 1)")
        if self.min_lr > self.lr:
            raise invalid("min_lr", f"{self.min_lr} exceeds lr={self.lr}")
        return self


class ScheduleConfig(Section):
    steps: int = Field(default=100, ge=1, description="Training steps (one rollout batch each).")
    micro_batch_size: int = Field(
        default=1,
        ge=1,
        description="Sequences per learner micro-batch per rank, on average: each DP rank runs "
        "ceil(its share of the mini-batch / this) micro-batches, the same count on every rank (expert "
        "parallelism needs it), so a rank holding short rows packs more of them into a micro-batch, with "
        "about the same tokens. A memory knob: no loss, gradient or metric depends on it.",
    )
    seed: int = Field(default=0, description="Seed for sampling, shuffling and init; a seeded run repeats.")
    eval_every: int = Field(
        default=10, ge=0, description="Held-out evaluation every N steps (and at start and end); 0 = never."
    )
    save_every: int = Field(
        default=50, ge=0, description="Checkpoint every N steps (and at the end); 0 = end only."
    )


class CheckpointConfig(Section):
    dir: str = Field(default="outputs/checkpoints", description="Checkpoint directory (step_N subfolders).")
    keep_last: int = Field(
        default=2, ge=1, description="Checkpoints kept; older ones are deleted after a successful save."
    )
    resume: str = Field(
        default="auto",
        description="auto: continue from the latest checkpoint in dir if any; none: start fresh; or a "
        "checkpoint path. Checked before anything starts: it must be a complete checkpoint of this model "
        "and stage (an SFT checkpoint does not resume `train`: set model.hf_path to sft.output_dir).",
    )


class HealthThresholds(Section):
    window: int = Field(
        default=5, ge=1, description="Steps per window; the last window is compared to the one before."
    )
    entropy_drop: float = Field(
        default=0.5,
        gt=0.0,
        lt=1.0,
        description="Warn 'entropy collapsing' when entropy falls below this fraction.",
    )
    length_growth: float = Field(
        default=2.0,
        gt=1.0,
        description="Warn 'length exploding' when mean response length grows by this factor.",
    )
    reward_flat_tol: float = Field(
        default=0.01, ge=0.0, description="Reward change below this counts as flat."
    )
    clip_rise: float = Field(
        default=0.05,
        ge=0.0,
        description="Warn when the clip fraction rises by this much while reward is flat.",
    )


class WandbConfig(Section):
    enabled: bool = Field(
        default=False,
        description="Also send every step's metrics to a Weights & Biases run (rank 0). Needs the wandb "
        "package; it is imported only when this is true, and a missing one fails at config validation.",
    )
    project: str = Field(default="megagrpo", description="W&B project the run is filed under.")
    entity: str | None = Field(
        default=None, description="W&B team or user owning the project; null uses the logged-in default."
    )
    name: str | None = Field(
        default=None, description="Display name of the W&B run; null lets W&B generate one."
    )
    mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None,
        description="online streams to the W&B server; offline writes the run locally for a later "
        "`wandb sync` (compute nodes without internet); disabled makes every call a no-op. null defers to "
        "the WANDB_MODE environment variable, else online. Files go to WANDB_DIR, else logging.out_dir.",
    )
    tags: list[str] = Field(default_factory=list, description="Tags attached to the W&B run, for filtering.")

    @model_validator(mode="after")
    def _check(self) -> WandbConfig:
        import importlib.util

        if self.enabled and importlib.util.find_spec("wandb") is None:
            raise invalid(
                "enabled",
                "true, but the wandb package is not installed in this Python; install it with "
                "`pip install wandb`, or set logging.wandb.enabled=false",
            )
        return self


class LoggingConfig(Section):
    out_dir: str = Field(default="outputs/run", description="Run directory: metrics, TensorBoard, report.")
    tensorboard: bool = Field(default=True, description="Write TensorBoard event files.")
    console: bool = Field(default=True, description="One-line console summary per step and a progress bar.")
    health: HealthThresholds = Field(
        default_factory=HealthThresholds, description="Training-health warning thresholds."
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig,
        description="Optional Weights & Biases sink, next to metrics.jsonl and TensorBoard.",
    )


class DiagnosticsConfig(Section):
    mismatch: bool = Field(
        default=True,
        description="Compute mismatch/ metrics (sampler vs the learner's old-policy pass) every step; "
        "cheap. Needs algo.old_logp=recompute. A tis/mis cap 'auto' measures its own quantile even when "
        "this is false.",
    )


class DistConfig(Section):
    timeout_minutes: int = Field(
        default=30,
        ge=1,
        description="Timeout of every collective (torch.distributed and megatron's groups). A rank whose "
        "peer is stuck raises after this instead of hanging; raise it when one engine's share of a step's "
        "rollout (or a checkpoint write) takes longer.",
    )


class SyncConfig(Section):
    bucket_mb: int = Field(
        default=512,
        ge=1,
        description="Weight-sync bucket size in MiB: bigger buckets mean fewer calls, smaller bound the "
        "extra memory held during sync.",
    )
    checksum: bool = Field(
        default=False,
        description="Verify after a sync that each engine holds, bit for bit, what the learner sent (SGLang's "
        "per-parameter hashes of whole tensors: rollout.engine_tp 1 only, refused at validation otherwise). "
        "It costs a hash of the model on both sides, and for a disaggregated engine a copy of the sent "
        "model held by its owner until the check.",
    )
    checksum_every: int = Field(
        default=1,
        ge=1,
        description="With checksum: verify every N-th step's sync only (the start's and a resume's always), "
        "so a large model pays the check's cost on a few steps.",
    )
    pack: bool = Field(
        default=True,
        description="CPU engine with rollout.engine_tp 1: send each bucket already in SGLang's fused "
        "parameter layout through one shared buffer (sync time linear in bytes); false sends HF-named "
        "tensors through SGLang's load_weights, for debugging or a layout the packer does not cover.",
    )


class SftConfig(Section):
    base_path: str | None = Field(
        default=None,
        description="HF model directory the SFT stage starts from; null = model.hf_path. Lets one config "
        "describe both stages: SFT base_path -> output_dir, then RL from model.hf_path = output_dir.",
    )
    steps: int = Field(
        default=0, ge=0, description="Cold-start SFT steps for `megagrpo sft`; 0 = no SFT stage."
    )
    lr: float = Field(
        default=1e-4, gt=0.0, description="SFT learning rate (higher than RL: dense supervised signal)."
    )
    batch_size: int = Field(default=32, ge=1, description="SFT sequences per step.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear LR warmup for SFT.")
    data: DataConfig | None = Field(
        default=None,
        description="SFT data (rows need data.completion_key, or a tool-use 'trace' with rollout.multi_turn); null = the main data section. Cold start "
        "uses easier problems than RL so RL has room to improve.",
    )
    output_dir: str = Field(
        default="outputs/sft", description="Where the SFT stage writes its HF model for the RL stage to load."
    )


# ------------------------------------------------------------------------------------------- the root


class Config(Section):
    """The whole run. Sections are independent except for the rules checked in `_cross_checks`."""

    model: ModelConfig = Field(description="Policy model to train.")
    mesh: MeshConfig = Field(
        default_factory=MeshConfig, description="Learner parallel layout; DP is inferred."
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="SGLang sampling.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="Objective, advantages and corrections.")
    replay: Literal["none", "R2", "R3"] = Field(
        default="none",
        description="MoE routing replay: none; R2 replays the learner's old-pass routes in training; R3 "
        "replays the sampler's routes (removes routing mismatch). MoE configs use R3; a dense model refuses "
        "R2/R3.",
    )
    data: DataConfig = Field(
        default_factory=lambda: DataConfig(synthetic=SyntheticConfig(task="addition")),
        description="Prompt set, held-out split and templating.",
    )
    rewards: RewardsConfig = Field(
        default_factory=RewardsConfig, description="Verifiers and how they combine."
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW and LR schedule.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Steps, seeds and cadence.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints and resume."
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig, description="Metric sinks and health warnings."
    )
    diagnostics: DiagnosticsConfig = Field(
        default_factory=DiagnosticsConfig, description="Train/inference mismatch measurement."
    )
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Learner -> SGLang weight sync.")
    dist: DistConfig = Field(default_factory=DistConfig, description="Process groups and collectives.")
    sft: SftConfig = Field(default_factory=SftConfig, description="Cold-start SFT stage.")

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        algo, rollout = self.algo, self.rollout
        if algo.advantages in GROUP_ADVANTAGES and rollout.group_size < 2:
            raise invalid(
                "rollout.group_size",
                f"{rollout.group_size} is below 2; group-relative advantages ({algo.advantages!r}) compare "
                "each completion with the others of its prompt, so use group_size >= 2",
            )
        if (algo.advantages == "gdpo") != (self.rewards.combine == "gdpo"):
            raise invalid(
                "rewards.combine",
                f"{self.rewards.combine!r} with algo.advantages={algo.advantages!r}; GDPO needs both "
                "rewards.combine=gdpo and algo.advantages=gdpo",
            )
        if algo.agg == "seq-mean-token-sum-norm" and algo.agg_constant is None:
            algo.agg_constant = float(rollout.response_tokens)
        so = algo.soft_overlong
        if so.max_len is None:
            so.max_len = rollout.response_tokens
        if so.enabled and so.max_len > rollout.response_tokens:
            limit = (
                f"rollout.multi_turn.max_tokens={rollout.response_tokens}"
                if rollout.multi_turn.enabled
                else f"rollout.max_new_tokens={rollout.max_new_tokens}"
            )
            raise invalid(
                "algo.soft_overlong.max_len", f"{so.max_len} exceeds {limit}; responses never get that long"
            )
        if so.enabled and so.cache_len >= so.max_len:
            raise invalid(
                "algo.soft_overlong.cache_len", f"{so.cache_len} must be below max_len={so.max_len}"
            )
        if self.diagnostics.mismatch and algo.old_logp == "rollout":
            raise invalid(
                "diagnostics.mismatch",
                "true with algo.old_logp=rollout; the mismatch metrics compare a learner pass with the "
                "sampler, and old_logp=rollout skips that pass: set diagnostics.mismatch=false or "
                "algo.old_logp=recompute",
            )
        if rollout.mode == "async" and algo.old_logp != "recompute":
            raise invalid(
                "algo.old_logp",
                "rollout with rollout.mode=async; asynchronous samples come from an older policy, and "
                "the decoupled objective clips against the recomputed learner pass (the proximal "
                "policy) while TIS/MIS weighs the lag against the sampler: set algo.old_logp=recompute",
            )
        mt = rollout.multi_turn
        if mt.enabled and mt.reward == "environment" and self.rewards.combine == "gdpo":
            raise invalid(
                "rollout.multi_turn.reward",
                "environment with rewards.combine=gdpo; GDPO normalises each reward function's scores, and "
                "an environment gives one reward: set rollout.multi_turn.reward=functions or use "
                "rewards.combine=weighted",
            )
        if self.sync.checksum and rollout.engine_tp > 1:
            # Both transports (sync.checksums.verify_checksum, sync.broadcast.verify_remote) compare TP rank
            # 0's hashes with the full tensors sent: a TP engine holds shards, so the check cannot hold.
            raise invalid(
                "sync.checksum",
                f"true with rollout.engine_tp={rollout.engine_tp}; an engine with TP > 1 holds each "
                "parameter as shards, and the checksum compares whole tensors: set sync.checksum=false or "
                "rollout.engine_tp=1",
            )
        n_seqs = rollout.prompts_per_step * rollout.group_size
        if n_seqs % algo.ppo_mini_batches:
            raise invalid(
                "algo.ppo_mini_batches",
                f"{algo.ppo_mini_batches} does not divide the batch of {n_seqs} sequences "
                f"(rollout.prompts_per_step * rollout.group_size)",
            )
        return self


# ---------------------------------------------------------------------------------------------- mesh


@dataclass(frozen=True)
class MeshSizes:
    """Sizes derived from the mesh and the world size."""

    world_size: int
    dp: int  # data-parallel size: world / (tp * pp * cp)
    expert_dp: int  # expert data-parallel size: world / (ep * etp * pp)
    num_engines: int  # SGLang engines (mesh_rules.engine_count; 0 for sft: no engine)
    seqs_per_rank_per_minibatch: int  # train: one mini-batch's rows per DP rank; sft: one step's
    learners: int = 0  # the learner's ranks: world_size less the engine-only ranks
    engine_ranks: int = 0  # rollout.placement.kind=disaggregated: ranks that run engines only


STAGES = ("train", "sft", "eval")


def check_mesh(cfg: Config, world_size: int, stage: str = "train", *, on_gpu: bool = True) -> MeshSizes:
    """The mesh, the engine count and the batch split against the world size; infers DP. `on_gpu`: the
    job runs on GPUs (its engine count is world / engine_tp), else on CPUs (`rollout.num_engines`).

    Runs for every entry point (train, sft, eval, submit) before any process group or engine starts. The
    batch must split evenly over DP: the learner gives each rank whole sequences, the same number of
    micro-batches on every rank (`learner.row_plan.micro_batch_count`, which EP's all-to-alls need), and
    a split by tokens that still gives every rank at least that many sequences.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    m = cfg.mesh
    r = cfg.rollout
    roles = Roles(world_size, 0, 0)  # sft: every rank learns, no engine
    if stage != "sft":
        roles = rank_roles(
            world_size, r.engine_tp, r.num_engines, disaggregated=r.placement.disaggregated, on_gpu=on_gpu
        )
    split = mesh_sizes(roles.learners, tp=m.tp, pp=m.pp, ep=m.ep, etp=m.etp, cp=m.cp)
    dp = split.dp
    engines = roles.engines
    if stage == "train" and on_gpu and r.mode == "async" and not r.placement.disaggregated:
        raise MegagrpoError(
            "rollout.mode=async on GPUs needs engines on devices of their own: set "
            "rollout.placement.kind=disaggregated (and rollout.num_engines), or use rollout.mode=colocated "
            "(docs/disaggregated.md)"
        )
    per_rank = 0
    if stage == "train":
        n_seqs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        per_mb = n_seqs // cfg.algo.ppo_mini_batches
        what = (
            f"a mini-batch of {per_mb} sequences (rollout.prompts_per_step * rollout.group_size / "
            "algo.ppo_mini_batches)"
        )
    elif stage == "sft":
        per_mb, what = cfg.sft.batch_size, f"an SFT step of {cfg.sft.batch_size} sequences (sft.batch_size)"
    if stage in ("train", "sft"):
        if dp > per_mb:
            raise MegagrpoError(
                f"mesh: data parallelism would be {dp} ranks, more than the mesh can use: {what} gives "
                f"at most {per_mb} ranks a sequence; use fewer processes (at most {per_mb * (roles.learners // dp) + roles.engine_ranks}), "
                "a larger batch, or larger mesh.tp/pp/cp"
            )
        if per_mb % dp:
            raise MegagrpoError(f"mesh: {what} does not split over DP={dp} ranks; make it a multiple of {dp}")
        per_rank = per_mb // dp
    return MeshSizes(
        world_size=world_size,
        dp=dp,
        expert_dp=split.expert_dp,
        num_engines=engines,
        learners=roles.learners,
        engine_ranks=roles.engine_ranks,
        seqs_per_rank_per_minibatch=per_rank,
    )
