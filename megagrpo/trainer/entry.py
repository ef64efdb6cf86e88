"""Process-level entry for `megagrpo {train,sft,eval}`: CPU compat, then the stage."""

from __future__ import annotations

from megagrpo.config.schema import Config


def run(mode: str, cfg: Config, *, resume: str | None = None) -> int:
    from megagrpo.compat import apply_cpu_compat

    apply_cpu_compat(megatron=True, sglang=mode != "sft")
    if mode == "sft":
        from megagrpo.trainer.sft import sft

        return sft(cfg, resume=resume)
    if mode == "train":
        from megagrpo.trainer.grpo import train

        return train(cfg, resume=resume)
    if mode == "eval":
        from megagrpo.trainer.evaluate import evaluate

        return evaluate(cfg, resume=resume)
    raise ValueError(f"unknown mode {mode!r}")
