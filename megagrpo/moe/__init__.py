"""MoE-specific pieces: routing replay (R2/R3) and router statistics. Import submodules directly
(e.g. `megagrpo.moe.stats`); this package imports nothing so that light users never pull in megatron."""
