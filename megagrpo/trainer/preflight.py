"""Checks of what a stage will read, run by the CLI before any process group, learner or engine starts.

`check_config_paths` (config/loader.py) and `check_mesh` cover the files and the mesh; this module covers
what needs the model's `config.json` or a checkpoint's `meta.json`: both are small JSON files, read without
torch.distributed, so a wrong `--resume`, a checkpoint of another model or a routing replay on a dense
model fails in a second instead of after the learner and the engines have started (minutes, and an
allocation, at scale).

The stage's model and checkpoint root are defined here once; the trainers use the same functions.
"""

from __future__ import annotations

from pathlib import Path

from megagrpo.config.schema import Config
from megagrpo.errors import MegagrpoError

NO_RESUME = (None, "never", "none")


def model_field(cfg: Config, stage: str) -> tuple[str, str]:
    """(config field, HF directory) of the model a stage starts from: SFT from sft.base_path when set."""
    if stage == "sft" and cfg.sft.base_path is not None:
        return "sft.base_path", cfg.sft.base_path
    return "model.hf_path", cfg.model.hf_path


def checkpoint_root(cfg: Config, stage: str) -> Path:
    """Where a stage saves its checkpoints (and `--resume auto` looks): SFT in its own `sft/` below."""
    root = Path(cfg.checkpoint.dir)
    return root / "sft" if stage == "sft" else root


def resume_request(cfg: Config, stage: str, resume: str | None) -> str | None:
    """The effective resume request: `--resume`, else checkpoint.resume (eval: only an explicit one)."""
    if resume is not None:
        return resume
    return None if stage == "eval" else cfg.checkpoint.resume


def check_stage_inputs(cfg: Config, stage: str, resume: str | None) -> None:
    """Raise MegagrpoError for what the stage would otherwise refuse only after it has started:
    routing replay on a dense model, a multi-turn environment or tool parser that does not exist, a
    `--resume` that is no checkpoint, or one of another model or stage."""
    from megagrpo.bridge.hf_config import arch_from_hf

    field, model = model_field(cfg, stage)
    arch = arch_from_hf(model)  # raises naming config.json for a model family megagrpo cannot build
    if stage == "train" and cfg.replay != "none" and not arch.is_moe:
        raise MegagrpoError(
            f"replay: {cfg.replay} replays MoE routing, but {field}={model!r} is a dense model (no experts "
            "in its config.json), so there is nothing to replay; set replay=none, or point "
            f"{field} at a MoE model"
        )
    if stage != "sft":
        from megagrpo.trainer.episodes import check_multi_turn

        check_multi_turn(cfg.rollout.multi_turn)  # imports the user's environment module, builds one
    request = resume_request(cfg, stage, resume)
    if request in NO_RESUME:
        return
    _check_resume(cfg, stage, request, arch, field, model)


def _check_resume(cfg: Config, stage: str, request: str, arch, field: str, model: str) -> None:
    from megagrpo.learner.checkpoint import check_arch, latest_checkpoint, read_meta

    if request == "auto":
        path = latest_checkpoint(checkpoint_root(cfg, stage))
        if path is None:
            return  # a fresh start
    else:
        path = Path(request)
    meta = read_meta(path)  # raises naming the path when it is no complete megagrpo checkpoint
    check_arch(path, meta, arch, source=f"{field}={model!r}")
    if stage == "eval":
        return  # an evaluation reads the weights of a checkpoint of any stage
    saved_stage = meta.extra.get("stage")
    if "step" not in meta.extra:
        raise MegagrpoError(
            f"checkpoint {path} has no trainer state (it was not written by megagrpo train or sft); "
            f"--resume continues a run: convert it to an HF directory and set {field} to it instead"
        )
    if saved_stage is not None and saved_stage != stage:
        if saved_stage == "sft":
            how = (
                "the RL stage starts from the SFT model instead: set model.hf_path to the SFT output "
                f"(sft.output_dir={cfg.sft.output_dir!r}) or to this checkpoint converted with "
                f"`megagrpo convert megatron-to-hf {path} DIR`, and drop --resume"
            )
        else:
            how = f"resume a checkpoint of `megagrpo {stage}` (under {checkpoint_root(cfg, stage)})"
        raise MegagrpoError(
            f"checkpoint {path} was written by `megagrpo {saved_stage}`, not `megagrpo {stage}`; {how}"
        )
    if not meta.has_optimizer:
        raise MegagrpoError(
            f"checkpoint {path} holds no optimizer state (it was saved with weights only); --resume needs "
            f"a checkpoint saved during training, or convert it and set {field} to it as initial weights"
        )
