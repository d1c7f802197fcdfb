# Torch reference dequantizer for MXFP4 (OCP microscaling FP4, as gpt-oss ships its experts).
#
#   MXFP4 17 B per 32 elements: e u8 @0 | qs[16] @1         w = 2^(e - 127) * FP4[q]
#   Element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16].
#   FP4 is e2m1: sign bit 3, then {0, .5, 1, 1.5, 2, 3, 4, 6}.
# Like ggml we store the e2m1 values doubled (integers) and halve the scale instead: half = 2^(e - 128),
# built directly as float32 bits so that it is exact for every e, including e = 0 and 1 whose halves are
# float32 subnormals (bits 0x00200000 << e). The product is exact, so the results are bitwise those of
# `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, constant, low_high_nibbles, to_rows

BLOCK = 32
DOUBLED_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) as float32 (exact, never inf: e = 255 gives 2^127)."""
    e = e.to(torch.int32)
    subnormal = torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e.clamp(max=1))
    normal = torch.bitwise_left_shift(e - 1, 23)
    return torch.where(e < 2, subnormal, normal).view(torch.float32)


def dequantize_mxfp4(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 17)
    values = constant(DOUBLED_E2M1, torch.float32, raw.device)
    w = values[low_high_nibbles(blocks[..., 1:]).to(torch.int32)]
    return to_rows(w.mul_(half_scale(blocks[..., 0:1])), blocks, BLOCK)
