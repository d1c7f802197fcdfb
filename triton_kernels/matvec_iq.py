"""The int8 decode mat-vec's kernels of the lattice types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S
(matvec_int8.py launches them: the same contract, x in q8_1, W repacked, four products a dot4). Each group of
8 (IQ3: 4) weights is a grid point, gathered as words of int8 coordinates from the type's table
(lattice.grid_words, 1-8 KB, in L1 after the first reads), its signs applied per byte. A program's groups are
64 elements of a super-block (quarter q: sub-blocks 2q and 2q + 1), q8_1 block 8 sb + 2q + h of sub-block h.

  IQ2_XXS  per 32-element sub-block (words a, b): d (0.5 + s) / 4 * dx * sum(g * xq), s the top four bits of
        b, g each group of 8's grid point (byte l of a) as two words of int8 coordinates, its signs (the
        7-bit index at bit 7l of b, its parity the eighth) applied as (g ^ m) + (m & 1) per byte with m 0xFF
        where negative (-g, no carry: g >= 1).
  IQ2_XS, IQ2_S  as IQ2_XXS with a scale d (0.5 + s) / 4 for each 16 weights (two points): two sums a
        sub-block; IQ2_XS's points 9 bits of a u16 whose top 7 index its signs, IQ2_S's 10 bits (a qs byte
        and two qh bits) with a sign byte each.
  IQ3_XXS, IQ3_S  per 32-element sub-block: its scale (d (0.5 + s) / 2; d (1 + 2s)) * dx * sum(g * xq), g
        each group of 4's grid point (IQ3_S's with a ninth bit from qh) as a word of int8 coordinates,
        signed as IQ2_XXS's (IQ3_S: its sign bytes as they are, no parity).
Torch reference: matvec_int8.reference_matvec_q8_1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.flat_words import (
    expert_program,
    program_rows,
    quarter_groups,
    split4,
    store_rows,
    word_ptrs,
    x_words,
    zero_rows,
)
from vegaserve.triton_kernels.int8_ops import advance, dot4

# the lattice table each type's kernel gathers (lattice.grid_words)
LATTICE = {T.IQ2_XXS: "IQ2_XXS", T.IQ2_XS: "IQ2_XS", T.IQ2_S: "IQ2_S", T.IQ3_XXS: "IQ3_XXS", T.IQ3_S: "IQ3_S",
           T.IQ1_S: "IQ1_S", T.IQ1_M: "IQ1_S"}  # (matvec_iq1.py's IQ1_S and IQ1_M)


@triton.jit
def _sign_byte(sign7):
    """7-bit sign indices -> sign bytes, bit 7 the parity of the other seven (an even number of signs)."""
    p = sign7 ^ (sign7 >> 4)
    p = p ^ (p >> 2)
    return sign7 | (((p ^ (p >> 1)) & 1) << 7)


@triton.jit
def _signed(g, sign, NIBBLE: tl.constexpr):
    """A word of 4 non-negative int8 coordinates with the signs of nibble NIBBLE of `sign` applied: byte i
    negated where bit i is set, (g ^ 0xFF) + 1 (no carry out of a byte: g >= 1)."""
    one = (((sign >> (4 * NIBBLE)) & 15) * 0x00204081) & 0x01010101  # bit i of the nibble -> bit 0 of byte i
    return (g ^ (one * 255)) + one


@triton.jit
def _signed_grid(tab, index, sign7):
    """IQ2_XXS: grid points `index` and their 7-bit sign indices (int32 [BLOCK_N, G]) -> the two words of
    each point's 8 int8 coordinates with its signs applied."""
    sign = _sign_byte(sign7)
    return _signed(tl.load(tab + 2 * index), sign, 0), _signed(tl.load(tab + 2 * index + 1), sign, 1)


@triton.jit
def _iq2_xxs_dots(tile, acc, tab, xq_ptr, dx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
                  G: tl.constexpr, DOT: tl.constexpr):
    """Group (sb, q): sub-blocks 2q + h (h = 0, 1), words a, b each; elements 64q + 32h + 8l + j of group
    l's point (byte l of a) and signs (bits 7l of b); q8_1 block 8 sb + 2q + h."""
    d, qs_w = tile
    words = split4(qs_w)
    new = acc
    for h in tl.static_range(2):
        a, b = words[2 * h], words[2 * h + 1]
        scale = d * (0.5 + ((b >> 28) & 15).to(tl.float32)) * 0.25
        vals = ()
        for grp in tl.static_range(4):
            vals = vals + _signed_grid(tab, (a >> (8 * grp)) & 255, (b >> (7 * grp)) & 127)
        acc_h = ()
        for m in tl.static_range(M):
            xrow = xq_ptr + m * (K // 4)
            xv = x_words(xrow, xw, 8 * h) + x_words(xrow, xw, 8 * h + 4)
            s = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            for i in tl.static_range(8):
                s = dot4(vals[i], xv[i], s, DOT)
            dx = tl.load(dx_ptr + m * (K // 32) + xb + h)[None, :]
            acc_h = acc_h + (new[m] + scale * dx * s.to(tl.float32),)
        new = acc_h
    return new


@triton.jit
def iq2_xxs_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
    tab_ptr=None,  # lattice.grid_words: the grid's points as int8 coordinates
):
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs_p, dp, sb, q = quarter_groups(base, o0, r0, b0, o1, r1, r64, first, NB)
    xw = (sb * 64 + q * 16)[:, None] + tl.arange(0, 4)[None, :]  # + 8h: sub-block 2q + h's 8 words
    xb = sb * 8 + q * 2  # + h: its q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = (tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32), tl.load(qs_p))
    for it in range(0, n_iter):
        if not CARRY:
            tile = (tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32), tl.load(qs_p))
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _iq2_xxs_dots(tile, acc, tab_ptr, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, G, DOT)
        qs_p += advance(more, NB * 16, CARRY)
        dp += advance(more, NB * b0, CARRY)
        if CARRY:  # the next tile's loads (ptxas issues them mid-loop)
            tile = (tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32), tl.load(qs_p))
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _iq3_dots(tile, acc, tab, xq_ptr, dx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
              G: tl.constexpr, DOT: tl.constexpr, S: tl.constexpr):
    """IQ3_XXS (S 0) and IQ3_S (S 1), group (sb, q): sub-blocks 2q + h, points 16q + 8h + p (4 weights
    each, 64q + 32h + 4p ..; point p of a sub-block is byte p % 4 of its qs word 2h + p // 4); each 8 weights'
    signs one byte (IQ3_XXS: from the 7-bit index at bit 7(p // 2) of the sub-block's word, with its parity;
    IQ3_S: byte 4h + p // 2 of the group's sign words), each point's low / high nibble of it; IQ3_S's
    points take a ninth bit from qh; q8_1 block 8 sb + 2q + h."""
    d, qs_w, aux0, aux1, qh, sc = tile
    qs = split4(qs_w)
    aux = (aux0, aux1)
    new = acc
    for h in tl.static_range(2):
        if S:
            scale = d * (1 + 2 * ((sc >> (4 * h)) & 15)).to(tl.float32)
        else:
            scale = d * (0.5 + ((aux[h] >> 28) & 15).to(tl.float32)) * 0.5
        vals = ()
        for p in tl.static_range(8):
            point = (qs[2 * h + p // 4] >> (8 * (p % 4))) & 255
            if S:
                point = point | (((qh >> (8 * h + p)) & 1) << 8)
                sign = aux[h] >> (8 * (p // 2))
            else:
                sign = _sign_byte((aux[h] >> (7 * (p // 2))) & 127)
            vals = vals + (_signed(tl.load(tab + point), sign, p % 2),)
        acc_h = ()
        for m in tl.static_range(M):
            xrow = xq_ptr + m * (K // 4)
            xv = x_words(xrow, xw, 8 * h) + x_words(xrow, xw, 8 * h + 4)
            s = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            for i in tl.static_range(8):
                s = dot4(vals[i], xv[i], s, DOT)
            dx = tl.load(dx_ptr + m * (K // 32) + xb + h)[None, :]
            acc_h = acc_h + (new[m] + scale * dx * s.to(tl.float32),)
        new = acc_h
    return new


@triton.jit
def _iq3_tile(qs_p, dp, sp, hp, cp, S: tl.constexpr):
    """Loads of one IQ3 tile: d, the group's qs run, its two sign (IQ3_XXS: scale and sign-index) words,
    and for IQ3_S its 16 qh bits and its scale byte."""
    d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
    qs, a0, a1 = tl.load(qs_p), tl.load(sp), tl.load(sp + 1)
    if S:
        qh = tl.load(hp.to(tl.pointer_type(tl.uint16))).to(tl.int32)
        sc = tl.load(cp).to(tl.int32)
    else:  # (unread)
        qh = a0
        sc = a0
    return d, qs, a0, a1, qh, sc


@triton.jit
def iq3_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs, scales_signs / d, qs, qh, signs_scales
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
    S: tl.constexpr = 0, tab_ptr=None,  # S: IQ3_S (else IQ3_XXS); lattice.grid_words of the type
):
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs_p, dp, sb, q = quarter_groups(base, o0, r0, b0, o1, r1, r64, first, NB)
    if S:  # qh bytes 2q, 2q + 1; sign bytes 8q .. 8q + 7, then the scale byte q at 32
        hp = base + o2 + r64[:, None] * r2 + (sb * b2 + 2 * q)[None, :]
        sp = (base + o3 + r64[:, None] * r3 + (sb * b3 + 8 * q)[None, :]).to(tl.pointer_type(tl.int32))
        cp = base + o3 + r64[:, None] * r3 + (sb * b3 + 32 + q)[None, :]
        step_s = b3
    else:  # scale and sign-index words 2q, 2q + 1
        sp = (base + o2 + r64[:, None] * r2 + (sb * b2 + 8 * q)[None, :]).to(tl.pointer_type(tl.int32))
        hp = dp
        cp = dp
        step_s = b2
    xw = (sb * 64 + q * 16)[:, None] + tl.arange(0, 4)[None, :]  # + 8h: sub-block 2q + h's 8 words
    xb = sb * 8 + q * 2  # + h: its q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _iq3_tile(qs_p, dp, sp, hp, cp, S)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _iq3_tile(qs_p, dp, sp, hp, cp, S)
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _iq3_dots(tile, acc, tab_ptr, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, G, DOT, S)
        qs_p += advance(more, NB * 16, CARRY)
        dp += advance(more, NB * b0, CARRY)
        sp += advance(more, NB * step_s // 4, CARRY)
        if S:
            hp += advance(more, NB * b2, CARRY)
            cp += advance(more, NB * b3, CARRY)
        if CARRY:
            tile = _iq3_tile(qs_p, dp, sp, hp, cp, S)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _iq2_pairs_dots(tile, acc, tab, xq_ptr, dx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
                    G: tl.constexpr, DOT: tl.constexpr, S: tl.constexpr):
    """IQ2_XS (S 0) and IQ2_S (S 1), group (sb, q): sub-blocks 2q + h, points 8q + 4h + p (8 weights each,
    64q + 32h + 8p ..), a scale nibble for each pair of points (nibble p // 2 of scale byte 2q + h). IQ2_XS:
    point p is u16 entry p of the sub-block (words 2h, 2h + 1): its low 9 bits the point, its top 7 the sign
    index (with its parity). IQ2_S: byte p of the sub-block's qs word h with two bits from qh (bits
    8h + 2p of the group's u16), its sign byte byte p of sign word h. q8_1 block 8 sb + 2q + h."""
    d, w0, w1, w2, w3, qh, sc = tile
    words = (w0, w1, w2, w3)
    new = acc
    for h in tl.static_range(2):
        vals = ()
        for p in tl.static_range(4):
            if S:
                point = ((words[h] >> (8 * p)) & 255) | (((qh >> (8 * h + 2 * p)) & 3) << 8)
                sign = words[2 + h] >> (8 * p)
            else:
                entry = words[2 * h + p // 2] >> (16 * (p % 2))
                point = entry & 511
                sign = _sign_byte((entry >> 9) & 127)
            vals = vals + (_signed(tl.load(tab + 2 * point), sign, 0), _signed(tl.load(tab + 2 * point + 1), sign, 1))
        byte = sc >> (8 * h)
        lo = d * (0.5 + (byte & 15).to(tl.float32)) * 0.25
        hi = d * (0.5 + ((byte >> 4) & 15).to(tl.float32)) * 0.25
        acc_h = ()
        for m in tl.static_range(M):
            xrow = xq_ptr + m * (K // 4)
            xv = x_words(xrow, xw, 8 * h) + x_words(xrow, xw, 8 * h + 4)
            s_lo = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            s_hi = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            for i in tl.static_range(4):
                s_lo = dot4(vals[i], xv[i], s_lo, DOT)
                s_hi = dot4(vals[4 + i], xv[4 + i], s_hi, DOT)
            dx = tl.load(dx_ptr + m * (K // 32) + xb + h)[None, :]
            acc_h = acc_h + (new[m] + dx * (lo * s_lo.to(tl.float32) + hi * s_hi.to(tl.float32)),)
        new = acc_h
    return new


@triton.jit
def _iq2_pairs_tile(qs_p, dp, hp, cp, S: tl.constexpr):
    """Loads of one IQ2_XS / IQ2_S tile: d, the group's four quant words (IQ2_XS: its 8 u16 entries; IQ2_S:
    its 8 qs bytes, then its 8 sign bytes), IQ2_S's 16 qh bits, and the group's two scale bytes."""
    d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
    sc = tl.load(cp.to(tl.pointer_type(tl.uint16))).to(tl.int32)
    if S:
        qh = tl.load(hp.to(tl.pointer_type(tl.uint16))).to(tl.int32)
        w0, w1, w2, w3 = tl.load(qs_p), tl.load(qs_p + 1), tl.load(qs_p + 8), tl.load(qs_p + 9)
    else:
        qh = sc  # (unread)
        w0, w1, w2, w3 = split4(tl.load(qs_p))
    return d, w0, w1, w2, w3, qh, sc


@triton.jit
def iq2_pairs_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs, scales / d, qs, qh, scales
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
    S: tl.constexpr = 0, tab_ptr=None,  # S: IQ2_S (else IQ2_XS); lattice.grid_words of the type
):
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    g = tl.arange(0, G)
    sb = first + g // 4
    q = g % 4
    dp = base + o0 + r64[:, None] * r0 + sb[None, :] * b0
    if S:  # qs bytes 8q .. (words 2q, 2q + 1), sign bytes 32 + 8q .. (words 8 + 2q, ..); qh bytes 2q, 2q + 1
        qs_p = (base + o1 + r64[:, None] * r1 + (sb * 64 + 8 * q)[None, :]).to(tl.pointer_type(tl.int32))
        hp = base + o2 + r64[:, None] * r2 + (sb * b2 + 2 * q)[None, :]
        cp = base + o3 + r64[:, None] * r3 + (sb * b3 + 2 * q)[None, :]
    else:  # u16 entries 8q .. 8q + 7: one 16-byte run; scale bytes 2q, 2q + 1
        qs_p = word_ptrs(base, o1, r1, r64) + (sb * 16 + q * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
        hp = dp
        cp = base + o2 + r64[:, None] * r2 + (sb * b2 + 2 * q)[None, :]
    xw = (sb * 64 + q * 16)[:, None] + tl.arange(0, 4)[None, :]  # + 8h: sub-block 2q + h's 8 words
    xb = sb * 8 + q * 2  # + h: its q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _iq2_pairs_tile(qs_p, dp, hp, cp, S)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _iq2_pairs_tile(qs_p, dp, hp, cp, S)
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _iq2_pairs_dots(tile, acc, tab_ptr, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, G, DOT, S)
        qs_p += advance(more, NB * 16, CARRY)
        dp += advance(more, NB * b0, CARRY)
        if S:
            hp += advance(more, NB * b2, CARRY)
            cp += advance(more, NB * b3, CARRY)
        else:
            cp += advance(more, NB * b2, CARRY)
        if CARRY:
            tile = _iq2_pairs_tile(qs_p, dp, hp, cp, S)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)
