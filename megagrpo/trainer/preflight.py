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

from megagrpo.config.mesh_rules import stage_layer_counts
from megagrpo.config.model import MODEL_TYPE_ALIASES, NOT_TRAINABLE
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


def _read_json(path: Path) -> dict:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MegagrpoError(f"{path}: cannot read it as JSON ({e}); restore the model's file") from None


def _auto_map_classes(auto_map: object, key: str) -> list[str]:
    """The class references `auto_map[key]` names (a string, or [slow, fast] for tokenizers; the legacy
    tokenizer form is the list itself)."""
    ref = auto_map if isinstance(auto_map, (list, tuple)) else (auto_map or {}).get(key)
    refs = ref if isinstance(ref, (list, tuple)) else [ref]
    return [r for r in refs if isinstance(r, str)]


def remote_code_needed(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> list[str]:
    """What of the model's files transformers would load only with trust_remote_code, as
    "FILE (auto_map CLASSES)"; [] when its own classes serve.

    transformers' rule (AutoConfig / AutoTokenizer.from_pretrained, v5): code is needed where the file's
    auto_map names a class and transformers has no local one: for config.json, its model_type is not
    registered; for tokenizer_config.json, neither the config's model_type nor its tokenizer_class is (a
    model type transformers knows to ship a wrong hub class ignores the auto_map). The decision is
    transformers' `resolve_trust_remote_code`, asked with trust_remote_code=False.
    """
    model = Path(model_dir)
    cfg = _read_json(model / "config.json")
    tok_path = Path(tokenizer_dir or model) / "tokenizer_config.json"
    tok = _read_json(tok_path) if tok_path.is_file() else {}
    model_type = cfg.get("model_type")
    if "auto_map" not in cfg and "auto_map" not in tok and model_type not in MODEL_TYPE_ALIASES:
        return []  # megagrpo's families are transformers' own: no import of transformers needed
    from transformers.dynamic_module_utils import resolve_trust_remote_code
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    def needs(where: Path, local: bool, classes: list[str]) -> list[str]:
        try:
            resolve_trust_remote_code(False, str(where.parent), local, bool(classes))
        except ValueError:
            return [f"{where} (auto_map {', '.join(classes)})"]
        return []

    known = model_type in CONFIG_MAPPING_NAMES
    config_classes = _auto_map_classes(cfg.get("auto_map"), "AutoConfig")
    if not known and not config_classes:
        raise MegagrpoError(
            f"{model / 'config.json'}: model_type={model_type!r} is unknown to transformers and the file has "
            "no auto_map naming its configuration class; restore the checkpoint's published config.json "
            "and its configuration_*.py"
        )
    missing = needs(model / "config.json", known, config_classes)
    tok_classes = _auto_map_classes(tok.get("auto_map"), "AutoTokenizer")
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS:
        tok_classes = []  # transformers skips this auto_map without trust_remote_code
    name = tok.get("tokenizer_class")
    local_tok = (known and TOKENIZER_MAPPING_NAMES.get(model_type) is not None) or (
        isinstance(name, str)
        and (tokenizer_class_from_name(name) or tokenizer_class_from_name(name + "Fast")) is not None
    )
    return missing + needs(tok_path, local_tok, tok_classes)


def check_remote_code(cfg: Config, stage: str) -> None:
    """Refuse, before anything starts, a model whose config or tokenizer transformers and SGLang load only
    by running the checkpoint's Python, unless model.trust_remote_code allows it."""
    if cfg.model.trust_remote_code:
        return
    field, model = model_field(cfg, stage)
    missing = remote_code_needed(model, cfg.model.tokenizer_path)
    if missing:
        raise MegagrpoError(
            f"{field}={model!r} loads only with the checkpoint's own Python: {'; '.join(missing)}. "
            "transformers and SGLang run it in every process that loads the model; if you trust the "
            "checkpoint, set model.trust_remote_code=true"
        )


def check_stage_inputs(cfg: Config, stage: str, resume: str | None) -> None:
    """Raise MegagrpoError for what the stage would otherwise refuse only after it has started:
    routing replay on a dense model, a multi-turn environment or tool parser that does not exist, a
    `--resume` that is no checkpoint, or one of another model or stage."""
    from megagrpo.bridge.hf_config import arch_from_hf

    field, model = model_field(cfg, stage)
    arch = arch_from_hf(model)  # raises naming config.json for a model family megagrpo cannot build
    if arch.family in NOT_TRAINABLE:
        raise MegagrpoError(
            f"{field}={model!r}: model family {arch.family!r} cannot be trained yet: "
            f"{NOT_TRAINABLE[arch.family]}; choose a model of another family"
        )
    check_remote_code(cfg, stage)
    m = cfg.mesh
    # the pipeline stages' layer counts must add up to this model's layers (mesh.first/last_stage_layers)
    stage_layer_counts(arch.num_layers, m.pp, m.first_stage_layers, m.last_stage_layers)
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
