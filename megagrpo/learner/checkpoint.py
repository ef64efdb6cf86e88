"""Learner checkpoints: megatron-core `dist_checkpointing` (torch_dist backend), atomic, mesh-independent.

A checkpoint is one directory (by convention `<root>/step_<8 digits>`):
  * the torch_dist files of ONE sharded state dict `{"model<i>": chunk i, "optimizer": ..., "scheduler":
    ...}` (megatron's `metadata.json`, `.metadata`, `__*.distcp`). Tensors are stored by global key and
    shape, and the DistributedOptimizer state in its `fully_reshardable` form, so a checkpoint saved on
    any TP x PP x EP x DP mesh loads on any other;
  * `rng/rank<r>.pt`: python, numpy, torch (and CUDA) generator states and megatron's RNG-tracker states
    of each global rank; restored only on the same mesh (a different mesh has different streams);
  * `meta.json`, written last: format tag, step, consumed samples, ModelArch, mesh, megagrpo version,
    the caller's JSON `extra`, and the size of every file (a cheap check for truncated copies).

Atomicity: everything is written into `<dir>.tmp-<uuid>`; after a barrier rank 0 writes `meta.json` and
renames the directory to `<dir>`. A save killed at any point leaves at worst a `*.tmp-*` directory, which
`latest_checkpoint` ignores and the next save of the same name removes; the previous checkpoint is
untouched. Re-saving an existing `<dir>` moves the old one to `<dir>.old-<uuid>` just before the final
rename (a kill between those two renames leaves the old copy there, complete, to rename back by hand).
Every user-facing failure (missing, corrupt, foreign or mismatched checkpoint) raises `MegagrpoError`
naming the path and the fix.

Scripts that save must have an `if __name__ == "__main__":` guard: megatron's writer starts a `spawn`
multiprocessing manager, which re-imports the main module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.errors import MegagrpoError

FORMAT = "megagrpo-dist-ckpt-v1"
META = "meta.json"
RNG_DIR = "rng"
STEP_DIR = re.compile(r"^step_(\d+)$")
_MEGATRON_META = "metadata.json"  # written by dist_checkpointing when its save completes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointMeta:
    """The contents of `meta.json`."""

    step: int
    consumed_samples: int
    arch: dict[str, Any] | None  # ModelArch.to_dict()
    mesh: dict[str, int]  # tp, pp, ep, etp, cp, dp, vpp, world_size at save time
    has_optimizer: bool
    has_scheduler: bool
    megagrpo_version: str
    format: str = FORMAT
    created_unix: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's JSON state (trainer, data order)
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional directory of the checkpoint at `step` under `root`."""
    return Path(root) / f"step_{step:08d}"


# -- save ---------------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike[str],
    model_chunks: list[Any],
    *,
    optimizer: Any | None = None,
    scheduler: Any | None = None,
    step: int,
    consumed_samples: int = 0,
    arch: Any | None = None,
    extra: dict[str, Any] | None = None,
    side_files: list[str | os.PathLike[str]] = (),
) -> Path:
    """Save atomically to `path` (collective: every rank calls it with the same arguments).

    model_chunks: the model chunks of this rank (DDP-wrapped or not; VPP gives several).
    optimizer / scheduler: megatron's optimizer and `OptimizerParamScheduler`, or None for weights only.
    arch: the `ModelArch` (stored so a load can check it and tools can rebuild the model).
    extra: JSON-serialisable caller state (e.g. the trainer's data position), returned by `read_meta`.
    side_files: files copied in beside the shards before publishing (the HF config and tokenizer, so a
    converter or an evaluation can use the checkpoint without the original model directory).
    Returns the final path. An existing checkpoint at `path` is replaced only once the new one is complete.
    """
    from megatron.core import dist_checkpointing

    _require_dist()
    final = Path(path).absolute()
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be JSON-serialisable: {e}") from e
    rank = dist.get_rank()

    box = [None]
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        stale = list(final.parent.glob(f"{final.name}.tmp-*"))  # left by interrupted saves
        if final.is_dir():  # a replaced copy is garbage only once the replacement is in place
            stale += final.parent.glob(f"{final.name}.old-*")
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        tmp = final.parent / f"{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        box = [str(tmp)]
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    try:
        sd, content_meta = _sharded_state_dict(model_chunks, optimizer, scheduler, is_loading=False)
        dist_checkpointing.save(sd, str(tmp), content_metadata=content_meta)
        (tmp / RNG_DIR).mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / RNG_DIR / f"rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            for f in side_files:
                shutil.copy2(f, tmp / Path(f).name)
            meta = CheckpointMeta(
                step=int(step),
                consumed_samples=int(consumed_samples),
                arch=arch.to_dict() if arch is not None else None,
                mesh=_mesh_now(len(model_chunks)),
                has_optimizer=optimizer is not None,
                has_scheduler=scheduler is not None,
                megagrpo_version=_version(),
                created_unix=time.time(),
                extra=extra_json,
                files=_file_sizes(tmp),
            )
            _write_json_durably(tmp / META, dataclasses.asdict(meta))
            _replace_dir(tmp, final)
        dist.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` is moved aside first and removed after."""
    old = None
    if final.exists():
        old = final.parent / f"{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- load ---------------------------------------------------------------------------------------------


def load_checkpoint(
    path: str | os.PathLike[str],
    model_chunks: list[Any],
    *,
    optimizer: Any | None = None,
    scheduler: Any | None = None,
    arch: Any | None = None,
    load_rng: bool = True,
) -> CheckpointMeta:
    """Load the checkpoint at `path` into this rank's model (and optimizer, scheduler), on any mesh.

    Collective. With `optimizer=None` only the weights are read (e.g. a reference model). RNG states
    are restored when `load_rng` and the mesh equals the one that saved; otherwise they keep their
    seeded values (logged). Raises MegagrpoError for a missing, foreign, corrupt or mismatched checkpoint.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    _require_dist()
    path = Path(path).absolute()
    meta = read_meta(path)
    if arch is not None:
        check_arch(path, meta, arch)
    if optimizer is not None and not meta.has_optimizer:
        raise MegagrpoError(
            f"checkpoint {path} holds no optimizer state (it was saved with weights only); load it as "
            "initial weights (optimizer=None) or resume from a checkpoint saved during training"
        )
    if scheduler is not None and not meta.has_scheduler:
        scheduler = None  # a weights-only or scheduler-less save: the schedule starts afresh
    _check_files(path, meta)

    if optimizer is not None:
        init_optimizer_state(optimizer)
    sd, _ = _sharded_state_dict(model_chunks, optimizer, scheduler, is_loading=True)
    try:
        loaded = dist_checkpointing.load(sd, str(path))
    except (Exception, CheckpointException) as e:  # many types for unreadable data; DCP's is a BaseException
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]  # DCP: per-rank tracebacks
        reason = f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"
        raise MegagrpoError(
            f"checkpoint {path} could not be read ({reason}); it is corrupt or incomplete, or its keys do "
            "not match this model. Delete it and resume from an earlier checkpoint under "
            f"{path.parent} (--resume auto picks the newest complete one)"
        ) from e
    for i, chunk in enumerate(model_chunks):
        _unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(_regroup_optimizer_state(loaded["optimizer"], optimizer, path))
    if scheduler is not None:
        scheduler.num_steps = 0  # upstream load_state_dict ADDS the saved count to the current one
        scheduler.load_state_dict(loaded["scheduler"])
    if load_rng:
        _restore_rng(path, meta, len(model_chunks))
    return meta


def read_meta(path: str | os.PathLike[str]) -> CheckpointMeta:
    """Validate that `path` is a complete megagrpo checkpoint and return its `meta.json` (no torch.distributed
    needed). Raises MegagrpoError naming the path and the fix otherwise."""
    path = Path(path)
    if not path.exists():
        hint = ""
        if path.parent.is_dir():
            latest = latest_checkpoint(path.parent)
            hint = f" (the newest complete checkpoint there is {latest})" if latest else ""
        raise MegagrpoError(
            f"checkpoint {path} does not exist{hint}; pass an existing checkpoint directory, or "
            "--resume auto to pick the newest complete one under the checkpoint root"
        )
    if not path.is_dir():
        raise MegagrpoError(
            f"checkpoint {path} is not a directory; pass a checkpoint directory such as <root>/step_00000010"
        )
    if ".tmp-" in path.name:
        raise MegagrpoError(
            f"{path} is an interrupted, incomplete save; delete it and use the checkpoint it would "
            "have replaced"
        )
    meta_file = path / META
    if not meta_file.is_file():
        if (path / _MEGATRON_META).is_file():
            what = (
                "a megatron dist checkpoint without megagrpo's meta.json (not written by megagrpo, "
                "or its save was interrupted)"
            )
        elif any(STEP_DIR.match(p.name) for p in path.iterdir()):
            what = "a checkpoint ROOT, not a checkpoint; pass one of its step_* directories or --resume auto"
        else:
            what = "not a megagrpo checkpoint (no meta.json)"
        raise MegagrpoError(
            f"{path} is {what}; point at a directory written by megagrpo's save_checkpoint "
            "(e.g. <root>/step_00000010); HF weights are converted with tools/convert_hf_to_megatron.py"
        )
    try:
        raw = json.loads(meta_file.read_text())
        if raw.get("format") != FORMAT:
            raise MegagrpoError(
                f"{path} has checkpoint format {raw.get('format')!r}, this megagrpo reads {FORMAT!r}; "
                "use the megagrpo version that wrote it (meta.json megagrpo_version) or re-save it"
            )
        known = {f.name for f in dataclasses.fields(CheckpointMeta)}
        meta = CheckpointMeta(**{k: v for k, v in raw.items() if k in known})
    except MegagrpoError:
        raise
    except (ValueError, TypeError, AttributeError) as e:
        raise MegagrpoError(
            f"{meta_file} is corrupt ({type(e).__name__}: {e}); the checkpoint {path} cannot be trusted: "
            "delete it and resume from an earlier one"
        ) from e
    if not (path / _MEGATRON_META).is_file():
        raise MegagrpoError(
            f"checkpoint {path} lacks megatron's {_MEGATRON_META}: it is incomplete or was damaged; "
            "delete it and resume from an earlier checkpoint"
        )
    return meta


def check_arch(path: str | os.PathLike[str], meta: CheckpointMeta, arch: Any, *, source: str = "") -> None:
    """Raise MegagrpoError when the checkpoint at `path` was saved for another architecture than `arch`
    (a `ModelArch`; `source` names where it comes from, e.g. "model.hf_path='...'"). No process group needed."""
    want = json.loads(json.dumps(arch.to_dict()))  # tuples -> lists, as saved
    if meta.arch is None or meta.arch == want:
        return
    diff = {k: (meta.arch.get(k), v) for k, v in want.items() if meta.arch.get(k) != v}
    than = f" than {source}" if source else ""
    raise MegagrpoError(
        f"checkpoint {path} was saved for a different model architecture{than}: {diff} "
        "(field: (checkpoint, current)); load it with the model config it was trained with"
    )


def _check_files(path: Path, meta: CheckpointMeta) -> None:
    for rel, size in meta.files.items():
        f = path / rel
        if not f.is_file():
            raise MegagrpoError(
                f"checkpoint {path} is incomplete: {rel} is missing; delete it and resume from an "
                "earlier checkpoint"
            )
        if f.stat().st_size != size:
            raise MegagrpoError(
                f"checkpoint {path} is corrupt: {rel} has {f.stat().st_size} bytes, {size} were written; "
                "delete it and resume from an earlier checkpoint"
            )


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under `root` (`--resume auto`), or None if none.

    Only `step_*` directories with a valid `meta.json` count: interrupted saves (`*.tmp-*`) and
    damaged directories are skipped (logged)."""
    root = Path(root)
    if not root.exists():
        return None
    if not root.is_dir():
        raise MegagrpoError(
            f"checkpoint root {root} is a file, not a directory; set checkpoint.dir to a directory"
        )
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        if not (child.is_dir() and STEP_DIR.match(child.name)):
            continue
        try:
            meta = read_meta(child)
        except MegagrpoError as e:
            log.warning("skipping %s: %s", child, e)
            continue
        if best is None or meta.step > best[0]:
            best = (meta.step, child)
    return best[1] if best else None


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints under `root` (call on one rank, after a
    save). Returns the removed paths. Incomplete directories are left for the next save to clean."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    found = []
    for child in Path(root).iterdir():
        if child.is_dir() and STEP_DIR.match(child.name) and (child / META).is_file():
            found.append((int(STEP_DIR.match(child.name).group(1)), child))
    removed = [p for _, p in sorted(found)[:-keep_last]]
    for p in removed:
        shutil.rmtree(p)
    return removed


# -- the sharded state dict ---------------------------------------------------------------------------


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module"):
        module = module.module
    return module


def _sharded_state_dict(
    model_chunks: list[Any], optimizer: Any | None, scheduler: Any | None, *, is_loading: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    from megatron.core import parallel_state

    # fully_reshardable: the DistributedOptimizer state is stored per parameter in model space, so it
    # reshards over TP/PP/EP/DP (dp_reshardable would tie it to the saving DP layout). Its save gathers
    # each DP group's shards of fp32 param, exp_avg and exp_avg_sq into host memory. The memory-efficient
    # variant gathers over the gloo DP group onto DP rank 0 only: 12 bytes per parameter of this
    # model-parallel rank, on one rank of each DP group. The other variant all-gathers over NCCL onto
    # EVERY DP rank (12 bytes * parameters * dp of host memory per model-parallel shard: hundreds of GB
    # per node at 30B), and on the CPU moves tensors with hard-coded `.cuda()`. It needs the gloo groups,
    # which `init_mesh` creates on GPUs too. Both read back interchangeably (a load still allocates the
    # full fp32 world tensors on every DP rank, empty, before the reader fills its slice).
    content = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": True,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    sd_meta = {**content, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    sd: dict[str, Any] = {}
    for i, chunk in enumerate(model_chunks):
        sd[f"model{i}"] = _unwrap(chunk).sharded_state_dict(metadata=sd_meta)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=sd_meta)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    return sd, content


def init_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer its (zero) state, so its sharded state dict can be built for a load.

    megatron's DistributedOptimizer builds that dict from `state_dict()`, which for torch's Adam (the
    fallback without apex/TE) asserts one common per-parameter `step`: absent before the first step.
    `init_state_fn` is megatron's own initialiser (exp_avg, exp_avg_sq); torch Adam also needs `step`.
    The load then overwrites every value.
    """
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None or any(inner.state.values()):
            continue
        init = getattr(opt, "init_state_fn", None)
        if init is not None:
            init(inner, getattr(opt, "config", None))
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


def _regroup_optimizer_state(loaded: dict[Any, Any], optimizer: Any, path: Path) -> Any:
    """Fit the checkpoint's per-optimizer common state to THIS run's optimizer: its mesh and its config.

    Structure: megatron builds one DistributedOptimizer per distinct (dense, expert) data-parallel group,
    chained when there are several; whether there are one or two depends on the mesh (one process: one;
    TP2 without EP: two). The tensors are stored per parameter and load on any structure, but the common
    part (param_groups) is nested per optimizer of the SAVING mesh. `loaded` is the merge of that saved
    nesting with the current one, e.g. `{"optimizer": ..., 0: {...}, 1: {...}}`.

    Config: megatron pairs saved and current param_groups by an identifier that includes the group's
    max_lr and min_lr, so a resume with a changed `optimizer.lr` (routine after an instability) or an SFT
    checkpoint's LR would not find its groups. Here each current group takes the saved group of the same
    structure (lr/wd multipliers, decoupled LR, expert or not) for what the checkpoint owns (Adam's step
    counter; the moments travel in `param_state`), and every hyper-parameter from this run's config
    (lr, min_lr, weight decay, betas, eps): the config wins, as `build_scheduler`'s override mode does.
    """
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    nested = {k: v for k, v in loaded.items() if isinstance(k, int)}
    top = {k: v for k, v in loaded.items() if not isinstance(k, int)}
    saved = ([top] if "optimizer" in top else []) + [v for _, v in sorted(nested.items()) if "optimizer" in v]
    groups = [g for s in saved for g in s["optimizer"].get("param_groups", [])]
    if not groups:
        raise MegagrpoError(
            f"checkpoint {path}: its optimizer state has no param_groups; it is damaged, resume from an "
            "earlier one"
        )
    by_structure: dict[tuple[Any, ...], dict[str, Any]] = {}
    for g in groups:
        by_structure.setdefault(_group_structure(g), g)
    common = {k: v for k, v in saved[0].items() if k != "param_state"}
    per_sub = []
    for sub in subs:
        # The inner torch optimizer's groups: integer params in its state order, this config's values.
        current = sub.optimizer.state_dict()["param_groups"]
        fitted = [_fit_group(cur, by_structure, path) for cur in current]
        per_sub.append({**common, "optimizer": {**saved[0]["optimizer"], "param_groups": fitted}})
    if len(subs) == 1:
        return {**per_sub[0], "param_state": top.get("param_state", nested.get(0, {}).get("param_state"))}
    return {i: {**per_sub[i], "param_state": nested[i]["param_state"]} for i in range(len(subs))}


# The identifier fields megatron takes from the config (ParamGroupOverride's schedule values); the rest of
# `param_group_identifier_keys` is the group's structure.
_CONFIG_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
_CHECKPOINT_GROUP_KEYS = ("step",)  # apex/TE Adam keep their step counter in the group


def _group_structure(group: dict[str, Any]) -> tuple[Any, ...]:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(
        group.get(k, group.get(f"pre_{k}"))
        for k in param_group_identifier_keys
        if k not in _CONFIG_GROUP_KEYS
    )


def _fit_group(
    current: dict[str, Any], saved: dict[tuple[Any, ...], dict[str, Any]], path: Path
) -> dict[str, Any]:
    """The saved group of `current`'s structure, with `current`'s params and hyper-parameters."""
    match = saved.get(_group_structure(current))
    if match is None:
        # A mesh where expert and dense params share one optimizer saves no group flagged
        # is_expert_parallel; a mesh that separates them needs such groups. Their hyper-parameters are the
        # same (megagrpo sets no expert-specific overrides), so the other flag's group stands in.
        flipped = {**current, "is_expert_parallel": not current.get("is_expert_parallel", False)}
        match = saved.get(_group_structure(flipped))
    if match is None:
        raise MegagrpoError(
            f"checkpoint {path}: its optimizer has no parameter group shaped like this run's "
            f"{_group_structure(current)} (saved: {sorted(saved, key=str)}); the grouping of parameters "
            "(weight-decay exclusions, LR multipliers) changed since the save. Resume with the settings it "
            "was saved with, or start the optimizer afresh from its weights (model.hf_path after a convert)"
        )
    keep = {k: match[k] for k in _CHECKPOINT_GROUP_KEYS if k in match}
    return {**match, **current, **keep}


def _mesh_now(num_chunks: int) -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "vpp": num_chunks,
        "world_size": dist.get_world_size(),
    }


# -- RNG ----------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    import numpy as np
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(path: Path, meta: CheckpointMeta, num_chunks: int) -> bool:
    import numpy as np
    from megatron.core import tensor_parallel

    now = _mesh_now(num_chunks)
    if not (path / RNG_DIR).is_dir():  # e.g. written by tools/convert_hf_to_megatron.py: weights only
        log.info("checkpoint %s holds no RNG states; they keep their seeded values", path)
        return False
    if meta.mesh != now:
        log.warning(
            "RNG states not restored: checkpoint %s was saved on mesh %s, this is %s", path, meta.mesh, now
        )
        return False
    f = path / RNG_DIR / f"rank{dist.get_rank()}.pt"
    try:
        state = torch.load(f, weights_only=False)  # our own file: python/numpy generator tuples
    except Exception as e:
        raise MegagrpoError(
            f"checkpoint {path}: RNG state {f} is unreadable ({type(e).__name__}: {e}); delete the "
            "checkpoint and resume from an earlier one, or load with load_rng=False"
        ) from e
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    return True


# -- small helpers ------------------------------------------------------------------------------------


def _require_dist() -> None:
    if not dist.is_initialized():
        raise RuntimeError("checkpoints are collective: initialise the mesh (learner.mesh.init_mesh) first")


def _version() -> str:
    import megagrpo

    return getattr(megagrpo, "__version__", "unknown")


def _file_sizes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != META
    }


def _write_json_durably(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
