"""Checkpoint conversion: HF -> megatron-core dist checkpoint (`hf_to_megatron`) and back (`megatron_to_hf`).

Both build the megatron model through the learner's builder and move tensors through `megagrpo.bridge`'s
parameter maps; `megagrpo convert` and tools/convert_*.py call their `main`.
"""
