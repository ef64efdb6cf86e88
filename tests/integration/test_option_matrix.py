"""The option matrix: every shipped config and every algorithm option value runs 2 real training steps.

Each case goes through `megagrpo.cli.main` (argument parsing, config loading and validation, the trainer
entry) in this process, one case after another, with a tiny model of the config's family in place of
its model and small batch sizes. Every shipped config is a case, the families' too: Moonlight, DeepSeek-V3
and Kimi-K2 on the tiny deepseek_v3 (MLA with a q latent, sigmoid group-limited router with a correction
bias, a shared expert, a dense first layer, one multi-token-prediction layer as DeepSeek-V3 and GLM-4.5
ship), GLM-4.5-Air on the tiny glm4_moe (its MTP layer too), and the calculator demo
(its SFT stage, then multi-turn RL) on the tiny deepseek_v3. Their GPU-scale settings (meshes, node and
engine counts, engine memory share) are replaced by the one-process sizes of every case (`size_overrides`),
and what the CPU cannot run is overridden in the case with the reason (the FP8 sampler, engines on ranks
of their own); the algorithm runs as shipped. Options are combined into few runs (a covering design: each case
carries one policy variant plus a different advantage method, TIS/MIS level/mode/cap, KL estimator,
replay mode, ...). `test_cases_cover_every_option_value` checks, from the validated config of every case,
that the union of cases covers every allowed value of every option in `OPTIONS`, with the allowed
values read from the schema's Literal/bool types: a new value in the schema without a case fails it.

README.md's and docs/'s one-process `megagrpo train` commands are cases too (`doc_<file>:<line>`, issue 43),
read from the text (tests/fixtures/doc_commands.py) and run as written after the size overrides, on their
config's pooled engine; their `megagrpo sft` commands are the SFT stages' own words. What such a run must
show is `doc_problems`: the options it writes are the docs' choice, not a covering design's.

What each run must show is derived from its own validated config (`run_problems`): two logged steps
that trained with a finite loss, and for each active option its signature in metrics.jsonl (the TIS/MIS
fractions of its level and mode, the adaptive cap, the KL term, replay counters, RSPO gamma, ...).

Engine start-up (SGLang's scheduler processes, ~20 s idle, minutes on a loaded machine) dominates a
2-step run, so the SGLang engines are pooled per (architecture, engine settings), one per family
(`test_each_family_started_one_engine`): a case's engine is a previous case's, given back the case's
initial weights from its HF directory with `update_weights_from_disk` (what a fresh engine would load).
The cases run grouped by engine (`RUN_ORDER`) and only the current one is kept alive: each is sized as
a share of this machine's RAM (`rollout.mem_fraction_static`). Everything else, the learner, the trainer, rewards, sync, is built anew
per case. A case that fails drops its engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import BaseModel
from safetensors.torch import load_file

from megagrpo.bridge.hf_io import HFCheckpoint, mtp_layer_prefixes
from megagrpo.config.loader import load_config
from megagrpo.config.schema import Config
from tests.fixtures.doc_commands import DocCommand, commands
from tests.fixtures.qwen3 import qwen3_model_dir
from tests.integration.engine_pool import EnginePool

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
PARITY = {"name": "tests.integration.trainer_rewards:output_parity", "weight": 0.5}
STEPS = 2

# ------------------------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: str  # a file under configs/
    family: str  # tiny model family standing in for the config's model
    options: tuple[str, ...] = ()  # dotted overrides that select options (beyond the size overrides)
    doc: DocCommand | None = None  # a command of the docs: its own overrides and options, after the sizes
    fault: str | None = None  # MEGAGRPO_FAULT_INJECT of the run (`rollout.engines.faults`): it ends early


# SGLang's FP8 kernels need CUDA: the engine refuses rollout.fp8 on the CPU (`RolloutEngine`).
NO_FP8 = "rollout.fp8=false"

# Every case samples in bf16 against the fp32 learner (`rollout.dtype: auto` on a GPU): a real mismatch,
# so TIS/MIS masks and truncation have ratios to act on.
CASES = (
    # The shipped configs, options as shipped.
    Case("config_reference", "reference.yaml", "qwen3_moe"),
    Case("config_grpo_math_dense", "grpo_math_dense.yaml", "qwen3"),
    Case("config_countdown_gdpo", "countdown_qwen3_moe_gdpo.yaml", "qwen3_moe"),
    Case("config_demo", "demo_qwen3_moe.yaml", "qwen3_moe"),  # RL stage, from the SFT case's model
    # Multi-turn with the sandboxed python tool on Qwen3's own chat template (tests/fixtures/qwen3.py), with
    # thinking on and the qwen3 reasoning parser as shipped: each 8-token turn is cut inside its reasoning
    # (issue 36: the template never re-renders it, nothing is run or scored from it), and counted. Scored by
    # the final message (a random model never earns the environment's reward); that message has no content
    # (all reasoning), so every reward is equal and no group would survive dynamic sampling: the steps
    # train their zero-advantage batches. The environment, parsers and limits are as shipped.
    Case(
        "config_agentic_python",
        "agentic_python_qwen3_moe.yaml",
        "qwen3_moe_think",
        # a random model never calls a tool, so no trajectory is truncated for the shipped filter to drop
        ("rollout.multi_turn.reward=functions", "algo.overlong_filter=false", "algo.dynamic_sampling=false"),
    ),
    # The calculator demo as a user runs it: its RL stage from its own SFT stage on tool traces, on
    # DeepSeek-V3's family (multi-turn over MLA's latent KV cache, R3 per turn on a sigmoid, group-limited
    # router; Qwen3-MoE keeps multi-turn R3 in the python case, SFT in the demo's). Two SFT steps teach no
    # arithmetic, so the environment's reward would be 0 for every sample and no group kept: scored by the
    # final message, like the python case.
    Case(
        "config_agentic_calculator",
        "agentic_calculator.yaml",
        "deepseek_v3",
        ("rollout.multi_turn.reward=functions",),
    ),
    # The families' configs (issue 37), GSPO + R3 + TIS(auto) as shipped, on one pooled engine per family.
    # DeepSeek-V3's tiny model has the q latent DeepSeek-V3 and Kimi-K2 ship; Moonlight's q_lora_rank null
    # (a full q projection) trains on the same loop in test_trainer_e2e's family run, and would cost an
    # engine of its own here (other weight shapes).
    Case("config_gspo_math_moonlight", "gspo_math_moonlight.yaml", "deepseek_v3"),
    Case("config_gspo_math_deepseek_v3", "gspo_math_deepseek_v3.yaml", "deepseek_v3", (NO_FP8,)),
    Case(
        "config_gspo_math_kimi_k2",
        "gspo_math_kimi_k2.yaml",
        "deepseek_v3",
        (
            NO_FP8,
            # engines on ranks of their own need a launch of several processes (test_disaggregated's)
            "rollout.placement.kind=colocated",
            "rollout.num_engines=null",
        ),
    ),
    Case("config_gspo_math_glm45_air", "gspo_math_glm45_air.yaml", "glm4_moe"),
    # One case per remaining policy variant, each carrying other options. Two run on a family's pooled
    # engine at no extra start: RSPO's router shift on GLM-4.5's sigmoid router (Qwen3-MoE's softmax one
    # has it in the countdown config) and R2 on DeepSeek-V3's MLA model (Qwen3-MoE's in gspo_token).
    Case(
        "gspo_token",
        "reference.yaml",
        "qwen3_moe",
        (
            "algo.variant=gspo_token",
            "algo.advantages=dr_grpo",
            "algo.agg=seq-mean-token-sum",
            "algo.overlong_filter=true",
            "rollout.stop=[e]",  # ~1 in 4 tokens holds an 'e': most responses stop, some are truncated
            "algo.tis={enabled: true, level: sequence, mode: mask, cap: 3.0}",
            "algo.mis={enabled: true, level: geometric, mode: truncate, cap: auto, auto: {quantile: 0.97}}",
            "algo.kl={coef: 0.05, estimator: k1}",
            "replay=R2",
        ),
    ),
    Case(
        "gmpo",
        "reference.yaml",
        "glm4_moe",
        (
            "algo.variant=gmpo",
            "algo.advantages=rloo",
            "algo.agg=seq-mean-token-sum-norm",
            "algo.dynamic_sampling=false",
            "algo.tis={enabled: true, level: geometric, mode: truncate, cap: 1.5}",
            "algo.mis={enabled: true, level: token, mode: icepop, cap: 1.05, cap_low: 0.95}",
            "algo.kl={coef: 0.05, estimator: k2}",
            "algo.router_shift=true",
            "replay=none",
        ),
    ),
    Case(
        "cispo",
        "reference.yaml",
        "qwen3_moe",
        (
            "algo.variant=cispo",
            "algo.advantages=batch_std",
            "algo.tis={enabled: true, level: token, mode: icepop, cap: auto, auto: {quantile: 0.99}}",
            "algo.mis={enabled: true, level: sequence, mode: mask, cap: 2.0}",
            "algo.kl={coef: 0.05, estimator: k3, placement: reward}",
            "diagnostics.mismatch=false",
            "replay=R3",
        ),
    ),
    Case(
        "sapo",
        "reference.yaml",
        "deepseek_v3",
        (
            "algo.variant=sapo",
            "algo.advantages=rank",
            "algo.agg=seq-mean-token-mean",
            "algo.tis={enabled: true, level: sequence, mode: truncate, cap: 2.0}",
            "algo.mis={enabled: true, level: token, mode: mask, cap: auto}",
            "algo.kl={coef: 0.05, estimator: low_var_kl, placement: reward}",
            "algo.soft_overlong={enabled: true, cache_len: 4}",
            "replay=R2",
            "dist.timeout_minutes=5",
        ),
    ),
    Case(
        "reinforce",
        "reference.yaml",
        "qwen3_moe",
        (
            "algo.variant=reinforce",
            "algo.old_logp=rollout",
            "diagnostics.mismatch=false",
            "algo.dynamic_sampling=false",
            "algo.kl={coef: 0.05, estimator: k3, placement: reward}",
            "replay=R3",
        ),
    ),
    # Issue 45: the dense config through `megagrpo train` with its engine's scheduler signalled by pid in the
    # middle of step 2's round (`rollout.engines.faults`). With a restart budget, SIGKILL and SIGSTOP: the
    # watch finds it (a stop within probe_deadline_s), the engine is replaced, given the learner's weights
    # and the round again: the completions (ids, sampler logprobs, finish reasons), rewards and lengths of
    # the run without the fault (run once, first), the other metrics within the last bits
    # (`_assert_engine_replaced`). Without one: exit ENGINE_LOST_EXIT_CODE with step 1 checkpointed, never a
    # hang (`_assert_engine_loss_detected`). Last of their engine's cases (`RUN_ORDER`): the lost engine is
    # the one the pool ends, and only the replacements cost a start.
    Case(
        "fault_engine_killed",
        "grpo_math_dense.yaml",
        "qwen3",
        ("rollout.fault_tolerance={max_restarts: 1, probe_interval_s: 0.5, probe_deadline_s: 3.0}",),
        fault="kill@step1",
    ),
    Case(
        "fault_engine_stopped",
        "grpo_math_dense.yaml",
        "qwen3",
        ("rollout.fault_tolerance={max_restarts: 1, probe_interval_s: 0.5, probe_deadline_s: 3.0}",),
        fault="stop@step1",
    ),
    Case(
        "fault_engine_lost",
        "grpo_math_dense.yaml",
        "qwen3",
        (
            "schedule.save_every=1",
            "rollout.fault_tolerance={max_restarts: 0, probe_interval_s: 0.5, probe_deadline_s: 3.0}",
        ),
        fault="stop@step1",
    ),
)


# The one-process `megagrpo train` commands of README.md and docs/*.md (tests/fixtures/doc_commands.py), each a
# case on its config's pooled engine, as written but for the size overrides (issue 43). Where a command
# writes CONFIG, README's own example configs stand in: the calculator's for an agent, else the demo's.
# Their `megagrpo sft` commands are the SFT stages below (`sft_stages`).
AGENT = "rollout.multi_turn.agent."
DOC_FAMILY = {"demo_qwen3_moe.yaml": "qwen3_moe", "agentic_calculator.yaml": "deepseek_v3"}  # as the cases


def doc_config(cmd: DocCommand) -> str:
    return (
        "configs/agentic_calculator.yaml"
        if any(AGENT in w for w in cmd.words)
        else "configs/demo_qwen3_moe.yaml"
    )


def doc_argv(cmd: DocCommand) -> list[str]:
    """The command's words after `megagrpo`, placeholders replaced (`PLACEHOLDERS`)."""
    return cmd.argv({"CONFIG": doc_config(cmd), "my_pkg.agent": "tests.integration.command_agent"})[1:]


def doc_family(cmd: DocCommand) -> str:
    """The tiny model family of a doc command's config: the one its config's own case runs on."""
    config = Path(doc_argv(cmd)[1]).name
    assert config in DOC_FAMILY, f"{cmd.where}: {config} has no family in DOC_FAMILY (add its case's)"
    return DOC_FAMILY[config]


DOC_SFT = {Path(doc_argv(c)[1]).name: c for c in commands("one process") if c.words[1] == "sft"}
# An agent's reward is the calculator's, 0 for every sample of a model that never learned the task: no group
# would survive dynamic sampling, and no step would train.
DOC_OPTIONS = {"agentic_calculator.yaml": ("algo.dynamic_sampling=false",)}
DOC_CASES = tuple(
    Case(
        f"doc_{c.where}",
        Path(doc_argv(c)[1]).name,
        doc_family(c),
        DOC_OPTIONS.get(Path(doc_argv(c)[1]).name, ()),
        doc=c,
    )
    for c in commands("one process")
    if c.words[1] == "train"
)
CASES += DOC_CASES


def engine_of(case: Case) -> str:
    """The pooled engine a case runs on: one per architecture (Qwen3's chat template is only a tokenizer)."""
    return {"qwen3_moe_think": "qwen3_moe"}.get(case.family, case.family)


# The cases grouped by engine, otherwise in CASES' order: the pool keeps one engine alive (`pool`). A fault
# case ends its engine, so it runs last of its group.
_ENGINES = list(dict.fromkeys(engine_of(c) for c in CASES))
RUN_ORDER = sorted(CASES, key=lambda c: (_ENGINES.index(engine_of(c)), c.fault is not None))

# Shipped configs whose RL stage starts from the model of their own SFT stage (`megagrpo sft` on the file,
# from the tiny model of the case's family).
SFT_CONFIGS = {
    c.config: c.family for c in CASES if c.config in ("demo_qwen3_moe.yaml", "agentic_calculator.yaml")
}

# (option path -> how its values are read). The allowed values come from the schema (`allowed_values`);
# a value counts for a case only where the option is active (`ACTIVE_WHEN`).
OPTIONS = (
    "algo.variant",
    "algo.advantages",
    "algo.agg",
    "algo.kl.estimator",
    "algo.kl.placement",
    "algo.tis.level",
    "algo.tis.mode",
    "algo.tis.cap",
    "algo.tis.auto.quantile",
    "algo.mis.level",
    "algo.mis.mode",
    "algo.mis.cap",
    "algo.mis.auto.quantile",
    "algo.old_logp",
    "replay",
    "algo.router_shift",
    "algo.dynamic_sampling",
    "algo.overlong_filter",
    "algo.soft_overlong.enabled",
    "algo.tis.enabled",
    "algo.mis.enabled",
    "diagnostics.mismatch",
)
ACTIVE_WHEN = {
    "algo.kl.": lambda c: c.algo.kl.coef > 0,
    "algo.tis.auto.": lambda c: c.algo.tis.enabled and c.algo.tis.cap == "auto",
    "algo.mis.auto.": lambda c: c.algo.mis.enabled and c.algo.mis.cap == "auto",
    "algo.tis.": lambda c: c.algo.tis.enabled,
    "algo.mis.": lambda c: c.algo.mis.enabled,
}
# Literal/bool options under these sections that are deliberately not in OPTIONS, with the reason.
NOT_COVERED: dict[str, str] = {}


def _field(path: str):
    """The pydantic FieldInfo of a dotted schema path."""
    model: type[BaseModel] = Config
    *parents, leaf = path.split(".")
    for p in parents:
        model = _section(model.model_fields[p].annotation)
    return model.model_fields[leaf]


def _section(ann) -> type[BaseModel]:
    for a in _members(ann):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    raise TypeError(f"{ann} is not a section")


def _members(ann) -> list:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(ann) for m in _members(a)]
    return [ann]


def allowed_values(path: str) -> set:
    """The values a case can give `path`, from the schema: Literal members, both booleans, 'fixed' for a
    number beside a Literal ('auto' caps), 'default'/'other' for the auto-cap quantile."""
    if path.endswith(".auto.quantile"):
        return {"default", "other"}
    out: set = set()
    for m in _members(_field(path).annotation):
        if typing.get_origin(m) is typing.Literal:
            out.update(typing.get_args(m))
        elif m is bool:
            out.update({False, True})
        elif m in (int, float):
            out.add("fixed")
        elif m is type(None):
            continue
        else:
            raise TypeError(f"{path}: no value classes for {m}")
    return out


def value_class(cfg: Config, path: str):
    """The class of `path`'s value in `cfg` (see `allowed_values`); None where the option is inactive."""
    for prefix, active in ACTIVE_WHEN.items():
        if path.startswith(prefix) and not path.endswith(".enabled") and not active(cfg):
            return None
    node = cfg
    for p in path.split("."):
        node = getattr(node, p)
    if path.endswith(".auto.quantile"):
        return "default" if node == _field(path).default else "other"
    if isinstance(node, float | int) and not isinstance(node, bool):
        return "fixed"
    return node


def literal_options(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every Literal- or bool-typed field under algo, replay and diagnostics (what OPTIONS must list)."""
    out = []
    for name, info in model.model_fields.items():
        path = prefix + name
        if not prefix and name not in ("algo", "replay", "diagnostics"):
            continue
        members = _members(info.annotation)
        sections = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if sections:
            out += literal_options(sections[0], path + ".")
        elif any(typing.get_origin(m) is typing.Literal or m is bool for m in members):
            out.append(path)
    return out


# ------------------------------------------------------------------------------------ running a case


def size_overrides(tmp: Path, model: Path) -> list[str]:
    """A tiny model, a tiny batch, 2 steps, single process, outputs under `tmp`."""
    return [
        f"model.hf_path={model}",
        "mesh={tp: 1, pp: 1, ep: 1, etp: 1, cp: 1, sequence_parallel: false}",
        "rollout.engine_tp=1",
        # on the CPU a share of this machine's RAM, which a GPU config's share of a 141 GiB GPU does not fit;
        # one value for every case, so that a family's configs share one pooled engine
        "rollout.mem_fraction_static=0.5",
        "rollout.dtype=bfloat16",
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=8",
        "rollout.max_total_tokens=4096",
        "algo.soft_overlong.cache_len=4",  # the ramp scaled with max_new_tokens (inert when disabled)
        f"schedule.steps={STEPS}",
        "schedule.micro_batch_size=8",
        "schedule.eval_every=0",
        "schedule.save_every=0",
        f"checkpoint.dir={tmp / 'ckpt'}",
        f"logging.out_dir={tmp / 'run'}",
        "logging.tensorboard=false",
        "logging.console=false",
    ]


def data_overrides(shipped: dict, tmp: Path) -> list[str]:
    data = shipped.get("data", {})
    if data.get("train_path"):  # a prompt file: a small math set in its place
        rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(8) for b in range(4)]
        path = tmp / "math.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return [f"data.train_path={path}", f"data.eval_path={path}"]
    return ["data.synthetic.num_train=64", "data.synthetic.num_eval=4"]


def reward_override(shipped: dict) -> str:
    """The config's own rewards plus one that varies across a random model's samples, so that groups
    survive dynamic sampling and every step trains (a tiny random model never solves the task)."""
    fns = shipped.get("rewards", {}).get("functions") or [{"name": "math"}]
    return "rewards.functions=" + json.dumps([*fns, PARITY])


def case_overrides(case: Case, tmp: Path, model: Path) -> list[str]:
    shipped = yaml.safe_load((CONFIGS / case.config).read_text()) or {}
    return [
        *size_overrides(tmp, model),
        *data_overrides(shipped, tmp),
        reward_override(shipped),
        *case.options,
        *(doc_args(case.doc).overrides if case.doc else ()),
    ]


def doc_args(cmd: DocCommand):
    """The doc command's arguments as the CLI parses them (its config, overrides, --resume)."""
    from megagrpo.cli import build_parser

    args = build_parser().parse_args(doc_argv(cmd))
    assert (REPO / args.config).resolve() == (CONFIGS / Path(args.config).name).resolve(), args.config
    return args


def case_argv(case: Case, tmp: Path, model: Path) -> list[str]:
    """`megagrpo train` of a case: its config and overrides; a doc command's own options too."""
    flags = []
    if case.doc and doc_args(case.doc).resume:
        flags = ["--resume", doc_args(case.doc).resume]
    return ["train", str(CONFIGS / case.config), *case_overrides(case, tmp, model), *flags]


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# Logged by every multi-turn step (docs/metrics.md), whether or not the model called a tool.
MULTI_TURN_METRICS = (
    "rollout/tool_calls_per_traj",
    "rollout/malformed_calls",
    "rollout/truncated_max_turns_frac",
    "rollout/truncated_max_tokens_frac",
    "rollout/env_token_frac",
    "rollout/cut_turns_frac",
    "rollout/cut_in_reasoning_frac",
)


def run_problems(cfg: Config, recs: list[dict]) -> list[str]:
    """What the run's metrics fail to show of its config: every step trained with a finite loss, and each
    active option's signature. Empty when the run did what its config asks."""
    a = cfg.algo
    bad: list[str] = []
    steps = [r["step"] for r in recs]
    if steps != list(range(1, STEPS + 1)):
        return [f"logged steps {steps}, expected 1..{STEPS}"]

    def need(cond: bool, what: str, step: int) -> None:
        if not cond:
            bad.append(f"step {step}: {what}")

    for r in recs:
        s = r["step"]
        get = r.get
        need(get("rollout/skipped_step") == 0, "no update (rollout/skipped_step != 0)", s)
        for k in ("loss/total", "loss/policy", "loss/grad_norm", "adv/mean", "adv/std", "reward/mean"):
            need(_finite(get(k)), f"{k}={get(k)} is not finite", s)
        need(get("loss/update_skipped", 0) == 0, "the optimizer skipped the update", s)
        # Every response token is a loss token, except those of truncated responses under the overlong
        # filter (a truncated response has exactly max_new_tokens); mini-batches split them.
        n, trunc = get("rollout/completions", 0), get("rollout/truncated_frac", 0)
        expect = round(n * get("rollout/response_len_mean", 0))
        if a.overlong_filter:
            expect -= round(trunc * n) * cfg.rollout.max_new_tokens
            need(0 < trunc < 1, f"overlong filter: truncated_frac={trunc}, nothing to tell apart", s)
        expect /= a.ppo_mini_batches  # loss/ metrics are means over the step's optimizer steps
        need(
            expect > 0 and get("loss/tokens") == expect, f"loss/tokens={get('loss/tokens')}, not {expect}", s
        )
        # Group-centred estimators. With KL in the reward, a group of equal rewards differs only by its
        # tiny KL penalties, and float32 centring then leaves a visible mean: checked where it cannot.
        centred = a.advantages in ("grpo", "dr_grpo", "rloo", "batch_std")
        if centred and not (a.kl.coef > 0 and a.kl.placement == "reward"):
            need(abs(get("adv/mean", 1)) < 1e-4, f"{a.advantages}: adv/mean={get('adv/mean')} is not 0", s)
        # Dynamic sampling: off means one round and nothing dropped.
        rounds, dropped = get("rollout/dynamic_rounds"), get("rollout/dynamic_dropped_frac")
        if a.dynamic_sampling:
            need(_finite(rounds) and rounds >= 1 and _finite(dropped), "dynamic sampling counters", s)
        else:
            need(rounds == 1 and dropped == 0, f"dynamic sampling off: rounds={rounds} dropped={dropped}", s)
        # Old-policy log-probs: a recompute repeats the first training forward (ratio 1 when the step
        # makes one update); the sampler's carry the bf16-vs-fp32 mismatch.
        lo, hi = get("loss/ratio_min"), get("loss/ratio_max")
        if a.old_logp == "recompute" and a.ppo_mini_batches == a.ppo_epochs == 1:
            need(abs(lo - 1) < 1e-4 and abs(hi - 1) < 1e-4, f"recompute: ratio in [{lo}, {hi}], not 1", s)
        else:
            need(lo != 1 or hi != 1, "old_logp=rollout: every ratio is exactly 1", s)
        need(
            ("mismatch/kl_sampler_learner_k3" in r) == cfg.diagnostics.mismatch,
            f"diagnostics.mismatch={cfg.diagnostics.mismatch} but mismatch/kl_sampler_learner_k3 "
            f"{'absent' if cfg.diagnostics.mismatch else 'logged'}",
            s,
        )
        for name, spec in (("tis", a.tis), ("mis", a.mis)):
            bad += [f"step {s}: {p}" for p in _correction_problems(name, spec, r)]
        if a.kl.coef > 0:
            kl = get("loss/kl")
            need(_finite(kl), f"kl: loss/kl={kl}", s)
            if s == STEPS:  # the policy moved away from the reference in step 1
                need(kl != 0 and (a.kl.estimator == "k1" or kl > 0), f"{a.kl.estimator}: loss/kl={kl}", s)
        else:
            need("loss/kl" not in r, "loss/kl logged without a KL term", s)
        shaped = a.kl.coef > 0 and a.kl.placement == "reward"
        pen = get("reward/kl_penalty_mean")
        need(_finite(pen) if shaped else pen is None, f"kl placement: reward/kl_penalty_mean={pen}", s)
        if shaped and s == STEPS:
            need(pen != 0 and (a.kl.estimator == "k1" or pen > 0), f"kl in reward: penalty {pen}", s)
        if cfg.replay in ("R2", "R3"):
            for k in ("moe/replay_unconsumed", "moe/replay_reused", "moe/replay_fallback_tokens"):
                need(get(k) == 0, f"replay {cfg.replay}: {k}={get(k)}", s)
        else:
            need("moe/replay_unconsumed" not in r, "replay counters without replay", s)
        if cfg.replay == "R3" and a.old_logp == "recompute":  # the agreement is measured in the old pass
            agr = get("moe/agreement_rollout_old")
            need(_finite(agr) and agr > 0.9, f"R3: moe/agreement_rollout_old={agr}", s)
        if cfg.rollout.multi_turn.enabled:
            turns, unscored = get("rollout/turns_mean"), get("rollout/unscored_frac")
            need(_finite(turns) and turns >= 1 and _finite(unscored), f"multi-turn: turns_mean={turns}", s)
            absent = [k for k in MULTI_TURN_METRICS if not _finite(get(k))]
            need(not absent, f"multi-turn: missing or non-finite {absent}", s)
            # CI's root has every capability: no call may run without the sandbox's isolation or be cut
            lost = {k: get(k) for k in ("rollout/sandbox_unisolated_calls", "rollout/tool_interrupted")}
            need(set(lost.values()) == {0.0}, f"multi-turn: {lost}", s)
            need(get("rollout/template_breaks") == 0, f"template breaks: {get('rollout/template_breaks')}", s)
            if cfg.rollout.multi_turn.reasoning_parser and cfg.rollout.max_new_tokens <= 8:
                # a random model's 8-token turns stop at the limit, inside the reasoning they start in
                cut = get("rollout/cut_in_reasoning_frac")
                need(_finite(cut) and cut > 0.5, f"reasoning: rollout/cut_in_reasoning_frac={cut}", s)
        if a.router_shift:
            g = get("moe/router_shift_gamma_mean")
            need(_finite(g) and 0 < g <= 1, f"router_shift: moe/router_shift_gamma_mean={g}", s)
    return bad


def doc_problems(cfg: Config, recs: list[dict]) -> list[str]:
    """What a doc command's run must show, whatever options it writes: every step logged and trained with
    a finite loss; with an agent, every session answered (none raised, timed out or sent no request)."""
    steps = [r["step"] for r in recs]
    if steps != list(range(1, STEPS + 1)):
        return [f"logged steps {steps}, expected 1..{STEPS}"]
    bad = []
    for r in recs:
        if not (_finite(r.get("loss/total")) and r.get("loss/tokens", 0) > 0):
            bad.append(
                f"step {r['step']}: loss/total={r.get('loss/total')} loss/tokens={r.get('loss/tokens')}"
            )
        agent = cfg.rollout.multi_turn.agent
        if agent.function or agent.command:
            failed = {
                k: r.get(f"rollout/{k}") for k in ("agent_errors", "agent_timeouts", "agent_no_request")
            }
            if set(failed.values()) != {0.0}:
                bad.append(f"step {r['step']}: agent sessions {failed}")
    return bad


def _correction_problems(name: str, spec, r: dict) -> list[str]:
    """TIS/MIS signature: fractions that match the level and mode, and the cap rule."""
    p = f"mismatch/{'is' if name == 'tis' else 'mis'}_"
    cap_key = f"mismatch/{name}_cap"
    if not spec.enabled:
        return [f"{name} off but {p}weight_mean logged"] if f"{p}weight_mean" in r else []
    bad = []
    keys = ("weight_mean", "frac_zero_weight", "frac_token_above_cap", "frac_token_below_floor")
    keys += ("frac_seq_above_cap", "frac_seq_veto")
    missing = [p + k for k in keys if not _finite(r.get(p + k))]
    if missing:
        return [f"{name}: missing or non-finite {missing}"]
    if spec.level == "token" and (r[p + "frac_seq_above_cap"] or r[p + "frac_seq_veto"]):
        bad.append(f"{name} level token: sequence fractions {r[p + 'frac_seq_above_cap']}")
    if spec.level != "token" and (r[p + "frac_token_above_cap"] or r[p + "frac_token_below_floor"]):
        bad.append(f"{name} level {spec.level}: token fractions {r[p + 'frac_token_above_cap']}")
    if spec.mode == "truncate" and spec.veto_low is None and r[p + "frac_zero_weight"] != 0:
        bad.append(f"{name} truncate: {r[p + 'frac_zero_weight']} of the tokens got weight 0")
    zero = r[p + "frac_zero_weight"]
    if spec.mode != "truncate" and spec.level == "token":  # the out-of-range tokens are masked
        out_of_range = r[p + "frac_token_above_cap"] + r[p + "frac_token_below_floor"]
        if zero < out_of_range - 1e-12:
            bad.append(f"{name} {spec.mode}: {zero} zero-weight tokens < {out_of_range} out of range")
    if spec.mode == "mask" and spec.level != "token" and (zero > 0) != (r[p + "frac_seq_veto"] > 0):
        bad.append(f"{name} mask {spec.level}: zero-weight tokens {zero} without a vetoed sequence or back")
    if spec.cap == "auto":
        low, high = spec.auto.clamp
        if not (_finite(r.get(cap_key)) and low <= r[cap_key] <= high):
            bad.append(f"{name} cap auto: {cap_key}={r.get(cap_key)} not in [{low}, {high}]")
    elif cap_key in r:
        bad.append(f"{name} cap {spec.cap}: {cap_key} logged")
    return bad


# ---------------------------------------------------------------------------------------- engine pool


@pytest.fixture(scope="module")
def pool():
    import megagrpo.rollout.engines.engine as engine_module
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=True, sglang=True)
    p = EnginePool(one_live=True)  # CASES come grouped by family
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "RolloutEngine", p)
        # the PATH of a user who types `megagrpo`: the venv's commands first (a command agent's `python`)
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        yield p
    p.drop_all()


def run_cli(pool: EnginePool, *argv: str) -> int:
    from megagrpo.cli import main

    try:
        rc = main(list(argv))
    except BaseException:
        pool.drop_all()  # an engine left mid-step by a crash must not serve the next case
        raise
    if rc != 0:
        pool.drop_all()
    return rc


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """The tiny model per family; qwen3_moe_think is the MoE with Qwen3's chat template and markers. The MoE
    takes 1024 positions so that Qwen3's tool preamble (~600 tiny-BPE tokens) fits the pooled engine's
    context, which the first case's model sets."""
    moe = tiny_model("qwen3_moe", max_pos=1024)
    think = qwen3_model_dir(moe, tmp_path_factory.mktemp("qwen3_think") / "m")
    # with one multi-token-prediction layer, as DeepSeek-V3/R1 and GLM-4.5(-Air) ship (issue 43): not
    # trained, not synced, carried into every checkpoint and SFT's saved model
    families = {f: tiny_model(f, mtp_layers=1) for f in ("deepseek_v3", "glm4_moe")}
    return {"qwen3_moe": moe, "qwen3_moe_think": think, "qwen3": tiny_model("qwen3"), **families}


@pytest.fixture(scope="module")
def sft_stages(tmp_path_factory, models, pool):
    """sft_stages(config) -> (tmp, its HF model, rc): `megagrpo sft` on a shipped config (its cold-start
    stage), from the tiny model of its case's family (`SFT_CONFIGS`), run once per module and only for the
    cases that need it. The rollout limits stay as shipped, since a multi-turn config's traces are checked
    against them."""
    done: dict[str, tuple[Path, Path, int]] = {}

    def stage(config: str) -> tuple[Path, Path, int]:
        if config not in done:
            tmp = tmp_path_factory.mktemp(f"sft_{Path(config).stem}")
            out = tmp / "sft_model"
            doc = DOC_SFT.get(config)  # README's `megagrpo sft` of this config: its words
            head = (
                [doc_args(doc).cmd, str(CONFIGS / config), *doc_args(doc).overrides]
                if doc
                else ["sft", str(CONFIGS / config)]
            )
            argv = [
                *head,
                f"model.hf_path={out}",
                f"sft.base_path={models[SFT_CONFIGS[config]]}",
                f"sft.output_dir={out}",
                f"sft.steps={STEPS}",
                "sft.batch_size=16",
                "sft.data.synthetic.num_train=64",
                "sft.data.synthetic.num_eval=4",
                f"checkpoint.dir={tmp / 'ckpt'}",
                f"logging.out_dir={tmp / 'run'}",
                "logging.tensorboard=false",
                "logging.console=false",
            ]
            done[config] = (tmp, out, run_cli(pool, *argv))
        return done[config]

    return stage


# ------------------------------------------------------------------------------------------ the tests


def case_config(case: Case, tmp: Path = Path("/nonexistent"), model: Path = Path("/nonexistent")) -> Config:
    return load_config(CONFIGS / case.config, case_overrides(case, tmp, model), check_paths=False)


def test_cases_cover_every_option_value(tmp_path):
    """The union of the cases' validated configs takes every allowed value of every listed option, and
    every Literal/bool option under algo, replay and diagnostics is listed (or excused)."""
    unlisted = sorted(set(literal_options()) - set(OPTIONS) - set(NOT_COVERED))
    assert not unlisted, f"options with no row in OPTIONS: {unlisted}"
    stale = sorted(p for p in NOT_COVERED if p in OPTIONS or p not in literal_options())
    cfgs = {c.name: case_config(c, tmp_path) for c in CASES}
    taken: dict[str, set] = {p: set() for p in OPTIONS}
    for cfg in cfgs.values():
        for p in OPTIONS:
            v = value_class(cfg, p)
            if v is not None:
                taken[p].add(v)
    missing = {p: sorted(map(str, allowed_values(p) - taken[p])) for p in OPTIONS}
    missing = {p: v for p, v in missing.items() if v}
    assert not missing, f"option values no case runs: {missing}"
    assert not stale, f"NOT_COVERED rows that are no longer uncovered options: {stale}"


def _assert_mtp_carried(source: Path, got: dict[str, torch.Tensor]) -> None:
    """`got` holds the source's multi-token-prediction tensors, bit for bit (the learner does not train them)."""
    prefixes = mtp_layer_prefixes(str(source))
    src = HFCheckpoint(source)
    names = src.mtp_names()
    assert prefixes and len(names) > 20 and {n for n in got if n.startswith(prefixes)} == set(names)
    assert all(torch.equal(got[n], src.get(n)) for n in names)


@pytest.mark.parametrize("config", SFT_CONFIGS)
def test_sft_stage_of_a_shipped_config(config, sft_stages, models):
    assert set(DOC_SFT) <= set(SFT_CONFIGS), (
        f"docs' `megagrpo sft` of configs no SFT stage runs: {set(DOC_SFT)}"
    )
    tmp, out, rc = sft_stages(config)
    assert rc == 0
    recs = records(tmp / "run" / "sft")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(_finite(r["sft/nll"]) and r["sft/tokens"] > 0 for r in recs)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    base = models[SFT_CONFIGS[config]]
    if mtp_layer_prefixes(str(base)):  # the saved model holds the MTP layers its config promises
        saved = HFCheckpoint(out)
        assert (
            saved.arch.mtp_layers
            == 1
            == json.loads((out / "config.json").read_text())["num_nextn_predict_layers"]
        )
        _assert_mtp_carried(base, {n: saved.get(n) for n in saved.mtp_names()})


@pytest.mark.parametrize("case", RUN_ORDER, ids=[c.name for c in RUN_ORDER])
def test_case_trains_two_steps_with_its_options(case, tmp_path, models, pool, sft_stages, monkeypatch, capfd):
    model = models[case.family]
    if case.config in SFT_CONFIGS:  # the RL stage starts from its SFT stage's model
        _, sft_out, sft_rc = sft_stages(case.config)
        assert sft_rc == 0, "the SFT stage this case starts from failed"
        model = sft_out
    cfg = load_config(CONFIGS / case.config, case_overrides(case, tmp_path, model))
    if case.fault and cfg.rollout.fault_tolerance.max_restarts:
        _assert_engine_replaced(case, tmp_path, model, pool, monkeypatch, capfd)
        return
    if case.fault:
        _assert_engine_loss_detected(case, cfg, tmp_path, model, pool, monkeypatch, capfd)
        return
    rc = run_cli(pool, *case_argv(case, tmp_path, model))
    assert rc == 0
    problems = (doc_problems if case.doc else run_problems)(cfg, records(tmp_path / "run"))
    assert not problems, "\n".join(problems)
    # schedule.save_every=0 means "end only": the finished run is checkpointed.
    ckpt = tmp_path / "ckpt" / f"step_{STEPS:08d}"
    assert (ckpt / "meta.json").is_file()
    if mtp_layer_prefixes(str(model)):  # carried beside it unchanged, for `convert megatron-to-hf`
        _assert_mtp_carried(model, load_file(str(next(ckpt.glob("mtp-*.safetensors")))))


# Metrics of the clock, and the recovery's own counters: the only ones a fault may change.
_TIMING = ("perf/", "seconds", "gbps", "rollout/engine_restarts", "rollout/regenerated_requests")


_CLEAN_RUNS: dict[str, tuple[list, list[dict]]] = {}  # config -> (completions, records) without a fault


def _assert_engine_replaced(case, tmp_path, model, pool, monkeypatch, capfd) -> None:
    """A fault case with a restart budget: the run with the fault (the engine replaced mid-round) makes
    the completions of the run without it (run once per config) and logs the same metrics but for the
    clock's."""
    from megagrpo.rollout.engines.faults import FAULT_ENV, planned
    from megagrpo.trainer.session import Session

    made: list = []
    generate_with = Session.generate_with

    def recording(self, prompts, sampling, group_size, index_offset, version=None):
        groups = generate_with(self, prompts, sampling, group_size, index_offset, version)
        made.append(
            (self.step, sampling.seed, index_offset)
            + tuple((c.output_ids.tolist(), c.logprobs.tolist(), c.finish_reason) for g in groups for c in g)
        )
        return groups

    monkeypatch.setattr(Session, "generate_with", recording)
    if case.config not in _CLEAN_RUNS:
        (tmp_path / "clean").mkdir()
        assert run_cli(pool, *case_argv(case, tmp_path / "clean", model)) == 0
        _CLEAN_RUNS[case.config] = (list(made), records(tmp_path / "clean" / "run"))
    made.clear()
    monkeypatch.setenv(FAULT_ENV, case.fault)
    fault = planned()
    replacements = pool.replacements
    assert run_cli(pool, *case_argv(case, tmp_path, model)) == 0
    out = capfd.readouterr().out
    assert f"sent {signal.Signals(fault.signal).name} to engine 0 of 1" in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if "replaced in" in ln)
    assert re.search(
        r"^engine 0 of 1: .*replaced in [\d.]+ s after .*\(restart 1 of 1\); its weights checksummed; \d+ requests",
        line,
    )
    if fault.kind == "stop":  # found within one look (probe_interval_s) of the deadline
        assert 3 <= int(re.search(r"has been stopped for (\d+) s", line).group(1)) <= 4, line
    assert pool.replacements == replacements + 1
    (clean_made, clean), faulted = _CLEAN_RUNS[case.config], records(tmp_path / "run")
    assert made == clean_made and len(clean_made) >= STEPS
    first_call = next(m for m in made if m[0] == fault.step)  # (step, seed, offset, *completions)
    assert [r["step"] for r in faulted] == [r["step"] for r in clean] == list(range(1, STEPS + 1))
    assert [r["rollout/engine_restarts"] for r in faulted] == [float(s == fault.step + 1) for s in (1, 2)]
    assert [r["rollout/regenerated_requests"] for r in faulted] == [0.0, len(first_call) - 3]
    for a, b in zip(clean, faulted, strict=True):
        assert set(a) == set(b)
        for k in a:
            if any(t in k for t in _TIMING):
                continue
            if "reward" in k or "len" in k:
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
            else:
                assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), (a["step"], k, a[k], b[k])


def _assert_engine_loss_detected(case, cfg, tmp_path, model, pool, monkeypatch, capfd) -> None:
    """A fault case (`Case.fault`): the run ends with ENGINE_LOST_EXIT_CODE and a line naming the engine and
    the cause, within the watch's deadline of the fault, with the steps before it logged and checkpointed."""
    from megagrpo.rollout.engines.faults import FAULT_ENV, planned
    from megagrpo.trainer.signals import ENGINE_LOST_EXIT_CODE

    monkeypatch.setenv(FAULT_ENV, case.fault)
    fault = planned()
    rc = run_cli(pool, *case_argv(case, tmp_path, model))
    err = capfd.readouterr()
    assert rc == ENGINE_LOST_EXIT_CODE, err.err[-3000:]
    assert "sent SIGSTOP to engine 0 of 1" in err.out, err.out[-3000:]
    line = next(ln for ln in err.err.splitlines() if ln.startswith("rollout engine lost"))
    assert f"at step {fault.step} of {STEPS}" in line and "engine 0 of 1" in line
    assert "probe_deadline_s=3" in line and "--resume auto" in line
    # found within one look (probe_interval_s) of the deadline
    assert 3 <= int(re.search(r"has been stopped for (\d+) s", line).group(1)) <= 4, line
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, fault.step + 1))
    assert (tmp_path / "ckpt" / f"step_{fault.step:08d}" / "meta.json").is_file()
    assert cfg.rollout.fault_tolerance.probe_deadline_s == 3.0


def test_each_family_started_one_engine(pool):
    """The CI budget (runs last): every case of a family shared one pooled engine, whatever its config's
    engine settings were before the size overrides (Kimi-K2's trust_remote_code included)."""
    assert pool.starts <= len(_ENGINES)
