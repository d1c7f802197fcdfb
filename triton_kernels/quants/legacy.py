# Torch reference dequantizers for the legacy 32-element block types (bytes are offsets inside one block).
#
#   Q4_0  18 B: d f16 @0 | qs[16] @2                 w = d * (q - 8)     q 4-bit
#   Q4_1  20 B: d f16 @0 | m f16 @2 | qs[16] @4      w = d * q + m       q 4-bit
#   Q5_0  22 B: d f16 @0 | qh[4] @2 | qs[16] @6      w = d * (q - 16)    q 5-bit
#   Q5_1  24 B: d f16 @0 | m f16 @2 | qh[4] @4 | qs[16] @8    w = d * q + m    q 5-bit
#   Q8_0  34 B: d f16 @0 | qs[32] int8 @2            w = d * q
#
# 4-bit codes: element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16].
# 5-bit codes add a fifth bit: bit j of qh read as a little-endian u32 is bit 4 of element j.
# Every product and sum is one float32 operation in the order above, which is also gguf-py's order, so the
# results are bitwise those of `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, bits_le, f16_at, low_high_nibbles, to_rows

BLOCK = 32


def dequantize_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 18)
    q = low_high_nibbles(blocks[..., 2:]).to(torch.float32).sub_(8.0)
    return to_rows(q.mul_(f16_at(blocks, 0)), blocks, BLOCK)


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 20)
    q = low_high_nibbles(blocks[..., 4:]).to(torch.float32)
    return to_rows(q.mul_(f16_at(blocks, 0)).add_(f16_at(blocks, 2)), blocks, BLOCK)


def _five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return low_high_nibbles(qs) | (bits_le(qh) << 4)


def dequantize_q5_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 22)
    q = _five_bit_codes(blocks[..., 2:6], blocks[..., 6:]).to(torch.float32).sub_(16.0)
    return to_rows(q.mul_(f16_at(blocks, 0)), blocks, BLOCK)


def dequantize_q5_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 24)
    q = _five_bit_codes(blocks[..., 4:8], blocks[..., 8:]).to(torch.float32)
    return to_rows(q.mul_(f16_at(blocks, 0)).add_(f16_at(blocks, 2)), blocks, BLOCK)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 34)
    q = blocks[..., 2:].view(torch.int8).to(torch.float32)
    return to_rows(q.mul_(f16_at(blocks, 0)), blocks, BLOCK)
