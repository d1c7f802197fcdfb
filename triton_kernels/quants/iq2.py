# Torch reference dequantizers for the 2-bit lattice types: each group of 8 weights is one point of an
# 8-dimensional grid (quants/lattice.py) with a sign per weight, times a 4-bit group scale
# (bytes are offsets inside one 256-element super-block).
#
#   IQ2_XXS 66 B: d f16 @0 | qs u32[16] @2
#       qs is 8 pairs (a, b) of u32, one per 32 weights: the bytes of a index 4 grid points; b holds four
#       7-bit sign indices (bits 7l ..) and the scale s in its top 4 bits.
#   IQ2_XS  74 B: d f16 @0 | qs u16[32] @2 | scales[8] @66
#       qs[k]: grid point k & 511, sign index k >> 9; the 16 scale nibbles (low, then high, of each byte)
#       each cover two points.
#   IQ2_S   82 B: d f16 @0 | qs[32] @2 | signs[32] @34 | qh[8] @66 | scales[8] @74
#       point k = qs[k] | ((qh[k / 4] >> 2 (k % 4)) & 3) << 8; signs[k] holds point k's 8 sign bits; scales
#       as IQ2_XS.
#   w = (d * (0.5 + s) * 0.25) * grid[point][j] * sign      (signs: lattice.sign_bytes of the 7-bit index)
# Each product is formed in gguf-py's order in float32, so the results are bitwise those of
# `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, f16_at, to_rows
from vegaserve.triton_kernels.quants.lattice import grid, sign_bytes, signs, u16, u32

SUPER_BLOCK = 256


def _group_scale(d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """d [..., 1] times (0.5 + s) / 4 for 4-bit scales s [..., G]: [..., G]."""
    return d * (0.5 + s.to(torch.float32)) * 0.25


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[..., n]` bytes -> `[..., 2n]`: each byte's low nibble, then its high one."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _assemble(blocks, scale, points, sign_byte, name: str, per_scale: int) -> torch.Tensor:
    """w for points [..., P] (grid indices) and their sign bytes [..., P], scale [..., P / per_scale]."""
    g = grid(name, blocks.device)[points.to(torch.int64)]  # [..., P, 8]
    lead = blocks.shape[:-1]
    w = scale.reshape(*lead, -1, 1, 1) * g.reshape(*lead, scale.shape[-1], per_scale, 8)
    w = w * signs(sign_byte).reshape(w.shape)
    return to_rows(w, blocks, SUPER_BLOCK)


def dequantize_iq2_xxs(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 66)
    lead = blocks.shape[:-1]
    pairs = blocks[..., 2:66].reshape(*lead, 8, 8)
    b = u32(pairs[..., 4:8])  # [..., 8]
    scale = _group_scale(f16_at(blocks, 0), b >> 28)
    index7 = (b[..., None] >> torch.tensor([0, 7, 14, 21], device=raw.device)) & 127  # [..., 8, 4]
    return _assemble(blocks, scale, pairs[..., 0:4].reshape(*lead, 32), sign_bytes(index7).reshape(*lead, 32),
                     "IQ2_XXS", 4)


def dequantize_iq2_xs(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 74)
    q = u16(blocks[..., 2:66].reshape(*blocks.shape[:-1], 32, 2))
    scale = _group_scale(f16_at(blocks, 0), _nibbles(blocks[..., 66:74]))
    return _assemble(blocks, scale, q & 511, sign_bytes(q >> 9), "IQ2_XS", 2)


def dequantize_iq2_s(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 82)
    lead = blocks.shape[:-1]
    qh = blocks[..., 66:74].to(torch.int32)[..., None] >> torch.tensor([0, 2, 4, 6], device=raw.device)
    points = blocks[..., 2:34].to(torch.int32) | ((qh & 3).reshape(*lead, 32) << 8)
    scale = _group_scale(f16_at(blocks, 0), _nibbles(blocks[..., 74:82]))
    return _assemble(blocks, scale, points, blocks[..., 34:66], "IQ2_S", 2)
