# Torch reference dequantizers for the 1.5-bit lattice types: each group of 8 weights is one point of an
# 8-dimensional grid of -1, 0, 1 (quants/lattice.py, IQ1_S's table for both), shifted by +-1/8 and scaled
# (bytes are offsets inside one 256-element super-block).
#
#   IQ1_S 50 B: d f16 @0 | qs[32] @2 | qh u16[8] @34
#       u16 h = qh[g] covers weights 32g .. 32g + 31 (points 4g + l): point = qs[4g + l] | ((h >> 3l) & 7) << 8,
#       scale d * (2 ((h >> 12) & 7) + 1), shift -1/8 where bit 15 is set, else +1/8.
#   IQ1_M 56 B: qs[32] @0 | qh[16] @32 | scales u16[4] @48
#       qh[k / 2]'s nibble (low for even k) n gives point k = qs[k] | (n & 7) << 8 and its shift (-1/8 where
#       n & 8); the 3-bit fields (bits 3i ..) of the four u16 scales s_0 .. s_15 each cover two points;
#       d is the f16 whose four nibbles are the top nibbles of the scales (lowest nibble from scales[0]).
#   w = (d * (2 s + 1)) * (grid[point][j] + shift)
# Each product is formed in gguf-py's order in float32, so the results are bitwise those of
# `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, f16_at, to_rows
from vegaserve.triton_kernels.quants.lattice import grid, u16

SUPER_BLOCK = 256
DELTA = 0.125


def _assemble(blocks, scale, points, negative, per_scale: int) -> torch.Tensor:
    """w for 32 points [..., 32], their shift signs [..., 32] (bool), scales [..., 32 / per_scale]."""
    lead = blocks.shape[:-1]
    g = grid("IQ1_S", blocks.device)[points.to(torch.int64)]  # [..., 32, 8]
    shift = torch.where(negative, -DELTA, DELTA).to(torch.float32)[..., None]
    w = scale.reshape(*lead, -1, 1, 1) * (g + shift).reshape(*lead, 32 // per_scale, per_scale, 8)
    return to_rows(w, blocks, SUPER_BLOCK)


def dequantize_iq1_s(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 50)
    lead = blocks.shape[:-1]
    h = u16(blocks[..., 34:50].reshape(*lead, 8, 2))  # [..., 8]
    scale = f16_at(blocks, 0) * (2 * ((h >> 12) & 7) + 1).to(torch.float32)
    high = (h[..., None] >> torch.tensor([0, 3, 6, 9], device=raw.device)) & 7
    points = blocks[..., 2:34].to(torch.int32) | (high.reshape(*lead, 32) << 8)
    negative = ((h & 0x8000) != 0)[..., None].expand(*lead, 8, 4).reshape(*lead, 32)
    return _assemble(blocks, scale, points, negative, 4)


def dequantize_iq1_m(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 56)
    lead = blocks.shape[:-1]
    sc = u16(blocks[..., 48:56].reshape(*lead, 4, 2))  # [..., 4]
    top = (sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=raw.device, dtype=torch.int32)
    d_bits = top[..., 0] | top[..., 1] | top[..., 2] | top[..., 3]
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32)[..., None]
    s = (sc[..., None] >> torch.tensor([0, 3, 6, 9], device=raw.device, dtype=torch.int32)) & 7
    scale = d * (2 * s.reshape(*lead, 16) + 1).to(torch.float32)
    qh = blocks[..., 32:48]
    nib = torch.stack((qh & 15, qh >> 4), dim=-1).reshape(*lead, 32).to(torch.int32)
    points = blocks[..., 0:32].to(torch.int32) | ((nib & 7) << 8)
    return _assemble(blocks, scale, points, (nib & 8) != 0, 2)
