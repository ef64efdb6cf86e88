"""MXFP4 expert weights (gpt-oss's release) dequantised exactly at load.

Format: OCP Microscaling Formats (MX) v1.0, MXFP4: blocks of 32 FP4 E2M1 elements (two per byte, the low
nibble first) sharing one E8M0 scale 2^(s - 127). gpt-oss ships each stacked expert tensor `name` as
`name_blocks` [E, rows, G, 16] uint8 and `name_scales` [E, rows, G] uint8, whose dequantised
[E, rows, 32 G] is transposed to transformers' [E, 32 G, rows] (`transformers.integrations.mxfp4.
_convert_moe_packed_tensors`). Every E2M1 value times a power of two in bf16's range is a bf16 number, so
the result is exact: computed in fp32 (exact) and rounded to bf16 (no rounding happens).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

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


# E2M1 magnitudes (codes 0-7) and the rounding thresholds between neighbours, with round-half-to-even on
# the mantissa bit: a tie goes to 0, 1, 1, 2, 2, 4, 4 (>= where the upper neighbour is the even one)
_UP_AT = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E2M1_EMAX = 2  # largest E2M1 magnitude 6 = 1.5 * 2^2


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[*lead, 32 G, rows] (transformers' layout) -> blocks [*lead, rows, G, 16] uint8, scales
    [*lead, rows, G] uint8: the inverse of `dequantize_mxfp4`.

    OCP MX v1.0 section 6.3: per 32-element block, scale 2^(floor(log2 amax) - 2), elements rounded to
    E2M1 (half to even, saturating at 6). Values that are MXFP4 numbers (a checkpoint read from MXFP4 and
    not changed) come back exactly; others are rounded. An all-zero block gets scale 2^0."""
    *lead, cols, rows = values.shape
    if cols % BLOCK:
        raise MegagrpoError(f"MXFP4 needs {BLOCK} | the input dimension, got {cols}")
    v = values.float().transpose(-1, -2).reshape(*lead, rows, cols // BLOCK, BLOCK)
    amax = v.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-149))) - E2M1_EMAX, 0.0)
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(v.abs(), -exp.unsqueeze(-1))
    code = torch.zeros_like(scaled, dtype=torch.uint8)
    for t, inclusive in _UP_AT:
        code += (scaled >= t if inclusive else scaled > t).to(torch.uint8)
    code = code | (torch.signbit(v).to(torch.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + E8M0_BIAS).to(torch.uint8)


# what gpt-oss's release leaves unquantised (its config.json's quantization_config)
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
}  # fmt: skip


def mxfp4_names(arch: Any) -> list[str]:
    """The HF tensors an MXFP4 export quantises: the stacked expert weights (not their biases)."""
    from megagrpo.bridge.maps import param_maps

    names = [n for m in param_maps(arch) if m.stacked for n in m.hf if not n.endswith("_bias")]
    if not names:
        raise MegagrpoError(f"model family {arch.family!r} has no stacked expert weights to write as MXFP4")
    return list(dict.fromkeys(names))


def mxfp4_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], names: Iterable[str]
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The export's buckets with each tensor of `names` written as its `_blocks` and `_scales` (as the
    release ships them); every other tensor unchanged. Memory: one bucket and its quantised copy."""
    quantised = set(names)
    for bucket in buckets:
        out: list[tuple[str, torch.Tensor]] = []
        for name, t in bucket:
            if name in quantised:
                blocks, scales = quantize_mxfp4(t)
                out += [(name + "_blocks", blocks), (name + "_scales", scales)]
            else:
                out.append((name, t))
        yield out
