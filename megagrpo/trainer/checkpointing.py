"""Trainer checkpoints: the learner's atomic dist checkpoint plus the trainer's own JSON state.

The trainer state (step, data-loader position, adaptive caps, ...) travels inside the learner checkpoint's
`meta.json` (`extra`), so one atomic rename publishes both and they can never disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from megagrpo.bridge.hf_io import MTP_FILES, SIDE_FILES, HFCheckpoint, atomic_output_dir, mtp_layer_prefixes
from megagrpo.errors import MegagrpoError
from megagrpo.learner.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    read_meta,
    save_checkpoint,
    step_dir,
)


def save(
    learner: Any,
    root: str | Path,
    step: int,
    extra: dict,
    *,
    keep_last: int,
    hf_dir: str | Path | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. `hf_dir`'s config.json and
    tokenizer files travel with the checkpoint, and its multi-token-prediction tensors (`mtp_files`), so
    `convert_megatron_to_hf` can turn it into a full HF model, MTP layers included."""
    side = []
    if hf_dir is not None:
        side = [Path(hf_dir) / n for n in ("config.json", *SIDE_FILES) if (Path(hf_dir) / n).is_file()]
        if not dist.is_initialized() or dist.get_rank() == 0:  # the rank that copies the side files
            side += mtp_files(Path(hf_dir), Path(root))
    path = save_checkpoint(
        step_dir(root, step),
        learner.model,
        optimizer=learner.optimizer,
        scheduler=learner.scheduler,
        step=step,
        arch=learner.arch,
        extra=extra,
        side_files=side,
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        prune_checkpoints(root, keep_last)
    if dist.is_initialized():
        dist.barrier()
    return path


def mtp_files(hf_dir: Path, root: Path) -> list[Path]:
    """`hf_dir`'s multi-token-prediction tensors as `mtp-*.safetensors` shards (`HFCheckpoint.write_mtp`,
    the layout `convert hf-to-megatron` leaves beside a checkpoint), extracted once per checkpoint root
    into `root/.mtp-source` and copied beside every checkpoint: the learner does not train them, and the
    export writes them back unchanged. Cost: their bytes once per checkpoint (DeepSeek-V3: one layer of
    62, next to the 16 bytes a parameter of optimizer state that the checkpoint holds). [] without any."""
    if not mtp_layer_prefixes(str(hf_dir)):  # config.json alone says whether there are any
        return []
    cache = root / ".mtp-source"
    if not (cache / "done").is_file():
        ckpt = HFCheckpoint(hf_dir)
        if not ckpt.mtp_names():
            return []
        with atomic_output_dir(cache) as tmp:
            ckpt.write_mtp(tmp)
            (tmp / "done").write_text(str(hf_dir) + "\n")
        ckpt.close()
    return sorted(cache.glob(MTP_FILES))


def resolve(root: str | Path, resume: str) -> Path | None:
    """`auto`: the newest complete checkpoint under `root` (None when there is none); else a path."""
    if resume == "auto":
        return latest_checkpoint(root)
    path = Path(resume)
    read_meta(path)  # raises a MegagrpoError naming the path when it is not a usable checkpoint
    return path


def load(learner: Any, path: str | Path) -> dict:
    """Load weights, optimizer, scheduler and RNG into `learner`; return the trainer state saved with them."""
    meta = load_checkpoint(
        path, learner.model, optimizer=learner.optimizer, scheduler=learner.scheduler, arch=learner.arch
    )
    if "step" not in meta.extra:
        raise MegagrpoError(
            f"checkpoint {path} has no trainer state (it was not written by megagrpo train/sft); "
            "use it as initial weights instead of --resume"
        )
    learner.step = meta.step
    return meta.extra


def router_state(learner: Any) -> dict | None:
    """The MoE routers' state a checkpoint keeps (`RouterTaps.state_dict`: the load-drift tracker's previous
    `[L, E]` expert load, over every MoE layer), written once into `meta.json` by rank 0. Every rank holds
    the same table (the step's load is summed over the replica and DP before the tracker sees it,
    `moe.replay.StepReplay.old_pass_metrics`), so this rank's copy is the table: no collective, and
    L × E floats per checkpoint whatever the world size. None for a dense model."""
    if not learner.arch.is_moe:
        return None
    from megagrpo.moe.routers import router_taps

    return router_taps(learner).state_dict()


def load_router_state(learner: Any, extra: dict) -> None:
    """Every rank restores `router_state` from the checkpoint's single copy, on any mesh (the table covers
    every MoE layer). Checkpoints written before issue 25 hold one equal copy per rank under
    `router_taps`; the first is taken."""
    if not learner.arch.is_moe:
        return
    st = extra.get("router_state")
    if st is None and extra.get("router_taps"):
        st = extra["router_taps"][0]
    if st is not None:
        from megagrpo.moe.routers import router_taps

        router_taps(learner).load_state_dict(st)
