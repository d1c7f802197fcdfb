"""The int8 decode mat-vec's kernel of the 1.5-bit lattice types IQ1_S and IQ1_M (matvec_int8.py launches it:
the same contract, x in q8_1, W repacked, four products a dot4). Each group of 8 weights is a point of a grid
of -1, 0, 1 (IQ1_S's table for both, lattice.grid_words: 2048 points, 16 KB), shifted by +-1/8 and scaled. A
program's groups are 64 elements of a super-block (quarter q: sub-blocks 2q and 2q + 1), q8_1 block
8 sb + 2q + h of sub-block h; w = scale * (g + shift), so each sub-block adds scale * (dx sum(g xq) + shift
sum(x)).

  IQ1_S  per 32-element sub-block (qh u16 h): points qs byte | three bits of h (3l ..) << 8, scale
         d (2 ((h >> 12) & 7) + 1), one shift (-1/8 where bit 15 is set): its sum(x) is the q8_1 block's sx.
  IQ1_M  per 16 weights (two points) a 3-bit scale s (bits 3i of the u16 scales[i / 4]), scale d (2s + 1), d
         the f16 whose four nibbles are the scales' top nibbles; per point a qh nibble n: its three high
         bits (n & 7) and its shift (-1/8 where n & 8), whose sum over the point's 8 x is a dot4 against
         ones (two a point).
Torch reference: matvec_int8.reference_matvec_q8_1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.flat_words import expert_program, program_rows, store_rows, x_words, zero_rows
from vegaserve.triton_kernels.int8_ops import advance, dot4


@triton.jit
def _iq1_tile(dp, qs_p, qh_p, sc_p, M1: tl.constexpr):
    """Loads of one IQ1 tile: d (IQ1_M: made from its scale words), the group's two qs words and its qh
    word, and IQ1_M's two scale words."""
    qs0, qs1, qh = tl.load(qs_p), tl.load(qs_p + 1), tl.load(qh_p)
    if M1:  # scales u16 0, 1 in word w0, u16 2, 3 in w1; d's nibbles their top ones, u16 0's lowest
        w0, w1 = tl.load(sc_p), tl.load(sc_p + 1)
        bits = ((w0 >> 12) & 0xF) | ((w0 >> 24) & 0xF0) | ((w1 >> 4) & 0xF00) | ((w1 >> 16) & 0xF000)
        d = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
        w0 = qh  # (unread)
        w1 = qh
    return d, qs0, qs1, qh, w0, w1


@triton.jit
def _iq1_dots(tile, acc, tab, xq_ptr, dx_ptr, sx_ptr, xw, xb, q, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
              G: tl.constexpr, DOT: tl.constexpr, M1: tl.constexpr):
    """Group (sb, q): sub-blocks 2q + h, points 8q + 4h + p (p < 4; byte p of qs word h), weights 64q + 32h
    + 8p ..; IQ1_S's qh u16 2q + h (half h of the qh word), IQ1_M's qh nibble 4h + p of its qh word and
    scale field 4q + 2h + p // 2 (bits 3 (2h + p // 2) of u16 q: half q % 2 of scale word q // 2)."""
    d, qs0, qs1, qh, w0, w1 = tile
    qs = (qs0, qs1)
    ones = tl.full([BLOCK_N, G], 0x01010101, tl.int32)
    new = acc
    for h in tl.static_range(2):
        if M1:
            u16 = (tl.where((q // 2 == 0)[None, :], w0, w1) >> (16 * (q % 2))[None, :]) & 0xFFFF
        else:
            hh = (qh >> (16 * h)) & 0xFFFF
            scale = d * (2 * ((hh >> 12) & 7) + 1).to(tl.float32)
            shift = tl.where((hh & 0x8000) != 0, -0.125, 0.125)
        vals = ()
        for p in tl.static_range(4):
            if M1:
                nib = (qh >> (4 * (4 * h + p))) & 15
                point = ((qs[h] >> (8 * p)) & 255) | ((nib & 7) << 8)
            else:
                point = ((qs[h] >> (8 * p)) & 255) | (((hh >> (3 * p)) & 7) << 8)
            vals = vals + (tl.load(tab + 2 * point), tl.load(tab + 2 * point + 1))
        acc_h = ()
        for m in tl.static_range(M):
            xrow = xq_ptr + m * (K // 4)
            xv = x_words(xrow, xw, 8 * h) + x_words(xrow, xw, 8 * h + 4)
            dx = tl.load(dx_ptr + m * (K // 32) + xb + h)[None, :]
            if M1:
                total = tl.zeros([BLOCK_N, G], dtype=tl.float32)
                for p in tl.static_range(4):
                    s = tl.zeros([BLOCK_N, G], dtype=tl.int32)
                    sx = tl.zeros([BLOCK_N, G], dtype=tl.int32)
                    for i in tl.static_range(2 * p, 2 * p + 2):
                        s = dot4(vals[i], xv[i], s, DOT)
                        sx = dot4(ones, xv[i], sx, DOT)
                    nib = (qh >> (4 * (4 * h + p))) & 15
                    shift = tl.where((nib & 8) != 0, -0.125, 0.125)
                    scale = d * (2 * ((u16 >> (3 * (2 * h + p // 2))) & 7) + 1).to(tl.float32)
                    total += scale * (s.to(tl.float32) + shift * sx.to(tl.float32))
                acc_h = acc_h + (new[m] + dx * total,)
            else:
                s = tl.zeros([BLOCK_N, G], dtype=tl.int32)
                for i in tl.static_range(8):
                    s = dot4(vals[i], xv[i], s, DOT)
                sx = tl.load(sx_ptr + m * (K // 32) + xb + h)[None, :]
                acc_h = acc_h + (new[m] + scale * (dx * s.to(tl.float32) + shift * sx),)
        new = acc_h
    return new


@triton.jit
def iq1_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs, qh / qs, qh, scales
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
    M1: tl.constexpr = 0, tab_ptr=None,  # M1: IQ1_M (else IQ1_S); lattice.grid_words("IQ1_S")
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
    if M1:  # qs bytes 8q .. (2 words), qh bytes 4q .. (1 word), the 8 scale bytes (2 words)
        qs_p = (base + o0 + r64[:, None] * r0 + (sb * b0 + 8 * q)[None, :]).to(tl.pointer_type(tl.int32))
        qh_p = (base + o1 + r64[:, None] * r1 + (sb * b1 + 4 * q)[None, :]).to(tl.pointer_type(tl.int32))
        sc_p = (base + o2 + r64[:, None] * r2 + (sb * b2)[None, :]).to(tl.pointer_type(tl.int32))
        dp = base
        step_q, step_h, step_s = b0, b1, b2
    else:  # d; qs bytes 8q .. (2 words); qh u16 entries 2q, 2q + 1 (1 word)
        dp = base + o0 + r64[:, None] * r0 + sb[None, :] * b0
        qs_p = (base + o1 + r64[:, None] * r1 + (sb * b1 + 8 * q)[None, :]).to(tl.pointer_type(tl.int32))
        qh_p = (base + o2 + r64[:, None] * r2 + (sb * b2 + 4 * q)[None, :]).to(tl.pointer_type(tl.int32))
        sc_p = qh_p
        step_q, step_h, step_s = b1, b2, 0
    xw = (sb * 64 + q * 16)[:, None] + tl.arange(0, 4)[None, :]  # + 8h: sub-block 2q + h's 8 words
    xb = sb * 8 + q * 2  # + h: its q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _iq1_tile(dp, qs_p, qh_p, sc_p, M1)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _iq1_tile(dp, qs_p, qh_p, sc_p, M1)
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _iq1_dots(tile, acc, tab_ptr, xq_ptr, dx_ptr, sx_ptr, xw, xb, q, K, M, BLOCK_N, G, DOT, M1)
        qs_p += advance(more, NB * step_q // 4, CARRY)
        qh_p += advance(more, NB * step_h // 4, CARRY)
        if M1:
            sc_p += advance(more, NB * step_s // 4, CARRY)
        else:
            dp += advance(more, NB * b0, CARRY)
        if CARRY:
            tile = _iq1_tile(dp, qs_p, qh_p, sc_p, M1)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)
