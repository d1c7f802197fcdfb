"""Triton tile dequantizer for MXFP4 (OCP microscaling FP4): 32-element blocks.

Same contract as tiles_legacy.py: NB consecutive blocks of BLOCK_N rows -> a float32 tile [BLOCK_N, NB * 32]
in natural k order, for both layouts. Block layout and math as the torch reference quants/mxfp4.py:

  e u8 | qs[16]     w = 2^(e - 127) * FP4[q]; element j < 16 the low nibble of qs[j], j >= 16 the high one
                    of qs[j - 16]; FP4 is e2m1: sign bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.

Like the reference, the e2m1 values are taken doubled (integers 0..12) and the scale halved: 2^(e - 128)
built as float32 bits, exact for every e (e = 0, 1 give subnormals), so each product is exact. The block is
17 bytes, so in the canonical layout qs sits at odd addresses: every field is read as bytes.
"""

import triton
import triton.language as tl

from vegaserve.triton_kernels.tiles_legacy import field_addr, load_bytes, nibbles_natural


@triton.jit
def e2m1_doubled(code):
    """4-bit e2m1 codes -> twice their value, int32, by arithmetic: magnitude bits (e, m) give m when e = 0
    (subnormal), else (2 + m) << (e - 1), written as ((2 | m) << e) >> 1 so that no shift count is negative."""
    mag = code & 7
    v = tl.where(mag < 2, mag, ((2 | (mag & 1)) << (mag >> 1)) >> 1)
    return tl.where(code >= 8, -v, v)


@triton.jit
def half_scale(e):
    """E8M0 exponent bytes (int32) -> 2^(e - 128) as float32: subnormal bits 0x00200000 << e for e < 2."""
    bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
               BLOCK_N: tl.constexpr, NB: tl.constexpr):
    e = tl.load(field_addr(base, o0, r0, b0, rows, blk), mask=rmask[:, None], other=0).to(tl.int32)
    q = nibbles_natural(load_bytes(base, o1, r1, b1, rows, blk, rmask, 16), BLOCK_N, NB)
    w = e2m1_doubled(q).to(tl.float32) * half_scale(e)[:, :, None]
    return tl.reshape(w, [BLOCK_N, NB * 32])
