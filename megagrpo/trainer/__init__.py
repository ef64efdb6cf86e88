"""The training loop, its stages (SFT, GRPO, eval), metric sinks, reports and checkpoints."""
