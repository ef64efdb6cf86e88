"""CPU placement of a sampler beside its learner: the engine's processes on their own cores.

An SGLang engine's scheduler runs in child processes, and a child inherits its parent's CPU affinity and
environment when it starts. So the engine is started with this process pinned to the engine's cores (and
`OMP_NUM_THREADS` set to their count), and the process then pins itself, and torch's intra-op pool, to
the learner's cores. Learner and sampler then compute at the same time without taking each other's
cores, which is what `rollout.mode: async` overlaps (on GPUs the engines get their own devices instead).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megagrpo.errors import MegagrpoError


@dataclass(frozen=True)
class CorePlacement:
    learner: tuple[int, ...]
    engine: tuple[int, ...]
    available: tuple[int, ...]  # the cores before pinning (`release` returns to them)


def core_placement(engine_cores: list[int] | None, *, available: set[int] | None = None) -> CorePlacement:
    """The engine's cores (`rollout.placement.engine_cores`, or the last available core when None) and
    the learner's (the other available cores). Raises when they leave the learner no core."""
    avail = sorted(available if available is not None else os.sched_getaffinity(0))
    if engine_cores is None:
        if len(avail) < 2:
            raise MegagrpoError(
                f"rollout.mode=async: this process may use {len(avail)} core(s) ({avail}); the sampler and "
                "the learner need one each. Run on a machine or allocation with 2 cores or more, or use "
                "rollout.mode=colocated"
            )
        engine_cores = [avail[-1]]
    missing = sorted(set(engine_cores) - set(avail))
    if missing:
        raise MegagrpoError(
            f"rollout.placement.engine_cores: core(s) {missing} are not available to this process (it may "
            f"use {avail}); choose engine cores among them"
        )
    learner = tuple(c for c in avail if c not in set(engine_cores))
    if not learner:
        raise MegagrpoError(
            f"rollout.placement.engine_cores={sorted(engine_cores)} takes every core this process may use "
            f"({avail}); leave at least one for the learner"
        )
    return CorePlacement(learner=learner, engine=tuple(sorted(engine_cores)), available=tuple(avail))


@contextmanager
def engine_cores(placement: CorePlacement) -> Iterator[None]:
    """Inside: this process runs on the engine's cores with OMP_NUM_THREADS = their count, so an engine
    started here inherits both. After: the learner's cores, and torch's threads = their count."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.sched_setaffinity(0, placement.engine)
    os.environ["OMP_NUM_THREADS"] = str(len(placement.engine))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
        pin_learner(placement)


def pin_learner(placement: CorePlacement) -> None:
    """This process, and torch's intra-op threads, on the learner's cores."""
    os.sched_setaffinity(0, placement.learner)
    torch.set_num_threads(len(placement.learner))


def release(placement: CorePlacement) -> None:
    """This process back on every core it had before the placement (a finished run in a longer-lived
    process, e.g. several runs in one test process)."""
    os.sched_setaffinity(0, placement.available)
    torch.set_num_threads(len(placement.available))


def disaggregated_cores(engine_cores: list[int] | None) -> CorePlacement | None:
    """The cores of a disaggregated launch's engine ranks (and, the others, its learner ranks) on the CPU:
    `core_placement`'s rule, every engine rank of a node on the engine cores. None on GPUs (each rank has
    its device) and with a single core (nothing to split). Unpinned, SGLang's processes and the learner
    share every core and a step took 2.2x as long here (docs/scaling.md)."""
    if torch.cuda.is_available() or (engine_cores is None and len(os.sched_getaffinity(0)) < 2):
        return None
    return core_placement(engine_cores)


def pin_engine(placement: CorePlacement) -> None:
    """This process on the engine's cores with OMP_NUM_THREADS = their count, for good: an engine rank,
    whose server's processes inherit both."""
    os.sched_setaffinity(0, placement.engine)
    os.environ["OMP_NUM_THREADS"] = str(len(placement.engine))
    torch.set_num_threads(len(placement.engine))
