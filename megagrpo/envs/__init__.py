"""Environments and tools for multi-turn rollouts, and the sandbox for model-written code."""
