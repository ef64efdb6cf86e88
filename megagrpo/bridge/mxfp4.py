"""MXFP4 expert weights (gpt-oss's release) dequantised exactly at load.

Format: OCP Microscaling Formats (MX) v1.0, MXFP4: blocks of 32 FP4 E2M1 elements (two per byte, the low
nibble first) sharing one E8M0 scale 2^(s - 127). gpt-oss ships each stacked expert tensor `name` as
`name_blocks` [E, rows, G, 16] uint8 and `name_scales` [E, rows, G] uint8, whose dequantised
[E, rows, 32 G] is transposed to transformers' [E, 32 G, rows] (`transformers.integrations.mxfp4.
_convert_moe_packed_tensors`). Every E2M1 value times a power of two in bf16's range is a bf16 number, so
the result is exact: computed in fp32 (exact) and rounded to bf16 (no rounding happens).
"""

from __future__ import annotations

import torch

from megagrpo.errors import MegagrpoError

# E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
BLOCK = 32  # elements per scale
SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [*lead, rows, G, 16] uint8, scales [*lead, rows, G] uint8 -> [*lead, 32 G, rows] bf16.

    `lead` is empty for one expert's slice, [E] for a whole stacked tensor. Raises MegagrpoError for an
    E8M0 NaN (255) or a scale whose values leave bf16's range (no such scale in a trained checkpoint)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MegagrpoError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise MegagrpoError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
            f"(blocks [..., G, {BLOCK // 2}] with scales [..., G])"
        )
    exp = scales.to(torch.int32) - E8M0_BIAS
    if (scales == 255).any() or exp.max() > 125 or exp.min() < -127:
        # 6 * 2^125 is bf16's largest such product below overflow; 0.5 * 2^-127 is still representable
        raise MegagrpoError(
            f"MXFP4 scales outside bf16's exact range: E8M0 in [{scales.min()}, {scales.max()}]"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [*lead, rows, G, 32], low nibble first
    values = torch.ldexp(values, exp.unsqueeze(-1).float())
    out = values.flatten(-2).to(torch.bfloat16)  # [*lead, rows, 32 G]
    return out.transpose(-1, -2).contiguous()
