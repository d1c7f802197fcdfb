"""Triton tile dequantizers for the IQ super-block types: IQ4_XS, and the lattice types IQ3_XXS, IQ3_S,
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M (256-element super-blocks).

Same contract as tiles_legacy.py: NB consecutive super-blocks of BLOCK_N rows -> a float32 tile
[BLOCK_N, NB * 256] in natural k order, for both layouts (layout.py). Block layouts and math are those of
the torch references quants/iq4_nl.py, iq3.py, iq2.py and iq1.py, with their order of float32 operations.

The lattice types index a grid of points (quants/lattice.py): `tab` points at the type's table of 16-bit
entries on the device (`table_for`), one entry per point, its coordinates packed 2 or 4 bits each, and each
tile decodes the entries it gathers in registers:

  IQ2: index v of {8, 25, 43} = 8 + 17 v + (v >> 1)      IQ3_XXS: of {4, 12, .., 52, 62} = 4 + 8 v + 2 (v == 7)
  IQ3_S: of {1, 3, .., 15} = 1 + 2 v                     IQ1: of {-1, 0, 1} = v - 1
The sign byte of a 7-bit index is the index with its parity in bit 7 (computed, as in lattice.sign_bytes).
Multi-byte integer fields sit at unaligned offsets in the canonical blocks, so every field loads as bytes.
"""

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.quants.lattice import codes
from vegaserve.triton_kernels.tiles_kquants import low_high_runs
from vegaserve.triton_kernels.tiles_legacy import field_addr, iq4_nl_value, load_bytes, load_f16

# ggml type id -> the lattice table it indexes (IQ1_M reads IQ1_S's)
LATTICE = {16: "IQ2_XXS", 17: "IQ2_XS", 22: "IQ2_S", 18: "IQ3_XXS", 21: "IQ3_S", 19: "IQ1_S", 29: "IQ1_M"}


def table_for(type_id: int, device: torch.device) -> torch.Tensor | None:
    """The lattice table a tile of `type_id` reads (int16 entries on `device`), None for other types."""
    name = LATTICE.get(int(type_id))
    return None if name is None else codes(name, torch.device(device))


@triton.jit
def bytes_at(base, off, rs, bs, rows, blk, rmask, inner):
    """[BN, NB, len(inner)] int32: the bytes at offsets `inner` (a 1-D int tensor) inside one field."""
    p = field_addr(base, off, rs, bs, rows, blk)[:, :, None] + inner[None, None, :]
    return tl.load(p, mask=rmask[:, None, None], other=0).to(tl.int32)


@triton.jit
def words_at(base, off, rs, bs, rows, blk, rmask, STRIDE: tl.constexpr, G: tl.constexpr, WIDTH: tl.constexpr):
    """[BN, NB, G] int32: the little-endian unsigned WIDTH-byte integers at off + STRIDE * g, g < G (a 4-byte
    value wraps to negative where its top bit is set: callers mask after shifting)."""
    g = tl.arange(0, G) * STRIDE
    v = bytes_at(base, off, rs, bs, rows, blk, rmask, g)
    for i in tl.static_range(1, WIDTH):
        v = v | (bytes_at(base, off, rs, bs, rows, blk, rmask, g + i) << (8 * i))
    return v


@triton.jit
def nibbles(packed, BLOCK_N: tl.constexpr, NB: tl.constexpr, N: tl.constexpr):
    """[BN, NB, N] bytes -> [BN, NB, 2N]: each byte's low nibble, then its high one."""
    return tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_N, NB, 2 * N])


@triton.jit
def sign_factors(index7):
    """7-bit sign indices [..., P] -> [..., P, 8] float32 factors +-1 (bit 7 of the byte: the parity)."""
    p = index7 ^ (index7 >> 4)
    p = p ^ (p >> 2)
    sb = index7 | (((p ^ (p >> 1)) & 1) << 7)
    return signs_of(sb)


@triton.jit
def signs_of(sign_byte):
    """Sign bytes [..., P] -> [..., P, 8] float32: -1 where bit j is set."""
    j = tl.arange(0, 8)
    return 1.0 - 2.0 * ((sign_byte[:, :, :, None] >> j[None, None, None, :]) & 1).to(tl.float32)


@triton.jit
def grid_index(tab, points, WIDTH: tl.constexpr, BITS: tl.constexpr):
    """Grid points [BN, NB, P] -> their coordinates' indices [BN, NB, P, WIDTH] (int32)."""
    entry = tl.load(tab + points).to(tl.int32) & 0xFFFF
    j = tl.arange(0, WIDTH)
    return (entry[:, :, :, None] >> (BITS * j)[None, None, None, :]) & ((1 << BITS) - 1)


@triton.jit
def iq2_values(tab, points):
    v = grid_index(tab, points, 8, 2)
    return (8 + 17 * v + (v >> 1)).to(tl.float32)


@triton.jit
def apply_scales(scale, values, BLOCK_N: tl.constexpr, NB: tl.constexpr, G: tl.constexpr):
    """scale [BN, NB, G] times values [BN, NB, P, W] (P * W / G weights a scale) -> the tile [BN, NB * 256]."""
    R: tl.constexpr = BLOCK_N * NB * G
    w = tl.reshape(scale, [R])[:, None] * tl.reshape(values, [R, 256 // G])
    return tl.reshape(w, [BLOCK_N, NB * 256])


@triton.jit
def iq2_scale(d, s):
    """d [BN, NB] times (0.5 + s) / 4 for 4-bit scales s [BN, NB, G]."""
    return d[:, :, None] * (0.5 + s.to(tl.float32)) * 0.25


@triton.jit
def iq4_xs_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
                BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | scales_h u16 | scales_l[4] | qs[128]: sub-block i's 6-bit scale is nibble i % 2 of scales_l[i // 2]
    and bits 2i, 2i + 1 of scales_h; its codes are qs[16i ..] in IQ4_NL's order."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    high = words_at(base, o1, r1, b1, rows, blk, rmask, 2, 1, 2)  # [BN, NB, 1]
    low = nibbles(load_bytes(base, o1 + 2, r1, b1, rows, blk, rmask, 4).to(tl.int32), BLOCK_N, NB, 4)
    i = tl.arange(0, 8)
    sc = low | (((high >> (2 * i)[None, None, :]) & 3) << 4)
    scale = d[:, :, None] * (sc - 32).to(tl.float32)  # [BN, NB, 8]
    qs = tl.reshape(load_bytes(base, o2, r2, b2, rows, blk, rmask, 128), [BLOCK_N * NB * 8, 16])
    q = tl.reshape(low_high_runs(qs, BLOCK_N * NB * 8, 16), [BLOCK_N, NB, 8, 32])
    return apply_scales(scale, iq4_nl_value(q), BLOCK_N, NB, 8)


@triton.jit
def iq2_xxs_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
                 BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | 8 x (4 grid bytes, u32 of four 7-bit sign indices and the scale in its top 4 bits)."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    k = tl.arange(0, 32)
    points = bytes_at(base, o1, r1, b1, rows, blk, rmask, 8 * (k // 4) + k % 4)  # [BN, NB, 32]
    aux = words_at(base, o1 + 4, r1, b1, rows, blk, rmask, 8, 8, 4)  # [BN, NB, 8]
    l = tl.arange(0, 4)
    index7 = tl.reshape((aux[:, :, :, None] >> (7 * l)[None, None, None, :]) & 127, [BLOCK_N, NB, 32])
    values = iq2_values(tab, points) * sign_factors(index7)
    return apply_scales(iq2_scale(d, (aux >> 28) & 15), values, BLOCK_N, NB, 8)


@triton.jit
def iq2_xs_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
                BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | qs u16[32] (grid point q & 511, sign index q >> 9) | scales[8] (a nibble per two points)."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    q = words_at(base, o1, r1, b1, rows, blk, rmask, 2, 32, 2)
    s = nibbles(load_bytes(base, o2, r2, b2, rows, blk, rmask, 8).to(tl.int32), BLOCK_N, NB, 8)
    values = iq2_values(tab, q & 511) * sign_factors(q >> 9)
    return apply_scales(iq2_scale(d, s), values, BLOCK_N, NB, 16)


@triton.jit
def iq2_s_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
               BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | qs[32] grid bytes, signs[32] (one byte a point) | qh[8] (2 high bits a point) | scales[8]."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    low = load_bytes(base, o1, r1, b1, rows, blk, rmask, 32).to(tl.int32)
    sb = load_bytes(base, o1 + 32, r1, b1, rows, blk, rmask, 32).to(tl.int32)
    qh = load_bytes(base, o2, r2, b2, rows, blk, rmask, 8).to(tl.int32)
    l = tl.arange(0, 4)
    high = tl.reshape((qh[:, :, :, None] >> (2 * l)[None, None, None, :]) & 3, [BLOCK_N, NB, 32])
    s = nibbles(load_bytes(base, o3, r3, b3, rows, blk, rmask, 8).to(tl.int32), BLOCK_N, NB, 8)
    values = iq2_values(tab, low | (high << 8)) * signs_of(sb)
    return apply_scales(iq2_scale(d, s), values, BLOCK_N, NB, 16)


@triton.jit
def iq3_xxs_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
                 BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | qs[64] (a grid point of 4 a byte) | u32[8] (four 7-bit sign indices, the scale in the top 4 bits)."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    points = load_bytes(base, o1, r1, b1, rows, blk, rmask, 64).to(tl.int32)
    aux = words_at(base, o2, r2, b2, rows, blk, rmask, 4, 8, 4)  # [BN, NB, 8]
    v = grid_index(tab, points, 4, 4)
    values = tl.reshape((4 + 8 * v + 2 * ((v + 1) >> 3)).to(tl.float32), [BLOCK_N, NB, 32, 8])
    l = tl.arange(0, 4)
    index7 = tl.reshape((aux[:, :, :, None] >> (7 * l)[None, None, None, :]) & 127, [BLOCK_N, NB, 32])
    scale = d[:, :, None] * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
    return apply_scales(scale, values * sign_factors(index7), BLOCK_N, NB, 8)


@triton.jit
def iq3_s_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
               BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | qs[64] | qh[8] (a ninth index bit a point) | signs[32] (a byte per 8 weights), scales[4]."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    low = load_bytes(base, o1, r1, b1, rows, blk, rmask, 64).to(tl.int32)
    qh = load_bytes(base, o2, r2, b2, rows, blk, rmask, 8).to(tl.int32)
    b = tl.arange(0, 8)
    high = tl.reshape((qh[:, :, :, None] >> b[None, None, None, :]) & 1, [BLOCK_N, NB, 64])
    v = grid_index(tab, low | (high << 8), 4, 4)
    values = tl.reshape((1 + 2 * v).to(tl.float32), [BLOCK_N, NB, 32, 8])
    sb = load_bytes(base, o3, r3, b3, rows, blk, rmask, 32).to(tl.int32)
    s = nibbles(load_bytes(base, o3 + 32, r3, b3, rows, blk, rmask, 4).to(tl.int32), BLOCK_N, NB, 4)
    scale = d[:, :, None] * (1 + 2 * s).to(tl.float32)
    return apply_scales(scale, values * signs_of(sb), BLOCK_N, NB, 8)


@triton.jit
def iq1_values(tab, points, negative):
    """Grid points [BN, NB, P] and their shift signs -> [BN, NB, P, 8]: coordinate + (-1/8 or +1/8)."""
    v = (grid_index(tab, points, 8, 2) - 1).to(tl.float32)
    return v + tl.where(negative, -0.125, 0.125)[:, :, :, None]


@triton.jit
def iq1_s_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
               BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """d | qs[32] | qh u16[8]: h covers points 4g + l: 3 high index bits (at 3l), scale 2 ((h >> 12) & 7) + 1,
    the shift's sign in bit 15."""
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)
    h = words_at(base, o2, r2, b2, rows, blk, rmask, 2, 8, 2)  # [BN, NB, 8]
    l = tl.arange(0, 4)
    high = tl.reshape((h[:, :, :, None] >> (3 * l)[None, None, None, :]) & 7, [BLOCK_N, NB, 32])
    points = load_bytes(base, o1, r1, b1, rows, blk, rmask, 32).to(tl.int32) | (high << 8)
    negative = tl.reshape(tl.broadcast_to((h >= 0x8000)[:, :, :, None], [BLOCK_N, NB, 8, 4]), [BLOCK_N, NB, 32])
    scale = d[:, :, None] * (2 * ((h >> 12) & 7) + 1).to(tl.float32)
    return apply_scales(scale, iq1_values(tab, points, negative), BLOCK_N, NB, 8)


@triton.jit
def iq1_m_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
               BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """qs[32] | qh[16] (a nibble a point: 3 high index bits, the shift's sign) | scales u16[4]: 3-bit scales
    at bits 3i of each, one per two points; the f16 d from their top nibbles (scales[0]'s lowest)."""
    sc = words_at(base, o2, r2, b2, rows, blk, rmask, 2, 4, 2)  # [BN, NB, 4]
    i = tl.arange(0, 4)
    d_bits = tl.sum((sc & 0xF000) >> (12 - 4 * i)[None, None, :], axis=2)  # disjoint bits: the sum is an or
    d = d_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s = tl.reshape((sc[:, :, :, None] >> (3 * i)[None, None, None, :]) & 7, [BLOCK_N, NB, 16])
    scale = d[:, :, None] * (2 * s + 1).to(tl.float32)
    nib = nibbles(load_bytes(base, o1, r1, b1, rows, blk, rmask, 16).to(tl.int32), BLOCK_N, NB, 16)
    points = load_bytes(base, o0, r0, b0, rows, blk, rmask, 32).to(tl.int32) | ((nib & 7) << 8)
    return apply_scales(scale, iq1_values(tab, points, (nib & 8) != 0), BLOCK_N, NB, 16)
