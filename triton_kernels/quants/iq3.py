# Torch reference dequantizers for the 3-bit lattice types: each group of 4 weights is one point of a
# 4-dimensional grid (quants/lattice.py) with a sign per weight (bytes are offsets inside one 256-element
# super-block).
#
#   IQ3_XXS 98 B: d f16 @0 | qs[64] @2 | scales_signs u32[8] @66
#       qs[k] indexes point k (weights 4k .. 4k + 3); u32 g covers weights 32g ..: four 7-bit sign indices
#       (bits 7l .., each for 8 weights) and the scale s in its top 4 bits.
#       w = (d * (0.5 + s) * 0.5) * grid[point][j] * sign
#   IQ3_S  110 B: d f16 @0 | qs[64] @2 | qh[8] @66 | signs[32] @74 | scales[4] @106
#       point k = qs[k] | ((qh[k / 8] >> (k % 8)) & 1) << 8; signs[b] holds the sign bits of weights
#       8b .. 8b + 7; the 8 scale nibbles (low, then high, of each byte) each cover 32 weights.
#       w = (d * (1 + 2 s)) * grid[point][j] * sign
# Each product is formed in gguf-py's order in float32, so the results are bitwise those of
# `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, f16_at, to_rows
from vegaserve.triton_kernels.quants.lattice import grid, sign_bytes, signs, u32

SUPER_BLOCK = 256


def _assemble(blocks, scale, points, sign_byte, name: str) -> torch.Tensor:
    """w for 64 points [..., 64], 32 sign bytes [..., 32] (8 weights each), 8 scales [..., 8]."""
    lead = blocks.shape[:-1]
    g = grid(name, blocks.device)[points.to(torch.int64)].reshape(*lead, 8, 4, 8)
    w = scale.reshape(*lead, 8, 1, 1) * g
    w = w * signs(sign_byte).reshape(*lead, 8, 4, 8)
    return to_rows(w, blocks, SUPER_BLOCK)


def dequantize_iq3_xxs(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 98)
    lead = blocks.shape[:-1]
    aux = u32(blocks[..., 66:98].reshape(*lead, 8, 4))  # [..., 8]
    scale = f16_at(blocks, 0) * (0.5 + (aux >> 28).to(torch.float32)) * 0.5
    index7 = (aux[..., None] >> torch.tensor([0, 7, 14, 21], device=raw.device)) & 127
    return _assemble(blocks, scale, blocks[..., 2:66], sign_bytes(index7).reshape(*lead, 32), "IQ3_XXS")


def dequantize_iq3_s(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 110)
    lead = blocks.shape[:-1]
    qh = (blocks[..., 66:74].to(torch.int32)[..., None] >> torch.arange(8, device=raw.device)) & 1
    points = blocks[..., 2:66].to(torch.int32) | (qh.reshape(*lead, 64) << 8)
    sc = blocks[..., 106:110]
    s = torch.stack((sc & 15, sc >> 4), dim=-1).reshape(*lead, 8).to(torch.int32)
    scale = f16_at(blocks, 0) * (1 + 2 * s).to(torch.float32)
    return _assemble(blocks, scale, points, blocks[..., 74:106], "IQ3_S")
