"""Life cycle of one in-process SGLang engine, and batched generation with logprobs and routes.

`RolloutEngine` starts a `sglang.Engine` from a `RolloutConfig`, generates G completions per prompt in ONE
batched `async_generate` call (so the scheduler sees the whole batch at once), releases and resumes its
memory around training, and shuts down cleanly (context manager, `atexit`, exceptions). Multi-turn rollouts
(`rollout.multi_turn`) send one request per trajectory turn instead (`generate_turn`, a coroutine on the
engine's loop, with the turn's `routed_experts_start_len`); the scheduler batches the concurrent ones.

On a machine without CUDA, call `megagrpo.compat.apply_cpu_compat(sglang=True)` first; the engine then runs
SGLang's CPU platform (`device="cpu"`, `attention_backend="torch_native"`, no CUDA graphs).

Shutdown. `sglang.Engine.shutdown()` ends with `kill_process_tree(os.getpid(), include_parent=False)`, which
SIGKILLs EVERY child of the calling process, not only the engine's (a colocated checkpoint writer, a test
fixture's cluster, another engine). `RolloutEngine.shutdown` narrows that call to the processes this engine
started (recorded at start) for the duration of the shutdown, and unregisters SGLang's `atexit` hook.

SIGTERM. SGLang's tokenizer manager creates its request loop at the first request and, on the main thread,
registers on it a SIGTERM callback that drains the engine, kills its schedulers and raises SystemExit(0),
and while that callback is registered a SIGTERM between requests is dropped by uvloop. Either way a
preempted trainer would end with exit 0 and no checkpoint. `start` creates that request loop itself,
before any request, and removes the callback in the same loop step (`_keep_sigterm`), so SIGTERM always
reaches the host process's own handler.

SIGQUIT. A scheduler that raises (e.g. the engine's weight loader failing during a colocated sync) sends
SIGQUIT to its parent, this process, as does SGLang's subprocess watchdog when a child exits; SGLang's
handlers answer by killing this process's whole tree, itself included: the trainer ended with exit 137, no
checkpoint and no line saying which engine failed. `start` takes SIGQUIT over (main thread only, as SGLang
does): the engine is marked failed and its own processes are stopped; a request waiting on the engine's
loop ends (the loop is stopped), and `wait` (generate, score) and the weight sync, which also names the
bucket it was loading, raise `EngineFailed`; arriving between requests, it is raised in the main thread.
Every later use of the engine raises `EngineFailed` at once instead of waiting for a scheduler that is
gone. The error names the engine (`name`: its index, rank, host and devices where the trainer gives them)
and the cause its scheduler left (`rollout.engines.startup`, "Cause of death").

A failed start. SGLang's own SIGQUIT handler during `sglang.Engine(...)` kills this process's whole tree
too (a scheduler that fails while loading the model signals its parent): exit 137 at start, with no word
of the cause. `start` passes SGLang a handler of its own (`custom_sigquit_handler`, which only takes the
signal), waits for SGLang to find the scheduler dead, stops the engine's processes and raises
`EngineFailed`: the engine's name, the model, and the scheduler's exception. A failure in this process
(a port taken, a bad argument) raises the same error with SGLang's exception.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch

from megagrpo.errors import MegagrpoError
from megagrpo.rollout.completion import Completion, completion_from_output
from megagrpo.rollout.config import DTYPES, RolloutConfig, SamplingConfig
from megagrpo.rollout.engines.startup import (
    failure_cause,
    failures_reported_to,
    only_the_served_model_imported,
    reporting_failure,
    sglang_config_fill,
)
from megagrpo.rollout.episodes.trajectory import PREFIX_REREAD

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")

Prompt = Sequence[int] | Sequence[dict]  # token ids, or chat messages [{"role": ..., "content": ...}]


def open_zmq_contexts() -> list[Any]:
    """The ZMQ contexts of this process that are not closed (SGLang's tokenizer manager makes its own)."""
    import zmq

    return [o for o in gc.get_objects() if isinstance(o, zmq.Context) and not o.closed]


def _kill_pids(pids: Sequence[int], timeout: float | None = 30) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=timeout)


_MP_HELPERS = ("from multiprocessing.resource_tracker import", "from multiprocessing.forkserver import")


def _is_mp_helper(p: psutil.Process) -> bool:
    """multiprocessing's shared resource tracker or fork server, by the code it runs (`-c CODE`). Only that
    argument is read: every spawned child's command line carries the parent's warning filters as `-W`
    options, one of which names the resource tracker, so a scheduler or detokenizer not yet retitled by
    SGLang would match a search of the whole line, go unrecorded, outlive `shutdown` and hang the
    process's exit (multiprocessing joins its live children)."""
    try:
        args = p.cmdline()
    except psutil.Error:
        return False
    code = args[args.index("-c") + 1] if "-c" in args[:-1] else ""
    return code.startswith(_MP_HELPERS)


def has_flash_attention_3() -> bool:
    """Whether sglang-kernel's FlashAttention-3 module is installed, found without importing sgl_kernel
    (whose import loads its CUDA library)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any(Path(d).glob("flash_ops*.so")) for d in spec.submodule_search_locations)


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_threads_bind(tp_size: int, nnodes: int, cores: Sequence[int]) -> str:
    """SGLang's `SGLANG_CPU_OMP_THREADS_BIND` for a CPU engine of `tp_size` ranks over `nnodes` nodes on
    these `cores`: this node's `tp_size // nnodes` ranks take equal runs of them, in the order of their
    device id on the node (base_gpu_id 0 plus the local TP index; all the cores each when there are fewer
    cores than ranks). Unset, SGLang asserts one NUMA node per rank, which a CPU engine of 2+ ranks on one
    socket fails. SGLang binds OpenMP threads to the runs only with its AMX/arm64 kernels
    (`init_cpu_threads_env`); elsewhere the value is checked and unused."""
    per = max(1, tp_size // max(1, nnodes))
    cores = sorted(cores)
    if len(cores) < per:
        return "|".join([",".join(map(str, cores))] * per)
    n = len(cores) // per
    return "|".join(",".join(map(str, cores[i * n : (i + 1) * n])) for i in range(per))


class EngineFailed(MegagrpoError):
    """A process of the in-process SGLang engine died (module doc, "SIGQUIT"): the engine cannot serve."""


def _signal_taken_at_start(signum: int, frame: Any) -> None:
    """SIGQUIT while `sglang.Engine` starts (module doc, "A failed start"): SGLang finds the scheduler dead
    and raises, and `RolloutEngine.start` reports it. A module function: SGLang pickles it with its
    server arguments into every scheduler."""


def engine_class(sglang_engine: type) -> type:
    """`sglang_engine` whose scheduler processes leave the cause of their death (`rollout.engines.startup`): its
    scheduler entry as it is now (SGLang's, or the CPU compat's) wrapped in `reporting_failure`."""
    entry = functools.partial(reporting_failure, sglang_engine.run_scheduler_process_func)
    namespace = {"run_scheduler_process_func": staticmethod(entry), "__module__": __name__}
    return type(sglang_engine.__name__, (sglang_engine,), namespace)


class EngineRequests(abc.ABC):
    """The requests every engine transport sends, built and decoded in one place: prompt checks, sampling
    parameters and seeds, the layout of SGLang's `GenerateReqInput`, and the decoding of the answers
    (`generate`, `generate_turn`, `score`). Two transports carry them: `RolloutEngine`, an in-process
    `sglang.Engine`, and `rollout.engines.remote.RemoteEngine`, SGLang's HTTP server on ranks of its own. A
    transport provides `_request`, `loop` and `routes_num_experts`, and sets the model's dimensions
    (`_read_dims`, `context_len`, `tokenizer`) when it starts.

    Memory: only an engine that shares its devices releases any (`RolloutEngine.release`); while some is
    released, requests are refused (`asleep`)."""

    def __init__(self, cfg: RolloutConfig) -> None:
        self.cfg = cfg
        self._released: set[str] = set()  # memory tags released (`RolloutEngine.release`)

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def _hf_config(self) -> dict[str, Any]:
        with open(os.path.join(self.cfg.model_path, "config.json")) as f:
            return json.load(f)

    def _read_dims(self, get: Callable[[str], Any]) -> None:
        """The model's dimensions from its HF config, read through `get(key)` (None when absent)."""
        self.num_layers = int(get("num_hidden_layers") or 0)
        self.topk = int(get("num_experts_per_tok") or 0)
        self.vocab_size = int(get("vocab_size"))
        experts = next(
            (get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts") if get(k)), 0
        )
        self.num_experts = int(experts) if self.topk else None

    # ---------------------------------------------------------------- generation

    def tokenize(self, prompt: Prompt, index: int = 0) -> list[int]:
        """Token ids of one prompt: ids as given, or chat messages through the chat template."""
        if isinstance(prompt, str):
            raise MegagrpoError(
                f"prompts[{index}] is a string; pass token ids or chat messages [{{'role':..,'content':..}}]"
            )
        items = list(prompt)
        if not items:
            raise MegagrpoError(f"prompts[{index}] is empty; every prompt needs at least one token")
        if all(isinstance(m, dict) for m in items):
            ids = self.tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        if not all(isinstance(t, int) or (torch.is_tensor(t) and t.numel() == 1) for t in items):
            raise MegagrpoError(f"prompts[{index}] must be token ids (ints) or chat messages (dicts)")
        ids = [int(t) for t in items]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise MegagrpoError(f"prompts[{index}] has token ids {bad[:5]} outside [0, {self.vocab_size})")
        return ids

    def _sampling_params(self, s: SamplingConfig, seed: int | None) -> dict[str, Any]:
        if s.temperature < 0:
            raise MegagrpoError(f"sampling.temperature={s.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < s.top_p <= 1.0:
            raise MegagrpoError(f"sampling.top_p={s.top_p} must be in (0, 1]")
        if s.max_new_tokens < 1:
            raise MegagrpoError(f"sampling.max_new_tokens={s.max_new_tokens} must be >= 1")
        sp: dict[str, Any] = dict(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=s.max_new_tokens,
            ignore_eos=s.ignore_eos,
            no_stop_trim=True,  # keep the text consistent with output_ids (which always hold the stop tokens)
            skip_special_tokens=False,
        )
        if s.stop:
            sp["stop"] = list(s.stop)
        if seed is not None:
            sp["sampling_seed"] = seed
        return sp

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingConfig,
        group_size: int = 1,
        *,
        index_offset: int = 0,
    ) -> list[list[Completion]]:
        """G = `group_size` completions for each prompt, as `[n_prompts][G]`, in one batched engine call.

        Request k of the call (prompt k // G, sample k % G) samples with seed `sampling.seed + index_offset
        + k`: `index_offset` is the global index of the first request when a call is one engine's share of
        a larger one (`rollout.groups`), so a request's seed does not depend on which engine serves it.

        Raises MegagrpoError for an empty prompt list, an empty prompt, group_size < 1, or a prompt whose
        length plus `max_new_tokens` exceeds the engine's context.
        """
        if self.asleep:
            raise MegagrpoError(
                f"the rollout engine has released {sorted(self._released)}; call resume() first"
            )
        if len(prompts) == 0:
            raise MegagrpoError("generate() got an empty prompt list; pass at least one prompt")
        if group_size < 1:
            raise MegagrpoError(f"group_size={group_size} must be >= 1")
        ids = [self.tokenize(p, i) for i, p in enumerate(prompts)]
        for i, p in enumerate(ids):
            if len(p) + sampling.max_new_tokens > self.context_len:
                raise MegagrpoError(
                    f"prompts[{i}] has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} it exceeds "
                    f"the engine context of {self.context_len} tokens (rollout.max_context_len). Shorten the "
                    "prompt or lower max_new_tokens"
                )
        batch_ids, params = [], []
        for i, p in enumerate(ids):
            for g in range(group_size):
                batch_ids.append(p)
                seed = None if sampling.seed is None else sampling.seed + index_offset + i * group_size + g
                params.append(self._sampling_params(sampling, seed))
        outs = self.wait(
            self._request(
                input_ids=batch_ids,
                sampling_params=params,
                return_logprob=True,
                return_routed_experts=self.routes_num_experts is not None,
            )
        )
        if isinstance(outs, dict):
            outs = [outs]
        groups: list[list[Completion]] = []
        for i, p in enumerate(ids):
            groups.append(
                [
                    completion_from_output(
                        outs[i * group_size + g],
                        prompt_index=i,
                        sample_index=g,
                        prompt_ids=p,
                        num_layers=self.num_layers,
                        topk=self.topk,
                    )
                    for g in range(group_size)
                ]
            )
        return groups

    @abc.abstractmethod
    async def _request(self, **request: Any) -> Any:
        """One SGLang generate request (GenerateReqInput's fields), batched or single, over this transport:
        SGLang's answer (a dict, or a list of them for a batch)."""

    @property
    @abc.abstractmethod
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop every request of this engine is awaited on (`wait`)."""

    def wait(self, coro: Any) -> Any:
        """`coro` run to its end on the engine's loop."""
        return self.loop.run_until_complete(coro)

    @property
    @abc.abstractmethod
    def routes_num_experts(self) -> int | None:
        """The expert count of the routes this engine returns; None when it returns none (dense model, or
        `rollout.return_routes` off)."""

    async def generate_turn(
        self,
        input_ids: Sequence[int],
        sampling: SamplingConfig,
        *,
        seed: int | None,
        routed_experts_start_len: int = 0,
        max_new_tokens: int | None = None,
    ) -> dict[str, Any]:
        """One request, awaited on `self.loop`: SGLang's raw result for `input_ids` (output ids, sampler
        logprobs, finish reason and, when the engine returns routes, the route rows of sequence positions
        `[routed_experts_start_len, len(input_ids) + new tokens - 1)`; `rollout.episodes.trajectory` decodes them).

        One turn of a multi-turn trajectory: each trajectory sends its own requests, because SGLang takes one
        `routed_experts_start_len` per call. `max_new_tokens` overrides `sampling.max_new_tokens` (the
        trajectory's remaining budget). Raises MegagrpoError when the engine sleeps, for an empty request, a
        start outside `[0, len(input_ids)]`, or a request past the engine's context.

        When the engine recomputed part of the held prefix (`meta_info["cached_tokens"]` below the start: the
        radix cache evicted it since the last turn), the routes of that recompute are read back at once and
        added under `trajectory.PREFIX_REREAD` (`_reread_prefix_routes`; `rollout.episodes.trajectory` module doc)."""
        if self.asleep:
            raise MegagrpoError(
                f"the rollout engine has released {sorted(self._released)}; call resume() first"
            )
        ids = [int(t) for t in input_ids]
        if not ids:
            raise MegagrpoError(
                "generate_turn() got an empty request; every request needs at least one token"
            )
        if not 0 <= routed_experts_start_len <= len(ids):
            raise MegagrpoError(
                f"routed_experts_start_len={routed_experts_start_len} is outside [0, {len(ids)}] (the request's "
                "tokens); it is the number of route rows the trajectory holds"
            )
        if max_new_tokens is not None:
            sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
        if len(ids) + sampling.max_new_tokens > self.context_len:
            raise MegagrpoError(
                f"a request of {len(ids)} tokens with max_new_tokens={sampling.max_new_tokens} exceeds the engine "
                f"context of {self.context_len} tokens (rollout.max_context_len); lower the trajectory's "
                "max_tokens or raise the context"
            )
        want_routes = self.routes_num_experts is not None
        out = await self._request(
            input_ids=ids,
            sampling_params=self._sampling_params(sampling, seed),
            return_logprob=True,
            return_routed_experts=want_routes,
            routed_experts_start_len=routed_experts_start_len if want_routes else 0,
        )
        cached = out["meta_info"].get("cached_tokens")
        if want_routes and cached is not None and int(cached) < routed_experts_start_len:
            out[PREFIX_REREAD] = await self._reread_prefix_routes(ids, routed_experts_start_len, int(cached))
        return out

    async def _reread_prefix_routes(self, ids: list[int], held: int, cached: int) -> dict[str, Any]:
        """The routes of positions `[cached, held)` as the turn that just recomputed them left them in the
        cache: a greedy one-token request over `ids[: held + 1]` whose prefix match reuses the turn's KV slots
        (at most `held` tokens: SGLang computes the last one), returning the rows of `[cached, held + 1)`.

        Cost: one forward over the tokens its cache lacks (1 on a hit) and `held + 1 - cached` rows of
        layers x topk int32 back, only on a turn whose prefix was recomputed."""
        got = await self._request(
            input_ids=ids[: held + 1],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_routed_experts=True,
            routed_experts_start_len=cached,
        )
        meta = got["meta_info"]
        return {
            "start": cached,
            "routed_experts": meta["routed_experts"],
            "cached_tokens": meta["cached_tokens"],
        }

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Engine log p(token t | tokens < t) for t = 1 .. L-1 of each sequence: float32 `[L - 1]` each.

        One prefill per sequence (no sampling), in one batched call; used to compare the engine's weights
        with a reference model on fixed sequences.
        """
        if self.asleep:
            raise MegagrpoError(
                f"the rollout engine has released {sorted(self._released)}; call resume() first"
            )
        if len(sequences) == 0:
            raise MegagrpoError("score() got an empty list of sequences")
        ids = [self.tokenize(s, i) for i, s in enumerate(sequences)]
        for i, s in enumerate(ids):
            if len(s) < 2 or len(s) + 1 > self.context_len:
                raise MegagrpoError(
                    f"sequences[{i}] has {len(s)} tokens; score needs 2 .. {self.context_len - 1}"
                )
        outs = self.wait(
            self._request(
                input_ids=ids,
                sampling_params=[{"max_new_tokens": 1, "temperature": 0.0}] * len(ids),
                return_logprob=True,
                logprob_start_len=0,
            )
        )
        if isinstance(outs, dict):
            outs = [outs]
        result = []
        for s, out in zip(ids, outs):
            lp = out["meta_info"]["input_token_logprobs"]  # first entry (token 0) has no logprob
            result.append(torch.tensor([float(x[0]) for x in lp[1 : len(s)]], dtype=torch.float32))
        return result


class RolloutEngine(EngineRequests):
    """One in-process SGLang engine. Use as a context manager, or call `start()` and `shutdown()`."""

    def __init__(self, cfg: RolloutConfig, *, name: str | None = None) -> None:
        """`name`: how errors name this engine (its index and placement); default "the rollout engine"."""
        super().__init__(cfg)
        self.name = name or "the rollout engine"
        self._engine: Any = None
        self._child_pids: list[int] = []
        self._failure_dir: str | None = None  # where its schedulers leave their cause of death
        self._watch: Any = None  # the owner's `rollout.engines.watch.EngineWatch`, when started
        self.failed: str | None = (
            None  # why the engine stopped serving (module doc, "SIGQUIT"); None = it serves
        )
        self.on_cpu = not torch.cuda.is_available()
        self._validate_config()

    # ---------------------------------------------------------------- life cycle

    def _validate_config(self) -> None:
        cfg = self.cfg
        if not os.path.isfile(os.path.join(cfg.model_path, "config.json")):
            raise MegagrpoError(
                f"rollout.model_path={cfg.model_path!r} is not a Hugging Face model directory (no config.json)"
            )
        if cfg.dtype not in DTYPES:
            raise MegagrpoError(f"rollout.dtype={cfg.dtype!r} is not one of {', '.join(DTYPES)}")
        if cfg.tp_size < 1:
            raise MegagrpoError(f"rollout.tp_size={cfg.tp_size} must be >= 1")
        if not 0.0 < cfg.mem_fraction_static < 1.0:
            raise MegagrpoError(f"rollout.mem_fraction_static={cfg.mem_fraction_static} must be in (0, 1)")
        if cfg.fp8 and self.on_cpu:
            raise MegagrpoError(
                "rollout.fp8=true needs a CUDA GPU (SGLang's fp8 kernels); set rollout.fp8=false"
            )
        head_dim = self._head_dim()
        if not self.on_cpu and head_dim is not None and head_dim < 64:
            raise MegagrpoError(
                f"{cfg.model_path}: head_dim {head_dim}; SGLang's CUDA rotary embedding falls back for head dims "
                "below 64 and that path cannot write the KV cache (it fails while capturing CUDA graphs). Use "
                "a model with head_dim >= 64 on a GPU (every released Qwen3/Llama has 64 or 128)"
            )
        if cfg.nnodes > 1 and (cfg.dist_init_addr is None or not 0 <= cfg.node_rank < cfg.nnodes):
            raise MegagrpoError(
                f"an engine over nnodes={cfg.nnodes} needs node_rank in [0, {cfg.nnodes}) (got {cfg.node_rank}) "
                f"and dist_init_addr (got {cfg.dist_init_addr!r})"
            )

    def engine_kwargs(self) -> dict[str, Any]:
        """The `sglang.Engine` keyword arguments this config maps to."""
        cfg = self.cfg
        kw: dict[str, Any] = dict(
            model_path=cfg.model_path,
            tp_size=cfg.tp_size,
            dtype=cfg.dtype,
            mem_fraction_static=cfg.mem_fraction_static,
            random_seed=cfg.seed,
            log_level=cfg.log_level,
            enable_return_routed_experts=cfg.return_routes and self.is_moe_config(),
            trust_remote_code=cfg.trust_remote_code,
            # On the CPU, SGLang's idle scheduler otherwise spins its event loop: 0.59 of a core per engine,
            # taken from the colocated learner while it trains. Asleep, the TP-rank-0 scheduler blocks in a
            # zmq poll on its tokenizer and RPC sockets, which returns as soon as a request (generate, flush,
            # release/resume, weight update) arrives; the cost is the OS waking the process, once per
            # idle-to-busy turn (docs/gpu.md has the figures). Not on GPUs: unmeasured there, and a GPU node
            # has cores to spare.
            sleep_on_idle=self.on_cpu,
        )
        if cfg.max_context_len is not None:
            kw["context_length"] = cfg.max_context_len
        if cfg.max_total_tokens is not None:
            kw["max_total_tokens"] = cfg.max_total_tokens
        if self.on_cpu:
            # SGLang's CPU platform: torch-native attention, no CUDA graphs; the memory saver needs libcuda.
            kw.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
            # SGLang's own switch for its custom all-reduce, a CUDA IPC kernel that a TP group of 2+ ranks
            # would otherwise try to set up; PyNccl has no switch: megagrpo.compat.sglang_cpu turns it off.
            kw["disable_custom_all_reduce"] = True
            # The packed weight sync's loader (a string: rollout does not import sync): `direct`'s copy,
            # and the staging stays mapped in the scheduler between syncs (`megagrpo.sync.staging.load_packed`);
            # and its probe of the engine's real parameter shapes, asked before the first packed send.
            kw["custom_weight_loader"] = [
                "megagrpo.sync.staging.load_packed",
                "megagrpo.sync.shape_probe.report_shape_mismatches",
            ]
        else:
            kw["enable_memory_saver"] = True  # release/resume really frees device memory
            if not has_flash_attention_3():
                # SGLang defaults to FA3 on Hopper; a bundle trimmed to sm_90 leaves FA3's 1.1 GB module out.
                kw["attention_backend"] = "triton"
            # SGLang 0.5.23 captures prefill CUDA graphs by default on CUDA ("breakable"); its capture fails
            # on models whose rotary embedding takes the fallback path (seen on an H200 with head_dim 16).
            # Rollouts are decode-bound, so eager prefill costs little; `extra_engine_args` can turn it on.
            kw["cuda_graph_backend_prefill"] = "disabled"
            kw["base_gpu_id"] = cfg.base_gpu_id
            if cfg.fp8:
                kw["quantization"] = "fp8"
            if cfg.deterministic:
                kw["enable_deterministic_inference"] = True
        # SGLang's multi-node engine: tp_size devices (GPUs, or CPU ranks) over nnodes nodes
        if cfg.nnodes > 1:
            kw.update(nnodes=cfg.nnodes, node_rank=cfg.node_rank, dist_init_addr=cfg.dist_init_addr)
        fill = sglang_config_fill(cfg.model_path)  # fields SGLang reads that config.json lacks
        kw.update(cfg.extra_engine_args)
        if fill:
            given = kw.get("json_model_override_args") or "{}"
            kw["json_model_override_args"] = json.dumps({**fill, **json.loads(given)})  # the user's win
        return kw

    def export_cpu_threads_bind(self) -> None:
        """On the CPU, an engine of 2+ ranks needs `SGLANG_CPU_OMP_THREADS_BIND` (`cpu_threads_bind`); set
        from this process's cores before the schedulers are spawned (they inherit it), unless the user set
        it."""
        if self.on_cpu and self.cfg.tp_size > 1 and not os.environ.get(THREADS_BIND_ENV):
            os.environ[THREADS_BIND_ENV] = cpu_threads_bind(
                self.cfg.tp_size, self.cfg.nnodes, sorted(os.sched_getaffinity(0))
            )

    def _head_dim(self) -> int | None:
        hf = self._hf_config()
        if hf.get("head_dim"):
            return int(hf["head_dim"])
        if hf.get("hidden_size") and hf.get("num_attention_heads"):
            return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
        return None

    def is_moe_config(self) -> bool:
        return self._hf_config().get("num_experts_per_tok", 0) > 0

    def start(self) -> RolloutEngine:
        if self._engine is not None:
            return self
        from sglang.srt.entrypoints.engine import Engine  # the class (`sglang.Engine` is a lazy stand-in)

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        contexts = {id(c) for c in open_zmq_contexts()}
        self.export_cpu_threads_bind()
        self._failure_dir = tempfile.mkdtemp(prefix="megagrpo-engine-")
        kw = self.engine_kwargs()
        kw.setdefault("custom_sigquit_handler", _signal_taken_at_start)
        try:
            with only_the_served_model_imported(self.cfg.model_path), failures_reported_to(self._failure_dir):
                self._engine = engine_class(Engine)(**kw)
        except Exception as e:  # noqa: BLE001 - every cause of a failed start, named with the engine
            raise EngineFailed(self._start_failure(e)) from e
        finally:
            after = psutil.Process().children(recursive=True)
            # multiprocessing's resource tracker is started by the first spawn but is shared, not the engine's
            self._child_pids = [p.pid for p in after if p.pid not in before and not _is_mp_helper(p)]
            if self._engine is None:
                _kill_pids(self._child_pids)
                self._remove_failure_dir()
                # The half-built engine's ZMQ contexts hold requests for schedulers that are gone; left to
                # the garbage collector, their default linger (forever) blocks this process at some later
                # allocation. Closed now, without linger.
                for ctx in open_zmq_contexts():
                    if id(ctx) not in contexts:
                        ctx.destroy(linger=0)
        hf = self._engine.tokenizer_manager.model_config.hf_config
        self._read_dims(lambda key: getattr(hf, key, None))
        self.context_len = int(self._engine.tokenizer_manager.context_len)
        self.tokenizer = self._engine.tokenizer_manager.tokenizer
        self._keep_sigterm()
        self._catch_child_failure()
        return self

    def _start_failure(self, e: Exception) -> str:
        """The error of a failed start (module doc, "A failed start"): the engine, the model, the cause."""
        where = f"tp_size={self.cfg.tp_size}" + ("" if self.on_cpu else f", first GPU {self.cfg.base_gpu_id}")
        if self.cfg.nnodes > 1:
            where += f", SGLang node {self.cfg.node_rank} of {self.cfg.nnodes}"
        cause = failure_cause(self._failure_dir)
        said = f"{type(e).__name__}: {e}"
        return f"{self.name}: SGLang could not start on {self.cfg.model_path} ({where}): " + (
            f"its scheduler failed with {cause}" if cause else said
        )

    def _remove_failure_dir(self) -> None:
        if self._failure_dir is not None:
            shutil.rmtree(self._failure_dir, ignore_errors=True)
            self._failure_dir = None

    def _catch_child_failure(self) -> None:
        """SIGQUIT to `_child_failed` (module doc, "SIGQUIT"); signal handlers live on the main thread only."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self._child_failed)

    def _child_failed(self, signum: int, frame: Any) -> None:
        """SIGQUIT from the engine's scheduler or SGLang's watchdog (module doc, "SIGQUIT"): raise
        `EngineFailed` here, in the main thread, once (both senders may signal the same death)."""
        if self.failed is not None or self._engine is None:
            return
        cause = failure_cause(self._failure_dir)
        if not self._stop_failed(
            "one of its processes failed"
            + (f" with {cause}" if cause else " (SGLang logged its traceback above)")
        ):
            raise EngineFailed(self.failed)

    def fail(self, cause: str) -> None:
        """The owner's watch found the engine dead, stopped or hung (`rollout.engines.watch`): the engine
        fails as on SIGQUIT (module doc), from the watch's thread, so nothing is raised here: a request
        waiting on the engine ends with `EngineFailed`, and so does every later use."""
        if self.failed is None and self._engine is not None:
            logger.error("%s: %s; the engine is stopped", self.name, cause)
            self._stop_failed(cause)

    def _stop_failed(self, cause: str) -> bool:
        """Mark the engine failed with `cause`, stop its processes (a stopped one too: SIGKILL ends it) and
        end a wait on its loop; whether a wait was ended (else the caller raises, if it may)."""
        self.failed = (
            f"the SGLang engine serving {self.cfg.model_path} stopped: {cause}; the run cannot go on with "
            f"{self.name}. Resume from the last checkpoint once the cause is fixed"
        )
        watchdog = getattr(self._engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would signal again for the same death
        _kill_pids(self._child_pids, timeout=10)
        loop = self._engine.loop
        if loop.is_running():
            # Waiting on the engine: uvloop runs a signal handler as a callback of its own and only logs
            # what it raises. Stopped, the loop ends the wait with a RuntimeError, which `wait` and the
            # weight sync turn into EngineFailed.
            loop.call_soon_threadsafe(loop.stop)  # threadsafe: wakes a loop blocked in its selector
            return True
        return False

    def start_watch(self, *, probe_interval_s: float, probe_deadline_s: float, hang_s: float) -> None:
        """The owner's watch over this engine (`rollout.engines.watch`), until `shutdown`; it replaces the
        one a reused engine (a test's pool) may still have."""
        from megagrpo.rollout.engines.watch import EngineWatch

        if self._watch is not None:
            self._watch.stop()
        self._watch = EngineWatch(
            self, probe_interval_s=probe_interval_s, probe_deadline_s=probe_deadline_s, hang_s=hang_s
        ).start()

    def request_progress(self) -> tuple[int, float]:
        """(requests in flight, the time of the engine's last answer) from SGLang's tokenizer manager; read
        from the watch's thread (a dict's length and a float: no lock needed). (0, 0.0) once shut down."""
        engine = self._engine
        if engine is None:
            return 0, 0.0
        tm = engine.tokenizer_manager
        return len(tm.rid_to_state), float(getattr(tm, "last_receive_tstamp", 0.0))

    def wait(self, coro: Any) -> Any:
        """`coro` run on the engine's loop; EngineFailed when the engine died meanwhile (module doc)."""
        try:
            return self.loop.run_until_complete(coro)
        except RuntimeError:
            if self.failed is not None:
                raise EngineFailed(self.failed) from None
            raise

    def _keep_sigterm(self) -> None:
        """Leave SIGTERM to the host process from before the first request on (module docstring, "SIGTERM").

        SGLang's `TokenizerManager.auto_create_handle_loop` runs at the first request: it creates the
        request loop's tasks and, on the main thread only, registers the SIGTERM callback (drain, then
        `sys.exit(0)`) and a SIGQUIT one (a child died). It is run here, before any request, and the
        SIGTERM callback removed in the same step of the loop, so no request ever runs with it, whatever
        the thread of that request (async rollout generates on a worker thread). The SIGQUIT callback is
        removed too; `start` installs its own handler (module doc, "SIGQUIT").
        The host's handler, read first, is put back: uvloop leaves the default there, and removes a
        handler only from inside the running loop."""
        tm = self._engine.tokenizer_manager
        loop = self._engine.loop
        on_main = threading.current_thread() is threading.main_thread()
        host = signal.getsignal(signal.SIGTERM)

        async def create_request_loop_without_sigterm() -> bool:
            tm.auto_create_handle_loop()  # returns at once if the loop already exists
            if on_main:  # SIGQUIT's callback kills this process's tree: `start` handles it instead
                loop.remove_signal_handler(signal.SIGQUIT)
            return on_main and loop.remove_signal_handler(signal.SIGTERM)

        if loop.run_until_complete(create_request_loop_without_sigterm()) and host is not None:
            signal.signal(signal.SIGTERM, host)

    def shutdown(self) -> None:
        """Stop the engine and every process it started; idempotent."""
        if self._watch is not None:
            self._watch.stop()  # the processes killed below are no failure
            self._watch = None
        engine, self._engine = self._engine, None
        if engine is None:
            return
        from sglang.srt.entrypoints import engine as engine_module

        pids = list(self._child_pids)
        upstream = engine_module.kill_process_tree

        def kill_own_processes(parent_pid: int, include_parent: bool = True, **kw: Any) -> None:
            if parent_pid == os.getpid() and not include_parent:
                _kill_pids(pids, kw.get("wait_timeout", 60))
            else:
                upstream(parent_pid, include_parent=include_parent, **kw)

        engine_module.kill_process_tree = kill_own_processes
        try:
            engine.shutdown()
        finally:
            engine_module.kill_process_tree = upstream
            atexit.unregister(engine.shutdown)
            _kill_pids(pids)
            self._remove_failure_dir()

    @property
    def pids(self) -> list[int]:
        """Process ids this engine started (schedulers, detokenizer)."""
        return list(self._child_pids)

    @property
    def engine(self) -> Any:
        """The underlying `sglang.Engine` (for weight sync)."""
        if self.failed is not None:
            raise EngineFailed(self.failed)
        if self._engine is None:
            raise MegagrpoError(
                "the rollout engine is not running; call start() (or use it as a context manager)"
            )
        return self._engine

    def __enter__(self) -> RolloutEngine:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- memory

    def _check_tags(self, tags: Sequence[str] | None) -> list[str]:
        tags = list(MEMORY_TAGS if tags is None else tags)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad or not tags:
            raise MegagrpoError(f"memory tags {tags!r}: each must be one of {', '.join(MEMORY_TAGS)}")
        return tags

    def release(self, tags: Sequence[str] | None = None) -> None:
        """Release the engine's `weights` and/or `kv_cache` memory before training.

        On GPU (`enable_memory_saver`) this frees the device memory. On the CPU there is no memory saver
        (it needs libcuda): SGLang still flushes the KV cache and stashes the static state, but frees no RAM.
        """
        tags = [t for t in self._check_tags(tags) if t not in self._released]
        if tags:
            self._wait_idle()
            self.engine.release_memory_occupation(tags=tags)
            self._released.update(tags)

    def _wait_idle(self, timeout_s: float = 120.0) -> None:
        """Block until the scheduler is fully idle. SGLang asserts idleness in release_memory_occupation (and
        the failed assertion kills the scheduler), yet after the last output is returned the scheduler may
        still hold its finished batch for one more loop turn; flush_cache succeeds only once it is idle."""
        import time

        deadline = time.monotonic() + timeout_s
        while not getattr(self.engine.flush_cache(), "success", True):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SGLang scheduler did not become idle within {timeout_s:.0f} s")
            time.sleep(0.02)

    def resume(self, tags: Sequence[str] | None = None) -> None:
        """Undo `release` for `tags` (default both). On the CPU nothing was freed, so nothing is reallocated."""
        tags = [t for t in self._check_tags(tags) if t in self._released]
        if tags:
            self.engine.resume_memory_occupation(tags=tags)
            self._released.difference_update(tags)

    # ---------------------------------------------------------------- transport

    async def _request(self, **request: Any) -> Any:
        return await self.engine.async_generate(**request)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.engine.loop

    @property
    def routes_num_experts(self) -> int | None:
        return self.num_experts if self.engine.server_args.enable_return_routed_experts else None
