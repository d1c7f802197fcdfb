"""Triton tile dequantizers for the 32-element block types and the float types.

Each `*_tile` function turns NB consecutive blocks of BLOCK_N rows into a float32 tile [BLOCK_N, NB * QK]
in natural k order. Fields are addressed as layout.py describes (offset, row stride, block stride, in
bytes), so one function reads both the canonical and the repacked layout. The math and block layouts are
those of the torch references in quants/legacy.py, quants/iq4_nl.py and quants/floats.py, which the tests
compare against.
"""

import triton
import triton.language as tl


@triton.jit
def field_addr(base, off, rs, bs, rows, blk):
    """[BLOCK_N, NB] byte pointers of one field; rows int64 so huge matrices do not overflow."""
    return base + off + rows[:, None] * rs + blk[None, :] * bs


@triton.jit
def load_f16(base, off, rs, bs, rows, blk, rmask):
    p = field_addr(base, off, rs, bs, rows, blk).to(tl.pointer_type(tl.float16))
    return tl.load(p, mask=rmask[:, None], other=0.0).to(tl.float32)


@triton.jit
def load_bytes(base, off, rs, bs, rows, blk, rmask, WIDTH: tl.constexpr):
    """[BLOCK_N, NB, WIDTH] uint8 of one field."""
    j = tl.arange(0, WIDTH)
    p = field_addr(base, off, rs, bs, rows, blk)[:, :, None] + j[None, None, :]
    return tl.load(p, mask=rmask[:, None, None], other=0)


@triton.jit
def nibbles_natural(qs, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """[BN, NB, 16] bytes -> [BN, NB, 32] codes: element j < 16 low nibble of byte j, j >= 16 high of j-16."""
    lo = (qs & 15).to(tl.int32)
    hi = (qs >> 4).to(tl.int32)
    both = tl.join(lo, hi)  # [BN, NB, 16, 2]
    return tl.reshape(tl.permute(both, (0, 1, 3, 2)), [BLOCK_N, NB, 32])


@triton.jit
def high_bits_q5(base, off, rs, bs, rows, blk, rmask, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """[BN, NB, 32] fifth bits: bit j of the little-endian u32 qh is bit 4 of element j (read as bytes:
    the field is not 4-byte aligned in the canonical Q5_0 block)."""
    qh = load_bytes(base, off, rs, bs, rows, blk, rmask, 4).to(tl.int32)  # [BN, NB, 4]
    j = tl.arange(0, 32)
    byte = tl.reshape(tl.broadcast_to(qh[:, :, :, None], [BLOCK_N, NB, 4, 8]), [BLOCK_N, NB, 32])
    return ((byte >> (j % 8)[None, None, :]) & 1) << 4


@triton.jit
def q8_0_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    q = load_bytes(base, o1, r1, b1, rows, blk, rmask, 32).to(tl.int8, bitcast=True).to(tl.float32)
    return tl.reshape(q * d[:, :, None], [BLOCK_N, NB * 32])


@triton.jit
def q4_0_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    q = nibbles_natural(load_bytes(base, o1, r1, b1, rows, blk, rmask, 16), BLOCK_N, NB)
    return tl.reshape((q.to(tl.float32) - 8.0) * d[:, :, None], [BLOCK_N, NB * 32])


@triton.jit
def q4_1_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    m = load_f16(base, o1, r1, b1, rows, blk, rmask)
    q = nibbles_natural(load_bytes(base, o2, r2, b2, rows, blk, rmask, 16), BLOCK_N, NB)
    return tl.reshape(q.to(tl.float32) * d[:, :, None] + m[:, :, None], [BLOCK_N, NB * 32])


@triton.jit
def q5_0_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    q = nibbles_natural(load_bytes(base, o2, r2, b2, rows, blk, rmask, 16), BLOCK_N, NB)
    q = q | high_bits_q5(base, o1, r1, b1, rows, blk, rmask, BLOCK_N, NB)
    return tl.reshape((q.to(tl.float32) - 16.0) * d[:, :, None], [BLOCK_N, NB * 32])


@triton.jit
def q5_1_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    m = load_f16(base, o1, r1, b1, rows, blk, rmask)
    q = nibbles_natural(load_bytes(base, o3, r3, b3, rows, blk, rmask, 16), BLOCK_N, NB)
    q = q | high_bits_q5(base, o2, r2, b2, rows, blk, rmask, BLOCK_N, NB)
    return tl.reshape(q.to(tl.float32) * d[:, :, None] + m[:, :, None], [BLOCK_N, NB * 32])


@triton.jit
def iq4_nl_value(code):
    """The 16 non-linear IQ4_NL levels (quants/iq4_nl.py) of int32 codes, as float32: a quartic in the code
    (a minimax fit: within 0.433 of every level in float32 Horner form) rounded to the nearest integer, so
    exact, in 6 operations where a select chain took 15 selects and a conversion (prefill dequantizes with
    this; test_tiles_legacy checks all 16 codes)."""
    c = code.to(tl.float32)
    v = (((1.58604282e-03 * c + 3.10864393e-02) * c - 1.37192704) * c + 24.1738303) * c - 126.567010
    return tl.floor(v + 0.5)


@triton.jit
def iq4_nl_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
                BLOCK_N: tl.constexpr, NB: tl.constexpr):
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    q = nibbles_natural(load_bytes(base, o1, r1, b1, rows, blk, rmask, 16), BLOCK_N, NB)
    return tl.reshape(iq4_nl_value(q) * d[:, :, None], [BLOCK_N, NB * 32])


@triton.jit
def f16_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
             BLOCK_N: tl.constexpr, NB: tl.constexpr):
    return load_f16(base, o0, r0, b0, rows, blk, rmask)


@triton.jit
def bf16_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
              BLOCK_N: tl.constexpr, NB: tl.constexpr):
    p = field_addr(base, o0, r0, b0, rows, blk).to(tl.pointer_type(tl.bfloat16))
    return tl.load(p, mask=rmask[:, None], other=0.0).to(tl.float32)


@triton.jit
def f32_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
             BLOCK_N: tl.constexpr, NB: tl.constexpr):
    p = field_addr(base, o0, r0, b0, rows, blk).to(tl.pointer_type(tl.float32))
    return tl.load(p, mask=rmask[:, None], other=0.0)
