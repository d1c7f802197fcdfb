"""Triton tile dequantizers for the K-quants (Q4_K, Q5_K, Q6_K): 256-element super-blocks.

Same contract as tiles_legacy.py: NB consecutive super-blocks of BLOCK_N rows -> a float32 tile
[BLOCK_N, NB * 256] in natural k order, fields addressed as layout.py describes, so one function reads both
layouts. Block layouts and math are those of the torch reference quants/kquants.py:

  Q4_K  dm (d f16, dmin f16) | scales[12] | qs[128]            w = (d * sc[i]) * q - (dmin * m[i])
  Q5_K  dm | scales[12] | qh[32] | qs[128]                     same, q gets bit i of qh[l] as its fifth bit
  Q6_K  ql[128] | qh[64] | scales[16] int8 | d f16             w = (d * scales[i]) * (q - 32)

The scale products are formed first, then applied, in the reference's order. The f16 fields sit at even
offsets with even strides in both layouts, so they load as f16; everything else loads as bytes. The six-bit
scales and mins are unpacked in registers (no table in memory).
"""

import triton
import triton.language as tl

from vegaserve.triton_kernels.tiles_legacy import load_bytes, load_f16


@triton.jit
def low_high_runs(q, R: tl.constexpr, G: tl.constexpr):
    """[R, G] bytes -> [R, 2G] int32 codes: the G low nibbles, then the G high nibbles (GGUF's order)."""
    both = tl.join((q & 15).to(tl.int32), (q >> 4).to(tl.int32))  # [R, G, 2]
    return tl.reshape(tl.permute(both, (0, 2, 1)), [R, 2 * G])


@triton.jit
def concat4(a, b, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Two [BN, NB, 4] -> [BN, NB, 8]: a's four values, then b's."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 1, 3, 2)), [BLOCK_N, NB, 8])


@triton.jit
def scale_and_offset(base, o0, r0, b0, o1, r1, b1, rows, rmask, blk, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Q4_K/Q5_K per sub-block factors [BN, NB, 8]: d * sc[i] and dmin * m[i].

    The 12 scale bytes are a = 0..3, b = 4..7, c = 8..11; sc[0..3] = a & 63, sc[4..7] = (c & 15) | (a >> 6) << 4,
    m[0..3] = b & 63, m[4..7] = (c >> 4) | (b >> 6) << 4.
    """
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    dmin = load_f16(base, o0 + 2, r0, b0, rows, blk, rmask)
    a = load_bytes(base, o1, r1, b1, rows, blk, rmask, 4).to(tl.int32)
    b = load_bytes(base, o1 + 4, r1, b1, rows, blk, rmask, 4).to(tl.int32)
    c = load_bytes(base, o1 + 8, r1, b1, rows, blk, rmask, 4).to(tl.int32)
    sc = concat4(a & 63, (c & 15) | ((a >> 6) << 4), BLOCK_N, NB)
    m = concat4(b & 63, (c >> 4) | ((b >> 6) << 4), BLOCK_N, NB)
    return d[:, :, None] * sc.to(tl.float32), dmin[:, :, None] * m.to(tl.float32)


@triton.jit
def four_bit_subblocks(base, off, rs, bs, rows, rmask, blk, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """qs[128] -> [BN, NB, 8, 32] codes: 32-byte chunk j holds sub-block 2j (low nibbles) and 2j + 1 (high)."""
    qs = tl.reshape(load_bytes(base, off, rs, bs, rows, blk, rmask, 128), [BLOCK_N * NB * 4, 32])
    return tl.reshape(low_high_runs(qs, BLOCK_N * NB * 4, 32), [BLOCK_N, NB, 8, 32])


@triton.jit
def q4_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    scale, offset = scale_and_offset(base, o0, r0, b0, o1, r1, b1, rows, rmask, blk, BLOCK_N, NB)
    q = four_bit_subblocks(base, o2, r2, b2, rows, rmask, blk, BLOCK_N, NB)
    w = q.to(tl.float32) * scale[:, :, :, None] - offset[:, :, :, None]
    return tl.reshape(w, [BLOCK_N, NB * 256])


@triton.jit
def q5_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    scale, offset = scale_and_offset(base, o0, r0, b0, o1, r1, b1, rows, rmask, blk, BLOCK_N, NB)
    q = four_bit_subblocks(base, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    qh = load_bytes(base, o2, r2, b2, rows, blk, rmask, 32).to(tl.int32)  # [BN, NB, 32]
    sub = tl.arange(0, 8)
    q = q | (((qh[:, :, None, :] >> sub[None, None, :, None]) & 1) << 4)  # bit i of qh[l]
    w = q.to(tl.float32) * scale[:, :, :, None] - offset[:, :, :, None]
    return tl.reshape(w, [BLOCK_N, NB * 256])


@triton.jit
def q6_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Two halves of 128; element 32g + l of half h: low bits from nibble g // 2 of ql[64h + 32(g % 2) + l]
    (low_high_runs over each 64-byte half), high bits from bits 2g, 2g + 1 of qh[32h + l]."""
    R: tl.constexpr = BLOCK_N * NB * 2
    ql = tl.reshape(load_bytes(base, o0, r0, b0, rows, blk, rmask, 128), [R, 64])
    qh = tl.reshape(load_bytes(base, o1, r1, b1, rows, blk, rmask, 64), [R, 32]).to(tl.int32)
    g = tl.arange(0, 4)
    high = tl.reshape((qh[:, None, :] >> (2 * g)[None, :, None]) & 3, [R, 128])
    q = (low_high_runs(ql, R, 64) | (high << 4)).to(tl.float32) - 32.0
    sc = load_bytes(base, o2, r2, b2, rows, blk, rmask, 16).to(tl.int8, bitcast=True).to(tl.float32)
    d = load_f16(base, o3, r3, b3, rows, blk, rmask)
    w = tl.reshape(q, [BLOCK_N, NB, 16, 16]) * (d[:, :, None] * sc)[:, :, :, None]
    return tl.reshape(w, [BLOCK_N, NB * 256])
