# Torch reference dequantizers for IQ4_NL and IQ4_XS: 4-bit codes that index a fixed non-linear table of 16 levels,
# denser near zero where most weights lie.
#
#   IQ4_NL 18 B per 32 elements: d f16 @0 | qs[16] @2       w = d * LEVELS[q]
#   Element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16] (as Q4_0).
#   IQ4_XS 136 B per 256 elements: d f16 @0 | scales_h u16 @2 | scales_l[4] @4 | qs[128] @8
#       8 sub-blocks of 32: w = (d * (sc[i] - 32)) * LEVELS[q]; sc[i] is 6-bit: low 4 bits are nibble i % 2
#       (low, then high) of scales_l[i // 2], high 2 bits are bits 2i, 2i+1 of scales_h. Sub-block i's codes
#       are qs[16i .. 16i + 15] in IQ4_NL's nibble order.
# The table is part of the format (ggml's kvalues_iq4nl). Each weight is one float32 product of exact
# operands, so the results are bitwise those of `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, constant, f16_at, low_high_nibbles, to_rows

BLOCK = 32
SUPER_BLOCK = 256
LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequantize_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 18)
    levels = constant(LEVELS, torch.float32, raw.device)
    w = levels[low_high_nibbles(blocks[..., 2:]).to(torch.int32)]
    return to_rows(w.mul_(f16_at(blocks, 0)), blocks, BLOCK)


def dequantize_iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 136)
    lead = blocks.shape[:-1]
    levels = constant(LEVELS, torch.float32, raw.device)
    low = torch.stack((blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4), dim=-1).reshape(*lead, 8).to(torch.int32)
    scales_h = blocks[..., 2].to(torch.int32) | (blocks[..., 3].to(torch.int32) << 8)
    high = (scales_h[..., None] >> (2 * torch.arange(8, device=raw.device))) & 3
    sc = ((low | (high << 4)) - 32).to(torch.float32)
    scale = (f16_at(blocks, 0) * sc).unsqueeze(-1)  # [..., 8, 1]
    q = low_high_nibbles(blocks[..., 8:136].reshape(*lead, 8, 16)).to(torch.int32)  # [..., 8, 32]
    return to_rows(levels[q].mul_(scale), blocks, SUPER_BLOCK)
