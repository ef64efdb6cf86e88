"""What a run prints: its progress, its step lines and its result, not the libraries' start-up notices.

On this stack (megatron-core without Transformer Engine or Apex, SGLang on a CPU) every process prints
dozens of warnings about kernels it will not use and APIs megagrpo calls for it; SGLang's spawned
scheduler and detokenizer print them again. `quiet_known_noise()` hides exactly those listed below:
warnings by category, message prefix and the module that issues them, log records by logger and
message prefix. Anything else still shows, and `--verbose` (MEGAGRPO_VERBOSE=1) shows everything.

Reach. The entry points (the CLI, which the per-process launch entry calls) install the filters in
their own process. Warnings are passed on to the processes `multiprocessing` spawns (SGLang's children,
the resource tracker) as `-W` options: Python copies `sys.warnoptions` onto their command line, so
those filters act from the child's first import. Log-record filters need code in the child:
`megagrpo.compat.sglang_cpu` calls `quiet_child()` when a spawned SGLang process imports it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass

VERBOSE_ENV = "MEGAGRPO_VERBOSE"  # "1": show everything; "0": filtered (set by the entry point)


@dataclass(frozen=True)
class KnownWarning:
    """A warning hidden unless verbose: its category, the start of its message, the module warning."""

    category: type[Warning]
    message: str  # literal prefix; no ':' (it would end the field of a -W option)
    module: str  # the issuing module, exactly (for a SyntaxWarning: the compiled file's path less .py)
    why: str


@dataclass(frozen=True)
class KnownLogRecord:
    """A log record hidden unless verbose: the logger that emits it and the start of its message."""

    logger: str
    message: str  # literal prefix of the formatted message
    why: str


_NO_TE = "megagrpo runs megatron-core's local (torch) layers on a CPU; TE and Apex are GPU-only"
_CPU_SGLANG = "SGLang on a CPU: the quantization and Triton paths it names are never used by megagrpo"

KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        UserWarning, "Transformer Engine and Apex are not installed", "megatron.core.optimizer", _NO_TE
    ),
    KnownWarning(
        UserWarning,
        "Transformer Engine and Apex are not installed",
        "megatron.core.optimizer.optimizer",
        _NO_TE,
    ),
    KnownWarning(
        UserWarning,
        "Transformer Engine and Apex are not installed",
        "megatron.core.optimizer.clip_grads",
        _NO_TE,
    ),
    KnownWarning(
        UserWarning,
        "Transformer Engine and Apex are not installed",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
        _NO_TE,
    ),
    KnownWarning(
        UserWarning,
        "Apex is not installed. Falling back to Torch Norm",
        "megatron.core.models.backends",
        _NO_TE,
    ),
    KnownWarning(
        UserWarning,
        "Apex is not installed. Falling back to Torch Norm",
        "megatron.core.models.gpt.gpt_layer_specs",
        _NO_TE,
    ),
    KnownWarning(
        UserWarning,
        "full scope is deprecated. Use empty cuda_graph_modules",
        "megatron.core.transformer.transformer_config",
        "CUDA-graph scope default inside megatron-core's TransformerConfig; megagrpo captures no CUDA graphs",
    ),
    KnownWarning(
        UserWarning,
        "MimoModelConfig is experimental",
        "megatron.core.models.mimo.config.base_configs",
        "printed when megatron-core's multimodal package is imported; megagrpo does not use it",
    ),
    KnownWarning(
        FutureWarning,
        "`torch.distributed.reduce_scatter_tensor` is deprecated",
        "torch.distributed.c10d_logger",
        "megatron-core's distributed optimizer calls the old name; same collective",
    ),
    KnownWarning(
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is deprecated",
        "torch.distributed.c10d_logger",
        "megatron-core's distributed optimizer calls the old name; same collective",
    ),
    KnownWarning(
        UserWarning,
        "Only CUDA, HIP and XPU support AWQ currently",
        "sglang.srt.layers.quantization.awq.awq",
        _CPU_SGLANG,
    ),
    KnownWarning(
        UserWarning,
        "Only CUDA, MUSA and NPU support GGUF quantization currently",
        "sglang.srt.layers.quantization.gguf",
        _CPU_SGLANG,
    ),
    KnownWarning(
        UserWarning,
        "Triton is not supported on current platform, roll back to CPU",
        "sglang.kernels.ops.attention.fla.utils",
        _CPU_SGLANG,
    ),
    KnownWarning(
        UserWarning,
        "resource_tracker",
        "multiprocessing.resource_tracker",
        "SGLang's children exit without unlinking their semaphores; the tracker unlinks them, which is "
        "its job, and reports it",
    ),
)

# A SyntaxWarning is issued while a file compiles (each start, where bytecode is not cached), with the
# file's path less `.py` as its "module": (message prefix, package, the file's path inside the package).
KNOWN_SYNTAX_WARNINGS: tuple[tuple[str, str, str], ...] = (
    ("invalid escape sequence", "megatron", "core/inference/contexts/kv_block_allocator"),
)

KNOWN_LOG_RECORDS: tuple[KnownLogRecord, ...] = (
    KnownLogRecord(
        "sglang.srt.entrypoints.engine",
        "Using custom SIGQUIT handler",
        "printed at every engine start: megagrpo's engine takes SIGQUIT while SGLang starts (rollout.engines.engine)",
    ),
    KnownLogRecord(
        "torch.utils.cpp_extension",
        "No CUDA runtime is found",
        "the CUDA build of torch on a machine without a GPU; megagrpo builds no extensions",
    ),
    KnownLogRecord(
        "megatron.core.models.gpt.gpt_model",
        "GPTModel IS DEPRECATED",
        "megagrpo's learner is built on GPTModel on purpose (megatron-core 0.19's MoE path)",
    ),
    KnownLogRecord(
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel: full_param_layout not provided",
        "megatron-core computes the same layout itself",
    ),
    KnownLogRecord(
        "megatron.core.dist_checkpointing.strategies.torch",
        "MCore's async save is deprecated",
        "printed by every checkpoint save; the save itself is megatron-core's supported torch_dist format",
    ),
)


class _KnownRecords(logging.Filter):
    """Drops the records of one logger whose message starts with one of the known prefixes."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def verbose_requested() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def warn_option(w: KnownWarning) -> str:
    """The `-W` option that hides `w` in a child interpreter (literal message prefix, exact module)."""
    return f"ignore:{w.message}:{w.category.__name__}:{w.module}"


def quiet_known_noise(*, verbose: bool = False) -> None:
    """Entry points: hide the known messages in this process and its spawned children, unless `verbose`.

    Records the choice in MEGAGRPO_VERBOSE, which every child inherits (torchrun ranks, SGLang's
    children). Idempotent.
    """
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    if verbose:
        return
    for w in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", re.escape(w.message), w.category, re.escape(w.module) + r"\Z")
        if warn_option(w) not in sys.warnoptions:
            sys.warnoptions.append(warn_option(w))
    for w in _syntax_warnings():
        warnings.filterwarnings("ignore", re.escape(w.message), w.category, re.escape(w.module) + r"\Z")
        if warn_option(w) not in sys.warnoptions:
            sys.warnoptions.append(warn_option(w))
    _filter_log_records()


def _syntax_warnings() -> list[KnownWarning]:
    """KNOWN_SYNTAX_WARNINGS with the files' paths in this installation (found without importing them)."""
    out = []
    for message, package, inner in KNOWN_SYNTAX_WARNINGS:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(location, inner)
            if os.path.isfile(path + ".py") and ":" not in path:
                out.append(KnownWarning(SyntaxWarning, message, path, "a docstring escape in the library"))
    return out


def quiet_child() -> None:
    """In a spawned child: the log-record filters, when the entry point chose the filtered console."""
    if os.environ.get(VERBOSE_ENV) == "0":
        _filter_log_records()


def _filter_log_records() -> None:
    by_logger: dict[str, tuple[str, ...]] = {}
    for r in KNOWN_LOG_RECORDS:
        by_logger[r.logger] = (*by_logger.get(r.logger, ()), r.message)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownRecords) for f in logger.filters):
            logger.addFilter(_KnownRecords(prefixes))
