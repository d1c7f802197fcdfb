"""The `lanes` decode mat-vec: 1..8 activation rows on NVIDIA's matrix units, with each lane building its own
operands: y[M, N] = x[M, K] @ W[N, K]^T, x quantized to q8_1 (as matvec_int8), W Q4_K, Q6_K or a 32-element
type with one scale a block, Q8_0, Q4_0, IQ4_NL or MXFP4 (lanes_kernel, one loop for all of them, with a
type's loads and products beside it).

Why lanes. At 8 rows of x the dp4a kernels (matvec_int8.py) issue about 8 dp4a and 2 activation loads per
4 bytes of weight in every lane, and a tl.dot kernel spends its time moving codes and activations into the
dot's operand layout through shared memory. One mma.sync m16n8k32 (int8, int32 accumulate)
multiplies 16 weight rows by 32 elements of 8 activation rows, exactly the shape of a decode step of up
to 8 sequences; each lane holds 4 words of A (16 int8 of 2 rows), 2 of B (8 int8 of 1 row of x) and gets
4 int32 of the result. Here every tensor is one value per lane (`lanes`: [32 W], lane i % 32 of warp
i // 32), so the code says what each lane loads and which register it passes: no layout conversion, no
shared memory, and one matrix instruction per 32-element block (Q4_K: sub-block; Q6_K, whose scales are
per 16 elements: an m16n8k16 per sub-block) of 16 rows.

Q4_K: each lane holds 8 bytes of each 32-byte chunk of a row, k 4t+i standing for the first 4 of them and k
16+4t+i for the next 4 (mma_lanes.py: any numbering A and B agree on); its 8 bytes of B are x's elements at
the same place of the sub-block, one 8-byte load. Which 8 bytes: a warp instruction over 8 rows costs a
cache line a row, so each lane loads 16 bytes (16t of each 64-byte half of the row's quants) and lanes t, t
^ 2 swap half of them (mma_lanes.exchange_halves: a shuffle and two selects a word pair), 8 lines for 512
bytes instead of 8 for 256 (measured 4-7% faster at M=8 than 8-byte loads). A chunk's low nibbles are
sub-block 2c and its high nibbles sub-block 2c + 1, so the same words give that row's A words of both
sub-blocks, one mask (and one shift) each.

Per lane and Q4_K super-block, for each 16-row group it holds: 4 loads of 16 bytes (rows g, g + 8; the
quants' two halves), its rows' 16-byte head records (d, dmin, the 12 scale bytes) in one load each, 8 mma
and the f32 scaling of 4 results a sub-block (d sc[s] dx[s] times the integer sum, less dmin m[s] sx[s]);
the x words and the q8_1 scales (columns g and 2t, 2t + 1, 8 bytes a load) once for all its groups (BLOCK_N
= 16 W R: R groups a warp). The 32-element types: Q8_0 8 bytes at 8t of the block's 32 (elements 8t.. at k
4t.., 8t+4.. at k 16+4t..; its 16-byte loads with the exchange measured slower); the nibble types' block is
16 bytes, byte l holding elements l (low nibble) and l + 16 (high), so lane t's 4 bytes at 4t give k 4t..
(low nibbles) and k 16+4t.. (high) in the instruction's own numbering, and its B words are x's elements 4t..
and 16+4t.. (two 4-byte loads); Q4_0 as unsigned codes with its 8 taken off through the q8_1 sums, IQ4_NL
and MXFP4 through int8_ops.lookup16. Their scales: a tile's NB records of a row in 8-byte loads.

The fragments and the lanes' bookkeeping: mma_lanes.py. sm_80 and later; no AMD part (gfx906 has no
matrix units). Torch reference: matvec_int8.reference_matvec_q8_1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.flat_words import q4_k_scale_min
from vegaserve.triton_kernels.int8_ops import PTX_DP4A, lookup16, minus_32, pairs_order
from vegaserve.triton_kernels.layout import PackedWeight
from vegaserve.triton_kernels.matvec_int8 import dot_kind, matvec_int8, type_args
from vegaserve.triton_kernels.matvec_launch import plan, unique
from vegaserve.triton_kernels.mma_lanes import (
    byte_words,
    exchange_halves,
    f32_run,
    halves,
    lane_program,
    load16,
    mma_16x8x16,
    mma_16x8x32,
    pair_offsets,
    scaled,
    store_lanes,
    zero_acc,
)
from vegaserve.triton_kernels.q8_1 import Q8_1, quantize_q8_1
from vegaserve.triton_kernels.tiles_mxfp4 import half_scale

@triton.jit
def _q4_k_rows_tile(hp, qp, DOT: tl.constexpr):
    """One lane's loads of a super-block for one row, 16 bytes each: bytes 16t.. of each 64-byte half of
    the quants (chunk 2e + t // 2 of half e, its bytes 16 (t % 2)..: mma_lanes.exchange_halves) and the
    16-byte head record (d and dmin, scale words a, b, c)."""
    return load16(qp, DOT), load16(qp + 64, DOT), load16(hp, DOT)


@triton.jit
def _q4_k_scales(head, s: tl.constexpr):
    """d sc[s] and dmin m[s] of sub-block s of a row's head record (4 words), f32."""
    dm, a, b, c = head
    sc, mn = q4_k_scale_min(a, b, c, s)
    d = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (dm >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def _q4_k_products(tile, acc, xp, xo, lo, xlive, dxp, sxp, clive, R: tl.constexpr, W: tl.constexpr,
                   DOT: tl.constexpr):
    """A super-block's products for the lane's R groups: acc[j] = (top 2t, top 2t + 1, bottom 2t, bottom
    2t + 1) f32. xp: x of column g at the super-block's first element (xlive: g < M), xo: the lane's
    offsets in a sub-block of even and odd chunks (mma_lanes.pair_offsets); dxp, sxp: the q8_1 scales and sums of
    columns 2t and 2t + 1 at its first sub-block (clive: each < M). Its two halves one after the other
    (_q4_k_half_products)."""
    for e in tl.static_range(2):
        quants = ()
        heads = ()
        for j in tl.static_range(2 * R):
            quants = quants + (tile[j][e],)
            heads = heads + (tile[j][2],)
        acc = _q4_k_half_products(quants, heads, acc, e, xp, xo, lo, xlive, dxp, sxp, clive, R, W, DOT)
    return acc


@triton.jit
def _q4_k_half_products(quants, heads, acc, e: tl.constexpr, xp, xo, lo, xlive, dxp, sxp, clive, R: tl.constexpr,
                        W: tl.constexpr, DOT: tl.constexpr):
    """Half e of a super-block (quant bytes 64e.., chunks 2e and 2e + 1: sub-blocks 4e .. 4e + 3) for the
    lane's R groups, from each of its 2R rows' 16-byte load of that half (`quants`) and head record
    (`heads`); arguments as _q4_k_products'."""
    dx0 = f32_run(dxp[0] + 4 * e, clive[0], 4)
    dx1 = f32_run(dxp[1] + 4 * e, clive[1], 4)
    sx0 = f32_run(sxp[0] + 4 * e, clive[0], 4)
    sx1 = f32_run(sxp[1] + 4 * e, clive[1], 4)
    chunks = ()
    for j in tl.static_range(2 * R):
        chunks = chunks + (exchange_halves(quants[j], lo, W, DOT),)
    new = acc
    for i in tl.static_range(4):  # sub-block s = 4e + i: chunk 2e + i // 2, its low nibbles for even s
        b0, b1 = halves(tl.load((xp + 32 * (4 * e + i) + xo[(i // 2) % 2]).to(tl.pointer_type(tl.int64)), mask=xlive,
                                other=0))
        out = ()
        for j in tl.static_range(R):
            t_lo, t_hi = chunks[2 * j][i // 2]
            b_lo, b_hi = chunks[2 * j + 1][i // 2]
            if i % 2 == 1:  # sub-block 4e + i odd: the chunk's high nibbles
                t_lo, t_hi, b_lo, b_hi = t_lo >> 4, t_hi >> 4, b_lo >> 4, b_hi >> 4
            d0, d1, d2, d3 = mma_16x8x32(t_lo & 0x0F0F0F0F, b_lo & 0x0F0F0F0F, t_hi & 0x0F0F0F0F,
                                         b_hi & 0x0F0F0F0F, b0, b1, W, DOT)
            st, mt = _q4_k_scales(heads[2 * j], 4 * e + i)
            sb, mb = _q4_k_scales(heads[2 * j + 1], 4 * e + i)
            a0, a1, a2, a3 = scaled(new[j], d0, d1, d2, d3, dx0[i], dx1[i], st, sb)
            out = out + ((a0 - mt * sx0[i], a1 - mt * sx1[i], a2 - mb * sx0[i], a3 - mb * sx1[i]),)
        new = out
    return new


@triton.jit
def _legacy_rows_tile(dp, qp, NB: tl.constexpr, WORDS: tl.constexpr, E8M0: tl.constexpr, FIRST: tl.constexpr = 0):
    """One lane's loads of NB blocks of one row from block FIRST of the tile on: the quant bytes (WORDS 8: 8
    bytes at 8t of each block's 32; 4: 4 bytes at 4t of its 16) and the NB scales in as few loads as their
    bytes allow. (Q8_0 in 16-byte loads and exchange_halves, as Q4_K, measured slower.)"""
    SIZE: tl.constexpr = 1 if E8M0 else 2
    q = ()
    for b in tl.static_range(FIRST, FIRST + NB):
        if WORDS == 8:
            q = q + (tl.load((qp + 32 * b).to(tl.pointer_type(tl.int64))),)
        else:
            q = q + (tl.load((qp + 16 * b).to(tl.pointer_type(tl.int32))),)
    return q, byte_words(dp + FIRST * SIZE, NB * SIZE)


@triton.jit
def _legacy_scale(words, b: tl.constexpr, E8M0: tl.constexpr):
    """Block b's scale from the row's scale words, f32 (MXFP4: half its E8M0 scale, as its doubled levels)."""
    SIZE: tl.constexpr = 1 if E8M0 else 2
    w = words[(b * SIZE) // 4] >> (8 * ((b * SIZE) % 4))
    if E8M0:
        return half_scale(w & 0xFF)
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _legacy_codes(q, WORDS: tl.constexpr, TABLE: tl.constexpr, DOT: tl.constexpr):
    """A lane's two A words of one row of a block: Q8_0 the two halves of its 8 bytes (elements 8t..8t+3 at
    k 4t.., 8t+4.. at k 16+4t..); Q4_0 the low nibbles of its 4 bytes (elements 4t..4t+3, k 4t..) and the
    high ones (16+4t.., k 16+4t..) as unsigned codes; IQ4_NL and MXFP4 their TABLE's levels in the
    lookup's pair order (elements 4t, 16+4t, 4t+1, 17+4t at k 4t.., the rest at k 16+4t..: two permutes
    a word fewer, the B words put in that order once a block instead, _legacy_products)."""
    if WORDS == 8:
        return halves(q)
    elif TABLE == 0:
        return q & 0x0F0F0F0F, (q >> 4) & 0x0F0F0F0F
    else:
        return lookup16(q, TABLE, DOT, PAIRS=True)


@triton.jit
def _legacy_products(tile, acc, xp, xlive, dxp, sxp, clive, R: tl.constexpr, W: tl.constexpr, NB: tl.constexpr,
                     WORDS: tl.constexpr, TABLE: tl.constexpr, E8M0: tl.constexpr, DOT: tl.constexpr,
                     FIRST: tl.constexpr = 0):
    """The products of NB blocks, blocks FIRST .. of the tile (`tile`: their loads, _legacy_rows_tile's), for
    the lane's R groups (acc as _q4_k_products'). xp: x at the tile's first element of column g; the B
    words are x's elements of the lane's k (Q8_0: 8t.. in one load; the nibble types: 4t.. and 16 + 4t..).
    Q4_0 takes its 8 off through the q8_1 sums: d (dx s - 8 sx)."""
    dx0 = f32_run(dxp[0] + FIRST, clive[0], NB)
    dx1 = f32_run(dxp[1] + FIRST, clive[1], NB)
    if TABLE == 0 and WORDS == 4:
        sx0 = f32_run(sxp[0] + FIRST, clive[0], NB)
        sx1 = f32_run(sxp[1] + FIRST, clive[1], NB)
    new = acc
    for b in tl.static_range(NB):
        if WORDS == 8:
            x0, x1 = halves(tl.load((xp + 32 * (FIRST + b)).to(tl.pointer_type(tl.int64)), mask=xlive, other=0))
        else:
            x0 = tl.load((xp + 32 * (FIRST + b)).to(tl.pointer_type(tl.int32)), mask=xlive, other=0)
            x1 = tl.load((xp + 32 * (FIRST + b) + 16).to(tl.pointer_type(tl.int32)), mask=xlive, other=0)
            if TABLE != 0:
                x0, x1 = pairs_order(x0, x1, DOT)
        out = ()
        for j in tl.static_range(R):
            top_q, top_s = tile[2 * j]
            bottom_q, bottom_s = tile[2 * j + 1]
            t_lo, t_hi = _legacy_codes(top_q[b], WORDS, TABLE, DOT)
            b_lo, b_hi = _legacy_codes(bottom_q[b], WORDS, TABLE, DOT)
            d0, d1, d2, d3 = mma_16x8x32(t_lo, b_lo, t_hi, b_hi, x0, x1, W, DOT)
            st = _legacy_scale(top_s, b, E8M0)
            sb = _legacy_scale(bottom_s, b, E8M0)
            if TABLE == 0 and WORDS == 4:
                a0, a1, a2, a3 = new[j]
                u0 = d0.to(tl.float32) * dx0[b] - 8.0 * sx0[b]
                u1 = d1.to(tl.float32) * dx1[b] - 8.0 * sx1[b]
                u2 = d2.to(tl.float32) * dx0[b] - 8.0 * sx0[b]
                u3 = d3.to(tl.float32) * dx1[b] - 8.0 * sx1[b]
                out = out + ((a0 + st * u0, a1 + st * u1, a2 + sb * u2, a3 + sb * u3),)
            else:
                out = out + (scaled(new[j], d0, d1, d2, d3, dx0[b], dx1[b], st, sb),)
        new = out
    return new


@triton.jit
def _q6_k_rows_tile(qlp, qhp, sp, dp, FIRST: tl.constexpr = 0, COUNT: tl.constexpr = 2):
    """One lane's loads of halves FIRST .. FIRST + COUNT - 1 of a Q6_K super-block (128 elements each) for
    one row: the ql words at 64h + 32p + 16u + 4t (index 4h + 2p + u, h counted from FIRST), the qh words at
    32h + 16u + 4t (2h + u), the halves' scale bytes (2 words a half) and d."""
    ql = ()
    for i in tl.static_range(4 * FIRST, 4 * (FIRST + COUNT)):
        ql = ql + (tl.load((qlp + 64 * (i // 4) + 32 * ((i // 2) % 2) + 16 * (i % 2)).to(tl.pointer_type(tl.int32))),)
    qh = ()
    for i in tl.static_range(2 * FIRST, 2 * (FIRST + COUNT)):
        qh = qh + (tl.load((qhp + 32 * (i // 2) + 16 * (i % 2)).to(tl.pointer_type(tl.int32))),)
    d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
    return ql, qh, byte_words(sp + 8 * FIRST, 8 * COUNT), d


@triton.jit
def _q6_k_codes(ql, qh, h: tl.constexpr, j: tl.constexpr, u: tl.constexpr):
    """The signed codes (q - 32) of sub-block (h, j, u) in a lane's word: element 128h + 32j + 16u + 4t + i
    at byte i, from ql's nibble j // 2 of its word (h, j % 2, u) and qh's bits 2j, 2j + 1."""
    low = (ql[4 * h + 2 * (j % 2) + u] >> (4 * (j // 2))) & 0x0F0F0F0F
    high = ((qh[2 * h + u] >> (2 * j)) & 0x03030303) << 4
    return minus_32(low | high)


@triton.jit
def _q6_k_scale(words, i: tl.constexpr):
    """Scale byte i (sub-block i = 8h + 2j + u), sign-extended, int32."""
    return (words[i // 4] << (24 - 8 * (i % 4))) >> 24


@triton.jit
def _q6_k_products(tile, acc, xp, xlive, dxp, clive, R: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr,
                   FIRST: tl.constexpr = 0, COUNT: tl.constexpr = 2):
    """The products of halves FIRST .. FIRST + COUNT - 1 of a Q6_K super-block (`tile`: their loads,
    _q6_k_rows_tile's) for the lane's R groups (acc as _q4_k_products'): one m16n8k16 per 16-element
    sub-block; the two sub-blocks of a q8_1 block (u = 0, 1) combined in int32 with their scales, then
    scaled by d dx once."""
    dx0 = f32_run(dxp[0] + 4 * FIRST, clive[0], 4 * COUNT)
    dx1 = f32_run(dxp[1] + 4 * FIRST, clive[1], 4 * COUNT)
    new = acc
    for hj in tl.static_range(4 * COUNT):  # q8_1 block 4 (FIRST + h) + j of the super-block
        xs = ()
        for u in tl.static_range(2):
            xs = xs + (tl.load((xp + 32 * (4 * FIRST + hj) + 16 * u).to(tl.pointer_type(tl.int32)), mask=xlive,
                               other=0),)
        out = ()
        for r in tl.static_range(R):
            top_ql, top_qh, top_s, top_d = tile[2 * r]
            bot_ql, bot_qh, bot_s, bot_d = tile[2 * r + 1]
            v0 = tl.zeros_like(xs[0])
            v1 = v0
            v2 = v0
            v3 = v0
            for u in tl.static_range(2):
                d0, d1, d2, d3 = mma_16x8x16(_q6_k_codes(top_ql, top_qh, hj // 4, hj % 4, u),
                                             _q6_k_codes(bot_ql, bot_qh, hj // 4, hj % 4, u), xs[u], W, DOT)
                st = _q6_k_scale(top_s, 8 * (hj // 4) + 2 * (hj % 4) + u)
                sb = _q6_k_scale(bot_s, 8 * (hj // 4) + 2 * (hj % 4) + u)
                v0 += d0 * st
                v1 += d1 * st
                v2 += d2 * sb
                v3 += d3 * sb
            out = out + (scaled(new[r], v0, v1, v2, v3, dx0[hj], dx1[hj], top_d, bot_d),)
        new = out
    return new


Q4_K_LANES, Q6_K_LANES, BLOCK_LANES = 1, 2, 0  # lanes_kernel's KIND


@triton.jit
def _planes(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, r64, first, t, KIND: tl.constexpr,
            WORDS: tl.constexpr, SIZE: tl.constexpr):
    """A row's byte pointers to the planes a lane reads, at the split's first block: Q4_K the head record and
    the quants at 16t; Q6_K ql and qh at 4t, the scales and d; the 32-element types the scales (SIZE bytes
    a block) and the quants at WORDS t."""
    if KIND == 1:
        return base + o0 + r64 * r0 + first * b0, base + o2 + r64 * r2 + first * b2 + 16 * t
    elif KIND == 2:
        return (base + o0 + r64 * r0 + first * b0 + 4 * t, base + o1 + r64 * r1 + first * b1 + 4 * t,
                base + o2 + r64 * r2 + first * b2, base + o3 + r64 * r3 + first * b3)
    else:
        return base + o0 + r64 * r0 + first * SIZE, base + o1 + r64 * r1 + first * b1 + WORDS * t


@triton.jit
def _plane_steps(b0, b1, b2, b3, KIND: tl.constexpr, NB: tl.constexpr, SIZE: tl.constexpr):
    """How far each of _planes' pointers moves from one tile to the next."""
    if KIND == 1:
        return b0, b2
    elif KIND == 2:
        return b0, b1, b2, b3
    else:
        return NB * SIZE, NB * b1


@triton.jit
def _tile(ptrs, R: tl.constexpr, KIND: tl.constexpr, NB: tl.constexpr, WORDS: tl.constexpr, E8M0: tl.constexpr,
          DOT: tl.constexpr):
    """The loads of one tile for each of the lane's 2R rows (group j: rows g + 16 j, then + 8)."""
    tile = ()
    for j in tl.static_range(2 * R):
        p = ptrs[j]
        if KIND == 1:
            tile = tile + (_q4_k_rows_tile(p[0], p[1], DOT),)
        elif KIND == 2:
            tile = tile + (_q6_k_rows_tile(p[0], p[1], p[2], p[3]),)
        else:
            tile = tile + (_legacy_rows_tile(p[0], p[1], NB, WORDS, E8M0),)
    return tile


@triton.jit
def lanes_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py) of the type
    N, K, blocks_per_split,  # blocks of the type (super-blocks of 256 for the K-quants)
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, W: tl.constexpr, KIND: tl.constexpr, WORDS: tl.constexpr,
    TABLE: tl.constexpr, E8M0: tl.constexpr,
):
    """1..8 rows of x, BLOCK_N = 16 W R rows a program (W its warps, R groups of 16 rows a warp). KIND 1:
    Q4_K (fields dm, scales as one head record, qs), one super-block an iteration; 2: Q6_K (ql, qh,
    scales, d), one super-block an iteration; 0: the 32-element types (d or e, qs: WORDS 8 Q8_0, 4 the
    nibble types with TABLE 0 Q4_0, 1 IQ4_NL, 2 MXFP4 and its E8M0 scale), NB blocks an iteration (even).
    DOT 1: the mma instructions, 0 their emulation. CARRY 1: the next tile's weight loads are issued
    before this one's products."""
    pdl.let_next_start(PDL)
    R: tl.constexpr = BLOCK_N // (16 * W)
    QK: tl.constexpr = 32 if KIND == 0 else 256
    PER: tl.constexpr = NB * 32 if KIND == 0 else 256  # elements a tile
    SIZE: tl.constexpr = 1 if E8M0 else 2
    XLANE: tl.constexpr = 0 if KIND == 1 else (4 if KIND == 2 else WORDS)  # x at a lane's 4t or 8t (Q4_K: pair_offsets)
    rows, r64, first, n_iter, g, t, cols = lane_program(N, blocks_per_split, K // QK, BLOCK_N, W)
    n_iter = n_iter // (PER // QK)
    ptrs = ()
    for j in tl.static_range(2 * R):
        ptrs = ptrs + (_planes(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, r64[j], first, t, KIND,
                               WORDS, SIZE),)
    steps = _plane_steps(b0, b1, b2, b3, KIND, NB, SIZE)
    xlive = g < M
    xp = xq_ptr.to(tl.pointer_type(tl.int8)) + tl.minimum(g, M - 1) * K + first * QK + XLANE * t
    clive = (cols[0] < M, cols[1] < M)
    v0 = tl.minimum(cols[0], M - 1) * (K // 32) + first * (QK // 32)
    v1 = tl.minimum(cols[1], M - 1) * (K // 32) + first * (QK // 32)
    dxp = (dx_ptr + v0, dx_ptr + v1)
    sxp = (sx_ptr + v0, sx_ptr + v1)
    acc = zero_acc(R, W)
    if CARRY:
        tile = _tile(ptrs, R, KIND, NB, WORDS, E8M0, DOT)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _tile(ptrs, R, KIND, NB, WORDS, E8M0, DOT)
        pdl.wait_for_inputs(PDL)  # the first weight loads are in flight (a no-op after the first)
        more = it + 1 < n_iter
        moved = ()
        for j in tl.static_range(2 * R):
            row = ()
            for p in tl.static_range(len(steps)):
                if CARRY:  # after the last tile the extra loads read it again instead of past the split
                    row = row + (ptrs[j][p] + tl.where(more, steps[p], 0),)
                else:
                    row = row + (ptrs[j][p] + steps[p],)
            moved = moved + (row,)
        ptrs = moved
        if KIND == 1:
            acc = _q4_k_products(tile, acc, xp, pair_offsets(t), t < 2, xlive, dxp, sxp, clive, R, W, DOT)
        elif KIND == 2:
            acc = _q6_k_products(tile, acc, xp, xlive, dxp, clive, R, W, DOT)
        else:
            acc = _legacy_products(tile, acc, xp, xlive, dxp, sxp, clive, R, W, NB, WORDS, TABLE, E8M0, DOT)
        xp += PER
        dxp = (dxp[0] + PER // 32, dxp[1] + PER // 32)
        sxp = (sxp[0] + PER // 32, sxp[1] + PER // 32)
        if CARRY:
            tile = _tile(ptrs, R, KIND, NB, WORDS, E8M0, DOT)  # the next tile's loads
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile
    store_lanes(part_ptr, out_ptr, count_ptr, acc, rows, cols, M, N, R, SPLIT)


# the int8 kernel's types but those whose scales it decodes from super-block records (IQ4_XS, Q3_K)
TYPES = frozenset({T.Q8_0, T.Q4_0, T.IQ4_NL, T.MXFP4, T.Q4_K, T.Q6_K})
_KIND = {T.Q4_K: Q4_K_LANES, T.Q6_K: Q6_K_LANES}


def has_matrix_units(device: torch.device) -> bool:
    """Whether the lanes kernel runs on `device`: an NVIDIA GPU of sm_80 or later."""
    return (device.type == "cuda" and not torch.version.hip
            and torch.cuda.get_device_capability(device) >= (8, 0))


def candidates(type_id: int, n: int, k: int, sm_count: int) -> list[dict[str, int]]:
    """The launch configs a sweep times: 2 groups of 16 rows a warp on 1, 2 or 4 warps, 1 on 4 (8 warps lost
    everywhere on the H200); the 32-element types with 4 and 8 blocks a tile (the K-quants: a super-block
    an iteration, nb 8); the smallest power-of-two split-K that gives two programs an SM, with at least two
    tiles a split, and twice that."""
    qk = 256 if type_id in (T.Q4_K, T.Q6_K) else 32
    out = []
    for block_n, warps in ((32, 1), (64, 2), (64, 4), (128, 4)):
        for nb in (8,) if qk == 256 else (4, 8):
            tiles = k // qk // max(1, nb * 32 // qk)
            split = 1
            while -(-n // block_n) * split < 2 * sm_count and tiles // (2 * split) >= 2:
                split *= 2
            out += [{"block_n": block_n, "num_warps": warps, "nb": nb, "split_k": s, "carry": 1}
                    for s in sorted({split, split * 2 if tiles // (2 * split) >= 2 else split})]
    return unique(out)


def kernel_args(type_id: int, num_warps: int) -> dict[str, int]:
    """lanes_kernel's constexprs for a type (benchmarks/kernel_resources.py compiles the same)."""
    return {"WORDS": 4, "TABLE": 0, "E8M0": False, **type_args(type_id), "W": num_warps,
            "KIND": _KIND.get(type_id, BLOCK_LANES)}


def matvec_lanes(x: torch.Tensor, w: PackedWeight, params: dict[str, int], q8_1: Q8_1 | None = None,
                 out: torch.Tensor | None = None, experts=None) -> torch.Tensor:
    """x [M <= 8, K] -> y [M, N] f32 as matvec_int8.matvec_int8; block_n a multiple of 16 x num_warps. The
    32-element types read a tile's q8_1 scales in pairs: a tile of one block (nb 1, or a row of an odd
    number of blocks) runs the int8 kernel with the same launch."""
    if w.type_id not in TYPES:
        raise ValueError(f"the lanes mat-vec has no kernel for {w.type_name}")
    if experts is not None:
        raise ValueError("the lanes mat-vec multiplies several rows of x by one weight; an expert assignment is one")
    if torch.version.hip or (dot_kind(x.device) == PTX_DP4A and not has_matrix_units(x.device)):
        raise ValueError("the lanes mat-vec takes mma.sync m16n8k32 (int8): NVIDIA sm_80 and later")
    launch = plan("lanes", x, w, params)
    lanes_rows = 16 * params["num_warps"]
    if params["block_n"] % lanes_rows:
        raise ValueError(f"the lanes mat-vec takes block_n a multiple of 16 x num_warps ({lanes_rows}); got "
                         f"{params['block_n']}")
    if w.type_id not in (T.Q4_K, T.Q6_K) and launch.per_tile == 1:
        return matvec_int8(x, w, params, q8_1, out)
    M, K = x.shape
    q, dx, sx = q8_1 if q8_1 is not None else quantize_q8_1(x)
    part, y, counts = launch.outputs(M, w.n, x.device, out)
    lanes_kernel[launch.grid(w.n)](
        q.view(torch.int32), dx, sx, w.data, part, y, counts, *w.field_args(), w.n, K, launch.per_split,
        M=M, BLOCK_N=params["block_n"], NB=launch.per_tile, SPLIT=launch.split, DOT=dot_kind(x.device),
        CARRY=params.get("carry", 1), **kernel_args(w.type_id, params["num_warps"]),
        num_warps=params["num_warps"], num_stages=1, **pdl.launch_args(x.device),
    )
    return y
