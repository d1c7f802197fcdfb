"""Triton tile dequantizers for the 2- and 3-bit K-quants (Q2_K, Q3_K): 256-element super-blocks of 16
sub-blocks of 16.

Same contract as tiles_legacy.py: NB consecutive super-blocks of BLOCK_N rows -> a float32 tile
[BLOCK_N, NB * 256] in natural k order, fields addressed as layout.py describes, so one function reads both
layouts. Block layouts and math are those of the torch reference quants/kquants.py:

  Q2_K  scales[16] | qs[64] | dm (d f16, dmin f16)    w = (d * (sc & 15)) * q - (dmin * (sc >> 4)), q 2-bit
  Q3_K  hmask[32] | qs[64] | scales[12] | d f16        w = (d * (sc - 32)) * (low - 4 * (1 - high))

Both read their 2-bit codes alike: element 32s + l of half h is bits 2s, 2s + 1 of qs[32h + l]. Q3_K's high
bit of element j is bit j // 32 of hmask[j % 32]; its 6-bit scales are nibbles of bytes 0..7 (low ones for
sub-blocks 0..7) with two more bits each from bytes 8..11. The scale products are formed first, then
applied, in the reference's order.
"""

import triton
import triton.language as tl

from vegaserve.triton_kernels.tiles_legacy import load_bytes, load_f16


@triton.jit
def two_bit_codes(base, off, rs, bs, rows, rmask, blk, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """qs[64] -> [BN, NB, 16, 16] codes 0..3 in element order (sub-block, element)."""
    R: tl.constexpr = BLOCK_N * NB * 2
    qs = tl.reshape(load_bytes(base, off, rs, bs, rows, blk, rmask, 64), [R, 32]).to(tl.int32)
    s = tl.arange(0, 4)
    q = (qs[:, None, :] >> (2 * s)[None, :, None]) & 3  # [R, 4, 32]: element 32s + l of a half
    return tl.reshape(q, [BLOCK_N, NB, 16, 16])


@triton.jit
def q2_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    sc = load_bytes(base, o0, r0, b0, rows, blk, rmask, 16).to(tl.int32)  # [BN, NB, 16]
    d = load_f16(base, o2, r2, b2, rows, blk, rmask)
    dmin = load_f16(base, o2 + 2, r2, b2, rows, blk, rmask)
    scale = d[:, :, None] * (sc & 15).to(tl.float32)
    offset = dmin[:, :, None] * (sc >> 4).to(tl.float32)
    q = two_bit_codes(base, o1, r1, b1, rows, rmask, blk, BLOCK_N, NB).to(tl.float32)
    w = q * scale[:, :, :, None] - offset[:, :, :, None]
    return tl.reshape(w, [BLOCK_N, NB * 256])


@triton.jit
def q3_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    a = load_bytes(base, o2, r2, b2, rows, blk, rmask, 8).to(tl.int32)  # scale bytes 0..7
    c = load_bytes(base, o2 + 8, r2, b2, rows, blk, rmask, 4).to(tl.int32)  # 8..11
    low = tl.reshape(tl.permute(tl.join(a & 15, a >> 4), (0, 1, 3, 2)), [BLOCK_N, NB, 16])
    s = tl.arange(0, 4)
    high = tl.reshape((c[:, :, None, :] >> (2 * s)[None, None, :, None]) & 3, [BLOCK_N, NB, 16])
    d = load_f16(base, o3, r3, b3, rows, blk, rmask)
    scale = d[:, :, None] * ((low | (high << 4)) - 32).to(tl.float32)  # [BN, NB, 16]
    hmask = load_bytes(base, o0, r0, b0, rows, blk, rmask, 32).to(tl.int32)
    bit = tl.arange(0, 8)
    hbit = tl.reshape((hmask[:, :, None, :] >> bit[None, None, :, None]) & 1, [BLOCK_N, NB, 16, 16])
    q = two_bit_codes(base, o1, r1, b1, rows, rmask, blk, BLOCK_N, NB) - ((hbit ^ 1) << 2)
    w = q.to(tl.float32) * scale[:, :, :, None]
    return tl.reshape(w, [BLOCK_N, NB * 256])
