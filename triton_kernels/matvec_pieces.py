"""The `pieces` decode mat-vec: the K-quants with each row's loads along it, y[M, N] = x[M, K] @ W[N, K]^T, x in
q8_1, W Q4_K or Q6_K repacked (layout.py), four products a dp4a (int8_ops.dot4). The fastest one-row
kernel for these types on the H200 (docs/PERFORMANCE.md).

The unit is a 16-byte piece of a row's quant plane. Q4_K: piece p = 8 sb + 2c + h is half h of 32-byte chunk
c of super-block sb, whose low nibbles are sub-block 2c and high nibbles 2c + 1; its scales and mins come
from the super-block's 16-byte head record (d, dmin, 12 scale bytes: layout.HEAD). Q6_K: piece p = 8 sb +
4h + u holds ql bytes 64h + 16u .., its two high bits from the qh run it shares with another piece. Each
row's pieces of a tile are one contiguous load, so the lanes of a warp go along the row (Triton 3.6 lays
[rows, blocks, 4] loads across 16 rows, 16 cache lines an instruction). The activations of a tile are the
same for every row: loaded as runs and rearranged into the pieces' order.
Torch reference: matvec_int8.reference_matvec_q8_1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.flat_words import (
    expert_program,
    field,
    magic,
    program_rows_at,
    row_runs,
    split4,
    store_rows_at,
    zero_rows,
)
from vegaserve.triton_kernels.int8_ops import advance, low_high_sums, minus_32
from vegaserve.triton_kernels.layout import PackedWeight
from vegaserve.triton_kernels.matvec_int8 import dot_kind
from vegaserve.triton_kernels.matvec_launch import candidates as launch_candidates
from vegaserve.triton_kernels.matvec_launch import Experts, plan, unique
from vegaserve.triton_kernels.q8_1 import Q8_1, quantize_q8_1


@triton.jit
def _q4_k_piece_tile(qs, hd, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Loads of one Q4_K tile, each a contiguous run per row (so the lanes of a warp go along the row): the
    quant words as [BLOCK_N, 8 NB, 4] (16-byte piece p = 8 sb + 2c + h: half h of 32-byte chunk c of
    super-block sb) and the four words of each super-block's head record (dm, the 12 scale bytes) as
    dm, a, b, c [BLOCK_N, NB], from a run of the row's records (hd [BLOCK_N, 4 NB])."""
    q = tl.reshape(tl.load(qs), [BLOCK_N, NB * 8, 4])
    dm, a, b, c = split4(tl.reshape(tl.load(hd), [BLOCK_N, NB, 4]))
    return q, dm, a, b, c


@triton.jit
def _run_words(xrow, w0, NB: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """The activation words of a tile: its run of x, word (sb, a, k, b, w) of [NB, A, 2, B, 4] (k 0 the
    low nibbles', 1 the high nibbles'), split by k and put in piece order (sb, a, b) as 4 [1, 8 NB] each."""
    xt = tl.permute(tl.reshape(tl.load(xrow + w0 + tl.arange(0, NB * 64)), (NB, A, 2, B, 4)), (0, 1, 3, 4, 2))
    xl, xh = tl.split(xt)  # [NB, A, B, w]
    return split4(tl.reshape(xl, (1, NB * 8, 4))), split4(tl.reshape(xh, (1, NB * 8, 4)))


@triton.jit
def _q4_k_piece_acts(xrow, dxrow, sxrow, w0, b0, NB: tl.constexpr):
    """One row of x for a pieces tile: the int32 words the low and the high nibbles of each piece multiply
    (4 [1, 8 NB] each) and the q8_1 scales and sums of their sub-blocks ([1, 8 NB]), from contiguous
    loads rearranged (through shared memory: Triton converts the permuted tensors' layout)."""
    # word sb * 64 + c * 16 + k * 8 + h * 4 + w (k = 0: the low nibbles' sub-block 2c, 1: the high's 2c + 1)
    xl, xh = _run_words(xrow, w0, NB, 4, 2)  # (sb, c, k, h, w)
    dl, dh = tl.split(tl.reshape(tl.load(dxrow + b0 + tl.arange(0, NB * 8)), (NB, 4, 2)))  # block sb * 8 + 2c + k
    sl, sh = tl.split(tl.reshape(tl.load(sxrow + b0 + tl.arange(0, NB * 8)), (NB, 4, 2)))
    # the same sub-block values for both halves of a chunk: piece 8 sb + 2c + h
    dl = tl.reshape(tl.join(dl, dl), (1, NB * 8))
    dh = tl.reshape(tl.join(dh, dh), (1, NB * 8))
    sl = tl.reshape(tl.join(sl, sl), (1, NB * 8))
    sh = tl.reshape(tl.join(sh, sh), (1, NB * 8))
    return xl, xh, dl, dh, sl, sh


@triton.jit
def _q4_k_piece_scales(a, b, c, pp, UNPACK: tl.constexpr):
    """The six-bit scale and min pairs of each piece pp (chunk c = pp // 2, half pp % 2) of each super-block,
    from its scale words a, b, c [BLOCK_N, NB]: sc[2c] | sc[2c + 1] << 8 and the same of the mins (UNPACK
    1: zero on the second half's pieces, whose min term the first half's carries) [BLOCK_N, NB, 8].
    UNPACK 0 forms both the chunks-0/1 and the chunks-2/3 value and selects; UNPACK 1 selects the source
    word and masks once (the masks per piece)."""
    shift = ((pp // 2) % 2 * 16)[None, None, :]  # scale bytes 2c, 2c + 1 of the pair's word
    upper = (pp >= 4)[None, None, :]  # chunks 2, 3: sub-blocks 4..7, six bits from two places
    if UNPACK:
        first = (pp % 2 == 0)[None, None, :]
        low = tl.where(upper, 0x0F0F, 0x3F3F)
        high = tl.where(upper, 0x3030, 0)
        sc = ((tl.where(upper, c[:, :, None], a[:, :, None]) >> shift) & low) | ((a[:, :, None] >> (shift + 2)) & high)
        mn = (((tl.where(upper, c[:, :, None] >> 4, b[:, :, None]) >> shift) & tl.where(first, low, 0))
              | ((b[:, :, None] >> (shift + 2)) & tl.where(first, high, 0)))
    else:
        a3 = a[:, :, None] >> shift
        b3 = b[:, :, None] >> shift
        c3 = c[:, :, None] >> shift
        sc = tl.where(upper, (c3 & 0x0F0F) | ((a3 >> 2) & 0x3030), a3 & 0x3F3F)
        mn = tl.where(upper, ((c3 >> 4) & 0x0F0F) | ((b3 >> 2) & 0x3030), b3 & 0x3F3F)
    return sc, mn


@triton.jit
def _q4_k_piece_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, w0, b0, K, mags, M: tl.constexpr, BLOCK_N: tl.constexpr,
                     NB: tl.constexpr, DOT: tl.constexpr, UNPACK: tl.constexpr):
    """A pieces tile's products: each piece's low nibbles (sub-block 2c) and high nibbles (2c + 1) against
    their activations, scaled per sub-block; the min term (whole sub-blocks) on the first half's piece.
    UNPACK 1: the scales as _q4_k_piece_scales' UNPACK 1, and every int-to-float conversion an exact
    integer-and-float pair (flat_words.field, _exact_f32; `mags`: the magics of bits 0 and 8). The same
    products, bitwise."""
    q, dm, a, b, c = tile
    P: tl.constexpr = NB * 8
    pp = tl.arange(0, 8)
    sc, mn = _q4_k_piece_scales(a, b, c, pp, UNPACK)
    d = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    dmin = (dm >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    if UNPACK:
        sc_lo = tl.reshape(d * field(sc, 0xFF, 0, mags[0], 0), (BLOCK_N, P))
        sc_hi = tl.reshape(d * field(sc, 0xFF, 8, mags[1], 0), (BLOCK_N, P))
        mn_lo = tl.reshape(dmin * field(mn, 0xFF, 0, mags[0], 0), (BLOCK_N, P))
        mn_hi = tl.reshape(dmin * field(mn, 0xFF, 8, mags[1], 0), (BLOCK_N, P))
    else:
        first_min = tl.where((pp % 2 == 0)[None, None, :], dmin, 0.0)
        sc_lo = tl.reshape(d * (sc & 0xFF).to(tl.float32), (BLOCK_N, P))
        sc_hi = tl.reshape(d * (sc >> 8).to(tl.float32), (BLOCK_N, P))
        mn_lo = tl.reshape(first_min * (mn & 0xFF).to(tl.float32), (BLOCK_N, P))
        mn_hi = tl.reshape(first_min * (mn >> 8).to(tl.float32), (BLOCK_N, P))
    words = split4(q)  # byte t of word i: element 16h + 4i + t of sub-block 2c (low nibble), 2c + 1 (high)
    lo = ()
    hi = ()
    for i in tl.static_range(4):
        lo = lo + (words[i] & 0x0F0F0F0F,)
        hi = hi + ((words[i] >> 4) & 0x0F0F0F0F,)
    new = ()
    for m in tl.static_range(M):
        xl, xh, dl, dh, sl, sh = _q4_k_piece_acts(xq_ptr + m * (K // 4), dx_ptr + m * (K // 32),
                                                  sx_ptr + m * (K // 32), w0, b0, NB)
        s_lo, s_hi = low_high_sums(lo, hi, xl, xh, BLOCK_N, P, DOT, UNPACK)
        new = new + (acc[m] + sc_lo * dl * s_lo + sc_hi * dh * s_hi - mn_lo * sl - mn_hi * sh,)
    return new


@triton.jit
def q4_k_pieces_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): dm, scales (one head plane), qs
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, UNPACK: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
):
    """Q4_K with the lanes along each row: 16-byte pieces of the quant plane and 16-byte head records
    (layout.py's HEAD planes), both loaded as contiguous runs (see block_planes' FLAT)."""
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    _q4_k_pieces(xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr, o0, r0, o2, r2, N, K,
                 blocks_per_split, tl.program_id(0), tl.program_id(1), M, BLOCK_N, NB, SPLIT, DOT, CARRY, PDL,
                 UNPACK)


@triton.jit
def _q4_k_pieces(xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr, o0, r0, o2, r2, N, K,
                 blocks_per_split, pn, pk, M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                 SPLIT: tl.constexpr, DOT: tl.constexpr, CARRY: tl.constexpr, PDL: tl.constexpr,
                 UNPACK: tl.constexpr):
    """The pieces kernel's work at (pn, pk) of its grid (flat_words.program_rows_at)."""
    mags = (magic(0, N > 0, False), magic(8, N > 0, False))
    rows, r64, first, n_iter = program_rows_at(pn, pk, N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs = row_runs(base, o2, r2, r64, first * 32, NB * 32, tl.int32)
    hd = row_runs(base, o0, r0, r64, first * 4, NB * 4, tl.int32)
    w0 = first * 64  # the tile's first activation word and q8_1 block
    bx = first * 8
    acc = zero_rows(M, BLOCK_N, NB * 8)
    if CARRY:
        tile = _q4_k_piece_tile(qs, hd, BLOCK_N, NB)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q4_k_piece_tile(qs, hd, BLOCK_N, NB)
        pdl.wait_for_inputs(PDL)  # the first tile's loads are in flight (a no-op after the first)
        more = it + 1 < n_iter
        qs += advance(more, NB * 32, CARRY)
        hd += advance(more, NB * 4, CARRY)
        acc = _q4_k_piece_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, w0, bx, K, mags, M, BLOCK_N, NB, DOT, UNPACK)
        w0 += NB * 64
        bx += NB * 8
        if CARRY:
            tile = _q4_k_piece_tile(qs, hd, BLOCK_N, NB)  # the next tile's loads
    pdl.wait_for_inputs(PDL)
    store_rows_at(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT, pn, pk)


@triton.jit
def _q6_k_piece_tile(ql_p, qh_p, sp, dp, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Loads of one Q6_K tile, each a contiguous run per row: the ql words as [BLOCK_N, 8 NB, 4] (16-byte
    piece p = 8 sb + 4h + u: ql bytes 64h + 16u ..), the qh words that go with each piece (qh bytes
    32h + 16 (u % 2) .., each qh run serving two pieces), the scale words [BLOCK_N, NB] x 4 and d. (Each
    piece's qh loaded for it instead, GATHER-style, gave the products a layout of their own and eight
    conversions an iteration in Triton 3.6.)"""
    ql = tl.reshape(tl.load(ql_p), [BLOCK_N, NB * 8, 4])
    qh = tl.reshape(tl.load(qh_p), [BLOCK_N, NB, 2, 1, 2, 4])  # (sb, h, -, u % 2, w)
    qh = tl.reshape(tl.broadcast_to(qh, [BLOCK_N, NB, 2, 2, 2, 4]), [BLOCK_N, NB * 8, 4])  # (sb, h, u // 2, u % 2)
    s0, s1, s2, s3 = split4(tl.reshape(tl.load(sp), [BLOCK_N, NB, 4]))
    d = tl.load(dp).to(tl.float32)
    return ql, qh, s0, s1, s2, s3, d


@triton.jit
def _q6_k_piece_acts(xrow, dxrow, w0, b0, NB: tl.constexpr):
    """One row of x for a Q6_K pieces tile: the words the low nibbles (elements 128h + 16u ..) and the high
    nibbles (+ 64) of each piece multiply, 4 [1, 8 NB] each, and their q8_1 scales [1, 8 NB]."""
    # word sb * 64 + 32h + 16k + 4u + w (k = 0: low nibbles, 1: high)
    xl, xh = _run_words(xrow, w0, NB, 2, 4)  # (sb, h, k, u, w)
    # q8_1 block sb * 8 + 4h + 2k + u // 2
    v = tl.permute(tl.reshape(tl.load(dxrow + b0 + tl.arange(0, NB * 8)), (NB, 2, 2, 2)), (0, 1, 3, 2))
    dl, dh = tl.split(v)  # [NB, h, u // 2]
    dl = tl.reshape(tl.join(dl, dl), (1, NB * 8))
    dh = tl.reshape(tl.join(dh, dh), (1, NB * 8))
    return xl, xh, dl, dh


@triton.jit
def _q6_k_piece_dots(tile, acc, xq_ptr, dx_ptr, w0, b0, K, smag, M: tl.constexpr, BLOCK_N: tl.constexpr,
                     NB: tl.constexpr, DOT: tl.constexpr, UNPACK: tl.constexpr):
    """A Q6_K pieces tile's products: each piece's 16 low-nibble codes (sub-block 8h + u) and 16
    high-nibble codes (8h + 4 + u), their two high bits from qh bits 2 (u // 2) and 4 + 2 (u // 2).
    UNPACK 1: the signed scale bytes and the integer sums made floats by exact adds (flat_words.field with
    the signed magic `smag`, _exact_f32) instead of conversions; the same products, bitwise."""
    ql, qh, s0, s1, s2, s3, d = tile
    P: tl.constexpr = NB * 8
    pp = tl.arange(0, 8)
    first = (pp < 4)[None, None, :]  # h = 0
    byte = (8 * (pp % 4))[None, None, :]
    sc_lo = tl.where(first, s0[:, :, None], s2[:, :, None])  # scale byte 8h + u, then 8h + 4 + u
    sc_hi = tl.where(first, s1[:, :, None], s3[:, :, None])
    if UNPACK:
        sc_lo = tl.reshape(d[:, :, None] * field(sc_lo >> byte, 0xFF, 0, smag, 128), (BLOCK_N, P))
        sc_hi = tl.reshape(d[:, :, None] * field(sc_hi >> byte, 0xFF, 0, smag, 128), (BLOCK_N, P))
    else:
        sc_lo = tl.reshape(d[:, :, None] * (((sc_lo << (24 - byte)) >> 24).to(tl.float32)), (BLOCK_N, P))
        sc_hi = tl.reshape(d[:, :, None] * (((sc_hi << (24 - byte)) >> 24).to(tl.float32)), (BLOCK_N, P))
    shift = tl.reshape(tl.broadcast_to((2 * ((pp % 4) // 2))[None, None, :], (1, NB, 8)), (1, P))
    lq = split4(ql)
    hq = split4(qh)
    lo = ()
    hi = ()
    for i in tl.static_range(4):
        h2 = hq[i] >> shift
        lo = lo + (minus_32((lq[i] & 0x0F0F0F0F) | ((h2 << 4) & 0x30303030)),)
        hi = hi + (minus_32(((lq[i] >> 4) & 0x0F0F0F0F) | (h2 & 0x30303030)),)
    new = ()
    for m in tl.static_range(M):
        xl, xh, dl, dh = _q6_k_piece_acts(xq_ptr + m * (K // 4), dx_ptr + m * (K // 32), w0, b0, NB)
        s_lo, s_hi = low_high_sums(lo, hi, xl, xh, BLOCK_N, P, DOT, UNPACK)
        new = new + (acc[m] + sc_lo * dl * s_lo + sc_hi * dh * s_hi,)
    return new


@triton.jit
def q6_k_pieces_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): ql, qh, scales, d
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, UNPACK: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
):
    """Q6_K with the lanes along each row (as q4_k_pieces_kernel): every plane loaded as contiguous runs."""
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    _q6_k_pieces(xq_ptr, dx_ptr, base, part_ptr, out_ptr, count_ptr, o0, r0, o1, r1, o2, r2, o3, r3, N, K,
                 blocks_per_split, tl.program_id(0), tl.program_id(1), M, BLOCK_N, NB, SPLIT, DOT, CARRY, PDL,
                 UNPACK)


@triton.jit
def _q6_k_pieces(xq_ptr, dx_ptr, base, part_ptr, out_ptr, count_ptr, o0, r0, o1, r1, o2, r2, o3, r3, N, K,
                 blocks_per_split, pn, pk, M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                 SPLIT: tl.constexpr, DOT: tl.constexpr, CARRY: tl.constexpr, PDL: tl.constexpr,
                 UNPACK: tl.constexpr):
    """The Q6_K pieces kernel's work at (pn, pk) of its grid (flat_words.program_rows_at)."""
    smag = magic(0, N > 0, True)
    rows, r64, first, n_iter = program_rows_at(pn, pk, N, blocks_per_split, K // 256, BLOCK_N, NB)
    ql_p = row_runs(base, o0, r0, r64, first * 32, NB * 32, tl.int32)
    qh_p = row_runs(base, o1, r1, r64, first * 16, NB * 16, tl.int32)
    sp = row_runs(base, o2, r2, r64, first * 4, NB * 4, tl.int32)
    dp = row_runs(base, o3, r3, r64, first, NB, tl.float16)
    w0 = first * 64
    bx = first * 8
    acc = zero_rows(M, BLOCK_N, NB * 8)
    if CARRY:
        tile = _q6_k_piece_tile(ql_p, qh_p, sp, dp, BLOCK_N, NB)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q6_k_piece_tile(ql_p, qh_p, sp, dp, BLOCK_N, NB)
        pdl.wait_for_inputs(PDL)
        more = it + 1 < n_iter
        ql_p += advance(more, NB * 32, CARRY)
        qh_p += advance(more, NB * 16, CARRY)
        sp += advance(more, NB * 4, CARRY)
        dp += advance(more, NB, CARRY)
        acc = _q6_k_piece_dots(tile, acc, xq_ptr, dx_ptr, w0, bx, K, smag, M, BLOCK_N, NB, DOT, UNPACK)
        w0 += NB * 64
        bx += NB * 8
        if CARRY:
            tile = _q6_k_piece_tile(ql_p, qh_p, sp, dp, BLOCK_N, NB)
    pdl.wait_for_inputs(PDL)
    store_rows_at(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT, pn, pk)


_KERNELS = {T.Q4_K: q4_k_pieces_kernel, T.Q6_K: q6_k_pieces_kernel}
TYPES = frozenset(_KERNELS)


def candidates(type_id: int, n: int, k: int, m: int, sm_count: int) -> list[dict[str, int]]:
    """The launch configs a sweep times at one row: the rule's tile candidates (matvec_launch), each with
    carry 1 and 0, unpack 0 and 1, and 8 and 32 rows a program beside the rule's (the H200's best was
    often fewer rows than the groups kernel's: Q6_K 8). None above one row."""
    if m != 1:
        return []
    return unique([{**c, "carry": carry, "block_n": bn, "unpack": unpack}
                   for c in launch_candidates(type_id, n, k, m, sm_count) for carry in (1, 0)
                   for bn in sorted({c["block_n"], 8, 32}) for unpack in (0, 1)])


def matvec_pieces(x: torch.Tensor, w: PackedWeight, params: dict[str, int], q8_1: Q8_1 | None = None,
                  out: torch.Tensor | None = None, experts: Experts | None = None) -> torch.Tensor:
    """x [M <= 8, K] -> y [M, N] f32 as matvec_int8.matvec_int8, for Q4_K and Q6_K; params as there, and
    unpack 1: int-to-float by exact adds (Q4_K: and its scales decoded with per-piece masks)."""
    if w.type_id not in TYPES:
        raise ValueError(f"the pieces mat-vec takes Q4_K and Q6_K; got {w.type_name}")
    launch = plan("pieces", x, w, params, experts)
    M, K = x.shape
    rows = experts.count if experts is not None else M
    q, dx, sx = q8_1 if q8_1 is not None else quantize_q8_1(x)
    part, y, counts = launch.outputs(rows, w.n, x.device, out)
    expert_args, expert_consts = launch.expert_args(w, experts)
    _KERNELS[w.type_id][launch.grid(w.n)](
        q.view(torch.int32), dx, sx, w.data, part, y, counts, *w.field_args(), w.n, K, launch.per_split,
        *expert_args, M=1 if experts is not None else M, BLOCK_N=params["block_n"], NB=launch.per_tile,
        SPLIT=launch.split, DOT=dot_kind(x.device), CARRY=params.get("carry", 1), UNPACK=params.get("unpack", 0),
        **expert_consts, num_warps=params["num_warps"], num_stages=1, **pdl.launch_args(x.device),
    )
    return y
