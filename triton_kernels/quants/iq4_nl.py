# Torch reference dequantizer for IQ4_NL: 4-bit codes that index a fixed non-linear table of 16 levels,
# denser near zero where most weights lie.
#
#   IQ4_NL 18 B per 32 elements: d f16 @0 | qs[16] @2       w = d * LEVELS[q]
#   Element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16] (as Q4_0).
# The table is part of the format (ggml's kvalues_iq4nl). Each weight is one float32 product of exact
# operands, so the results are bitwise those of `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, constant, f16_at, low_high_nibbles, to_rows

BLOCK = 32
LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequantize_iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 18)
    levels = constant(LEVELS, torch.float32, raw.device)
    w = levels[low_high_nibbles(blocks[..., 2:]).to(torch.int32)]
    return to_rows(w.mul_(f16_at(blocks, 0)), blocks, BLOCK)
