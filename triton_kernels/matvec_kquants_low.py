"""The int8 decode mat-vec's kernels of the low K-quants, Q3_K and Q2_K (matvec_int8.py launches them: the
same contract, x in q8_1, W repacked, four products a dot4). Their groups are Q6_K's: 64 elements of a
super-block (half n, sub-block pair sub), 16 quant bytes a thread's load, a code j = 0..3 at bits 2j of each
byte for 16 elements of one q8_1 block.

  Q3_K  per 16-element sub-block i: d * (sc[i] - 32) * dx * sum((q - 4) * xq); the three-bit code from its
        qs pair and hmask bit, made the signed byte q - 4 in place with an add and an XOR per word (code +
        124 never carries out of its byte; flipping bit 7 subtracts 128), as Q6_K's q - 32.
  Q2_K  per 16-element sub-block i: d * sc[i] * dx * sum(q * xq) - dmin * m[i] * dx * sum(xq), the two-bit
        codes as Q3_K's low bits, the sums of xq over 16 a dot4 against ones (q8_1's sums cover 32).
Torch reference: matvec_int8.reference_matvec_q8_1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.flat_words import (
    expert_program,
    program_rows,
    q2_k_groups,
    q3_k_groups,
    split4,
    store_rows,
    x_words,
    zero_rows,
)
from vegaserve.triton_kernels.int8_ops import advance, dot4


@triton.jit
def _q3_k_tile(hm_p, qs_p, sp, dp):
    """Loads of one Q3_K tile: d, the super-block's three scale words, the group's hmask and qs runs."""
    d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
    return d, tl.load(sp), tl.load(sp + 1), tl.load(sp + 2), tl.load(hm_p), tl.load(qs_p)


@triton.jit
def _q3_k_scale(a, b, c, n, sub, j: tl.constexpr):
    """The signed scale sc - 32 of sub-block 8n + 2j + sub, int32 [BLOCK_N, G]: its low four bits in nibble
    n of scale byte 2j + sub (words a, b: bytes 0-7), its high two at bit 4n + 2 (j // 2) of byte
    (2j + sub) % 4 of word c (bytes 8-11)."""
    byte = (8 * (2 * (j % 2) + sub))[None, :]
    low = ((a if j < 2 else b) >> (byte + 4 * n[None, :])) & 15
    high = (c >> (byte + 4 * n[None, :] + 2 * (j // 2))) & 3
    return (low | (high << 4)) - 32


@triton.jit
def _q3_k_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, n, sub, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
               G: tl.constexpr, DOT: tl.constexpr):
    """Group (sb, n, sub), code j = 0..3: elements 128n + 32j + 16 sub + l (l < 16), two bits at 2j of qs
    byte 32n + 16 sub + l, the third at bit 4n + j of hmask byte 16 sub + l; q8_1 block 8 sb + 4n + j."""
    d, a, b, c, hm_w, qs_w = tile
    hm = split4(hm_w)
    qs = split4(qs_w)
    new = acc
    for j in tl.static_range(4):
        codes = ()
        for i in tl.static_range(4):
            code = ((qs[i] >> (2 * j)) & 0x03030303) | (((hm[i] >> (4 * n[None, :] + j)) & 0x01010101) << 2)
            codes = codes + ((code + 0x7C7C7C7C) ^ -0x7F7F7F80,)  # code - 4, signed bytes
        scale = d * _q3_k_scale(a, b, c, n, sub, j).to(tl.float32)
        acc_j = ()
        for m in tl.static_range(M):
            xv = x_words(xq_ptr + m * (K // 4), xw, 8 * j)
            s = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            for i in tl.static_range(4):
                s = dot4(codes[i], xv[i], s, DOT)
            dx = tl.load(dx_ptr + m * (K // 32) + xb + j)[None, :]
            acc_j = acc_j + (new[m] + scale * dx * s.to(tl.float32),)
        new = acc_j
    return new


@triton.jit
def q3_k_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): hmask, qs, scales, d
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
):
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    hm_p, qs_p, sp, dp, sb, n, sub = q3_k_groups(base, o0, r0, o1, r1, o2, r2, b2, o3, r3, b3, r64, first, NB)
    xw = (sb * 64 + n * 32 + sub * 4)[:, None] + tl.arange(0, 4)[None, :]  # + 8j: code j's 16 elements
    xb = sb * 8 + n * 4  # + j: their q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _q3_k_tile(hm_p, qs_p, sp, dp)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q3_k_tile(hm_p, qs_p, sp, dp)
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _q3_k_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, n, sub, K, M, BLOCK_N, G, DOT)
        hm_p += advance(more, NB * 8, CARRY)
        qs_p += advance(more, NB * 16, CARRY)
        sp += advance(more, NB * b2 // 4, CARRY)
        dp += advance(more, NB * b3, CARRY)
        if CARRY:
            tile = _q3_k_tile(hm_p, qs_p, sp, dp)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _q2_k_tile(qs_p, sp, dm):
    """Loads of one Q2_K tile: d, dmin, the group's two scale words and its qs run."""
    d = tl.load(dm.to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((dm + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    return d, dmin, tl.load(sp), tl.load(sp + 1), tl.load(qs_p)


@triton.jit
def _q2_k_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, sub, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
               G: tl.constexpr, DOT: tl.constexpr):
    """Group (sb, n, sub), code j = 0..3: elements 128n + 32j + 16 sub + l (l < 16), two bits at 2j of qs
    byte 32n + 16 sub + l; scale byte 8n + 2j + sub (scale low nibble, min high); q8_1 block 8 sb + 4n + j."""
    d, dmin, s0, s1, qs_w = tile
    qs = split4(qs_w)
    ones = tl.full([BLOCK_N, G], 0x01010101, tl.int32)
    new = acc
    for j in tl.static_range(4):
        byte = ((s0 if j < 2 else s1) >> (8 * (2 * (j % 2) + sub))[None, :]) & 255
        scale = d * (byte & 15).to(tl.float32)
        least = dmin * (byte >> 4).to(tl.float32)
        codes = ()
        for i in tl.static_range(4):
            codes = codes + ((qs[i] >> (2 * j)) & 0x03030303,)
        acc_j = ()
        for m in tl.static_range(M):
            xv = x_words(xq_ptr + m * (K // 4), xw, 8 * j)
            s = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            sx = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            for i in tl.static_range(4):
                s = dot4(codes[i], xv[i], s, DOT)
                sx = dot4(ones, xv[i], sx, DOT)
            dx = tl.load(dx_ptr + m * (K // 32) + xb + j)[None, :]
            acc_j = acc_j + (new[m] + dx * (scale * s.to(tl.float32) - least * sx.to(tl.float32)),)
        new = acc_j
    return new


@triton.jit
def q2_k_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): scales, qs, dm
    N, K, blocks_per_split,  # super-blocks of 256
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
):
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs_p, sp, dm, sb, n, sub = q2_k_groups(base, o0, r0, b0, o1, r1, o2, r2, b2, r64, first, NB)
    xw = (sb * 64 + n * 32 + sub * 4)[:, None] + tl.arange(0, 4)[None, :]  # + 8j: code j's 16 elements
    xb = sb * 8 + n * 4  # + j: their q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _q2_k_tile(qs_p, sp, dm)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q2_k_tile(qs_p, sp, dm)
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _q2_k_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, sub, K, M, BLOCK_N, G, DOT)
        qs_p += advance(more, NB * 16, CARRY)
        sp += advance(more, NB * b0 // 4, CARRY)
        dm += advance(more, NB * b2, CARRY)
        if CARRY:
            tile = _q2_k_tile(qs_p, sp, dm)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)
