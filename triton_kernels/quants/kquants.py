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
#   Q2_K  84 B: scales[16] @0 | qs[64] @16 | d f16 @80 | dmin f16 @82
#       16 sub-blocks of 16: w = (d * (scales[i] & 15)) * q - (dmin * (scales[i] >> 4)), q 2-bit. Two halves
#       of 128 elements; element 32s + l of half h (s = 0..3, l = 0..31) is bits 2s, 2s+1 of qs[32h + l].
#   Q3_K 110 B: hmask[32] @0 | qs[64] @32 | scales[12] @96 | d f16 @108
#       16 sub-blocks of 16: w = (d * (sc[i] - 32)) * q, q = low - 4 * (1 - high) in -4..3: low 2 bits as
#       Q2_K's qs, high bit j // 32 of hmask[j % 32] for element j. sc[i] is 6-bit: low 4 bits are nibble
#       i // 8 (low, then high) of scales[i % 8], high 2 bits are bits 2 (i // 4) of scales[8 + i % 4].
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


def _two_bit_halves(qs: torch.Tensor) -> torch.Tensor:
    """`[..., 64]` bytes -> `[..., 16, 16]` 2-bit codes in element order (Q2_K's qs, Q3_K's low bits)."""
    shifts = constant((0, 2, 4, 6), torch.uint8, qs.device).unsqueeze(-1)
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*qs.shape[:-1], 16, 16)


def dequantize_q2_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 84)
    sc = blocks[..., 0:16]
    scale = (f16_at(blocks, 80) * (sc & 15).to(torch.float32)).unsqueeze(-1)
    offset = (f16_at(blocks, 82) * (sc >> 4).to(torch.float32)).unsqueeze(-1)
    q = _two_bit_halves(blocks[..., 16:80]).to(torch.float32)
    return to_rows(q.mul_(scale).sub_(offset), blocks, SUPER_BLOCK)


def dequantize_q3_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = as_blocks(raw, 110)
    lead = blocks.shape[:-1]
    packed = blocks[..., 96:108]
    low = low_high_nibbles(packed[..., 0:8])  # sc[i] & 15 for i = 0..15
    shifts = constant((0, 2, 4, 6), torch.uint8, raw.device).unsqueeze(-1)
    high = ((packed[..., 8:12].reshape(*lead, 1, 4) >> shifts) & 3).reshape(*lead, 16)
    sc = (low | (high << 4)).to(torch.float32).sub_(32.0)
    scale = (f16_at(blocks, 108) * sc).unsqueeze(-1)
    bits = torch.arange(8, dtype=torch.uint8, device=raw.device).unsqueeze(-1)
    hbit = ((blocks[..., 0:32].reshape(*lead, 1, 32) >> bits) & 1).reshape(*lead, 16, 16)
    q = _two_bit_halves(blocks[..., 32:96]).to(torch.int8) - ((hbit ^ 1) << 2).to(torch.int8)
    return to_rows(q.to(torch.float32).mul_(scale), blocks, SUPER_BLOCK)
