# Torch reference dequantizers for the K-quants: 256-element super-blocks made of sub-blocks, each sub-block
# with its own small integer scale (bytes are offsets inside one super-block).
#
#   Q4_K 144 B: d f16 @0 | dmin f16 @2 | scales[12] @4 | qs[128] @16
#   Q5_K 176 B: d f16 @0 | dmin f16 @2 | scales[12] @4 | qh[32] @16 | qs[128] @48
#       8 sub-blocks of 32: w = (d * sc[i]) * q - (dmin * m[i]); q is 4-bit (Q4_K) or 5-bit (Q5_K).
#       scales[12] packs eight 6-bit sc and eight 6-bit m: with a = bytes 0..3, b = 4..7, c = 8..11,
#         sc[0..3] = a & 63          sc[4..7] = (c & 15) | (a >> 6) << 4
#         m[0..3]  = b & 63          m[4..7]  = (c >> 4) | (b >> 6) << 4
#       qs is four 32-byte chunks; chunk j holds sub-block 2j in its low nibbles and 2j+1 in its high ones.
#       Q5_K's fifth bit of element l of sub-block i is bit i of qh[l].
#   Q6_K 210 B: ql[128] @0 | qh[64] @128 | scales[16] int8 @192 | d f16 @208
#       16 sub-blocks of 16: w = (d * scales[i]) * (q - 32), q 6-bit. Two halves of 128 elements; half h
#       uses ql[64h .. 64h+63] and qh[32h .. 32h+31]. Element 32g + l of a half (g = 0..3, l = 0..31) has
#       low 4 bits from nibble g // 2 (low, then high) of ql[64h + 32(g % 2) + l] and high 2 bits from bits
#       2g, 2g+1 of qh[32h + l].
# The scale products are formed first, in float32, then applied; that is gguf-py's order, so the results
# are bitwise those of `gguf.quants.dequantize`.

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks, constant, f16_at, low_high_nibbles, to_rows

SUPER_BLOCK = 256


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., 12]` packed bytes -> (sc, m), each `[..., 8]` uint8 in 0..63."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((a & 63, (c & 15) | ((a >> 6) << 4)), dim=-1)
    m = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return sc, m


def _four_bit_subblocks(qs: torch.Tensor) -> torch.Tensor:
    """`[..., 128]` bytes -> `[..., 8, 32]` 4-bit codes, one row per sub-block."""
    chunks = low_high_nibbles(qs.reshape(*qs.shape[:-1], 4, 32))
    return chunks.reshape(*qs.shape[:-1], 8, 32)


def _apply_scale_min(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """w = (d * sc) * q - (dmin * m) for `q` of shape `[..., n_blocks, 8, 32]`."""
    sc, m = _scales_and_mins(blocks[..., 4:16])
    scale = (f16_at(blocks, 0) * sc.to(torch.float32)).unsqueeze(-1)
    offset = (f16_at(blocks, 2) * m.to(torch.float32)).unsqueeze(-1)
    return to_rows(q.to(torch.float32).mul_(scale).sub_(offset), blocks, SUPER_BLOCK)


def dequantize_q4_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 144)
    return _apply_scale_min(blocks, _four_bit_subblocks(blocks[..., 16:144]))


def dequantize_q5_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 176)
    qh = blocks[..., 16:48]
    sub_block = torch.arange(8, dtype=torch.uint8, device=raw.device).unsqueeze(-1)
    high_bit = (qh.unsqueeze(-2) >> sub_block) & 1  # [..., 8, 32]: bit i of qh[l]
    q = _four_bit_subblocks(blocks[..., 48:176]) | (high_bit << 4)
    return _apply_scale_min(blocks, q)


def dequantize_q6_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 210)
    lead = blocks.shape[:-1]
    low = low_high_nibbles(blocks[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 8, 32)
    shifts = constant((0, 2, 4, 6), torch.uint8, raw.device).unsqueeze(-1)
    high = ((blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> shifts) & 3).reshape(*lead, 8, 32)
    q = (low | (high << 4)).to(torch.float32).sub_(32.0).reshape(*lead, 16, 16)
    scale = f16_at(blocks, 208) * blocks[..., 192:208].view(torch.int8).to(torch.float32)
    return to_rows(q.mul_(scale.unsqueeze(-1)), blocks, SUPER_BLOCK)
