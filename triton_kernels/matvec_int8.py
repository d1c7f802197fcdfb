"""The `int8` decode mat-vec: y[M, N] = x[M, K] @ W[N, K]^T for M <= 8, x quantized to q8_1 (int8 per
element, a scale and a scaled sum per 32: q8_1.py), W repacked (layout.py), four products an instruction:
`dot4` is dp4a on NVIDIA, v_dot4_i32_i8 on AMD (gfx906 has it and no matrix units; not yet run on one),
and integer arithmetic under the interpreter. The product is llama.cpp's MMVQ kernels': the activation's
quantization included.

A program owns BLOCK_N rows and one K split (matvec_launch.py); quant words are loaded 16 bytes a thread
(flat_words.py's groups), and a 4-bit word becomes two dot4 operands with one mask each (low nibbles,
high nibbles), so a block of 32 costs 8 dot4, 8 masks and a few float operations per activation row.
The 32-element types load each row's words of a tile as one contiguous run (FLAT), so a warp reads along
the rows; the K-quants' groups kernels load per group (their one-row kernels are matvec_pieces.py's).

Per type (the activation's q8_1 block b has scale dx[b] and sx[b] = dx[b] * sum(xq) over the block):
  Q8_0  (d * dx) * sum(q * xq).
  Q4_0  d * (dx * sum(q * xq) - 8 sx), q the unsigned nibble.
  IQ4_NL, MXFP4  d * dx * sum(v[q] * xq), v the type's 16 int8 levels (MXFP4: e2m1 doubled, d = 2^(e - 128));
        a word of 8 nibbles becomes two words of levels with byte permutes from the 16-byte table
        (int8_ops.lookup16).
  IQ4_XS  IQ4_NL's sum over each 32-element sub-block (the same 16 quant bytes a sub-block), its scale
        d (ls - 32) from the super-block's 8-byte head record (d, then the six scale bits of each of its
        8 sub-blocks: 2 in the u16 scales_h, 4 in a nibble of scales_l); the launch counts blocks of 32.
  Q4_K  per 32-element sub-block s: d * sc[s] * dx[s] * sum(q * xq) - dmin * m[s] * sx[s].
  Q6_K  per 16-element sub-block i: d * sc[i] * dx * sum((q - 32) * xq); the six-bit code is made from
        its ql nibble and qh pair in place and turned into the signed byte q - 32 with an add and an
        XOR per word (code + 96 never carries out of its byte; flipping bit 7 subtracts 128).
  Q3_K, Q2_K  matvec_kquants_low.py.
  IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S  matvec_iq.py; IQ1_S, IQ1_M  matvec_iq1.py.
Torch reference: `reference_matvec_q8_1` (the activation dequantized from its q8_1 form, then
matmul.reference_matmul in float64).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.flat_words import (
    block_planes,
    expert_program,
    program_rows,
    q4_k_groups,
    q4_k_scale_decode,
    q4_k_scale_words,
    q6_k_groups,
    q6_k_scales,
    split4,
    store_rows,
    x_words,
    zero_rows,
)
from vegaserve.triton_kernels.int8_ops import (
    AMDGCN_DOT4,
    EMULATE,
    PTX_DP4A,
    advance,
    dot4,
    lookup16,
    low_high_sums,
    minus_32,
)
from vegaserve.triton_kernels.layout import PackedWeight
from vegaserve.triton_kernels.matmul import reference_matmul
from vegaserve.triton_kernels.matvec_iq import LATTICE, iq2_pairs_kernel, iq2_xxs_kernel, iq3_kernel
from vegaserve.triton_kernels.matvec_iq1 import iq1_kernel
from vegaserve.triton_kernels.matvec_kquants_low import q2_k_kernel, q3_k_kernel
from vegaserve.triton_kernels.matvec_launch import candidates as launch_candidates
from vegaserve.triton_kernels.matvec_launch import RAGGED, Experts, plan, unique
from vegaserve.triton_kernels.q8_1 import Q8_1, quantize_q8_1
from vegaserve.triton_kernels.quants.lattice import grid_words
from vegaserve.triton_kernels.tiles_mxfp4 import half_scale


def reference_matvec_q8_1(q: torch.Tensor, d: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The product the kernels compute: the q8_1 activation dequantized, times dequant(W)^T in float64."""
    x = (q.double().view(q.shape[0], -1, 32) * d.double()[..., None]).view(q.shape)
    return reference_matmul(x, w)


@triton.jit
def _iq4_xs_scales(rec, NB: tl.constexpr):
    """IQ4_XS: the scales d (ls - 32) [BLOCK_N, NB] of a tile's NB sub-blocks (whole super-blocks), rec [BLOCK_N,
    NB] byte pointers to each one's super-block record: d (f16), scales_h (u16: sub-block i's high 2 bits
    at bit 2i), scales_l (4 bytes: sub-block i's low 4 bits in nibble i % 2 of byte i // 2)."""
    ib = (tl.arange(0, NB) % 8)[None, :]
    d = tl.load(rec.to(tl.pointer_type(tl.float16))).to(tl.float32)
    high = tl.load((rec + 2).to(tl.pointer_type(tl.uint16))).to(tl.int32)
    low = tl.load(rec + 4 + ib // 2).to(tl.int32)
    ls = ((low >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)
    return d * (ls - 32).to(tl.float32)


@triton.jit
def _legacy_tile(qs, dp, HALVES: tl.constexpr, E8M0: tl.constexpr, FLAT: tl.constexpr, XS: tl.constexpr = 0):
    """Loads of one tile of a 32-element type: the scales (f16, or E8M0 bytes as MXFP4's halved scale, or
    IQ4_XS's from its super-blocks' records) and HALVES 16-byte runs of each block."""
    if XS:
        d = _iq4_xs_scales(dp, dp.shape[1])
    elif E8M0:
        d = half_scale(tl.load(dp).to(tl.int32))
    else:
        d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
    if FLAT:  # qs [BLOCK_N, NB * 4 * HALVES] (block_planes' FLAT), each row's run along the lanes
        raw = tl.load(qs)
        if HALVES == 2:
            h0, h1 = tl.split(tl.permute(tl.reshape(raw, [raw.shape[0], raw.shape[1] // 8, 2, 4]), (0, 1, 3, 2)))
        else:
            h0 = tl.reshape(raw, [raw.shape[0], raw.shape[1] // 4, 4])
            h1 = h0
    elif HALVES == 2:
        h0, h1 = tl.load(qs), tl.load(qs + 4)
    else:
        h0 = tl.load(qs)
        h1 = h0
    return d, h0, h1


@triton.jit
def _q8_0_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
               DOT: tl.constexpr):
    d, h0, h1 = tile
    words = split4(h0) + split4(h1)  # word i: elements 4i .. 4i + 3 of the block
    new = ()
    for m in tl.static_range(M):
        xrow = xq_ptr + m * (K // 4)
        xv = x_words(xrow, xw, 0) + x_words(xrow, xw, 4)
        s = tl.zeros([BLOCK_N, NB], dtype=tl.int32)
        for i in tl.static_range(8):
            s = dot4(words[i], xv[i], s, DOT)
        dx = tl.load(dx_ptr + m * (K // 32) + xb)[None, :]
        new = new + (acc[m] + s.to(tl.float32) * (d * dx),)
    return new


@triton.jit
def _nibble_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
                 NB: tl.constexpr, TABLE: tl.constexpr, DOT: tl.constexpr):
    """Q4_0 (TABLE 0: the unsigned nibble, 8 taken off through the activation sums), IQ4_NL and MXFP4 (the
    nibble's level from TABLE)."""
    d, q, _ = tile
    words = split4(q)  # byte t of word i: element 4i + t (low nibble), 4i + t + 16 (high)
    lo = ()
    hi = ()
    for i in tl.static_range(4):
        if TABLE == 0:
            v_lo, v_hi = words[i] & 0x0F0F0F0F, (words[i] >> 4) & 0x0F0F0F0F
        else:
            v_lo, v_hi = lookup16(words[i], TABLE, DOT)
        lo = lo + (v_lo,)
        hi = hi + (v_hi,)
    new = ()
    for m in tl.static_range(M):
        xrow = xq_ptr + m * (K // 4)
        xl = x_words(xrow, xw, 0)
        xh = x_words(xrow, xw, 4)
        s = tl.zeros([BLOCK_N, NB], dtype=tl.int32)
        for i in tl.static_range(4):
            s = dot4(lo[i], xl[i], s, DOT)
            s = dot4(hi[i], xh[i], s, DOT)
        dx = tl.load(dx_ptr + m * (K // 32) + xb)[None, :]
        if TABLE == 0:
            sx = tl.load(sx_ptr + m * (K // 32) + xb)[None, :]
            new = new + (acc[m] + d * (s.to(tl.float32) * dx - 8.0 * sx),)
        else:
            new = new + (acc[m] + s.to(tl.float32) * (d * dx),)
    return new


@triton.jit
def _legacy_kernel(
    xq_ptr, dx_ptr, sx_ptr, base,  # q8_1 activations (int32 words, scales, sums), weights
    part_ptr, out_ptr, count_ptr,  # store_rows': partials, y, arrival counts
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs (IQ4_XS: d, scales, qs)
    N, K, blocks_per_split,
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, WORDS: tl.constexpr, TABLE: tl.constexpr, E8M0: tl.constexpr, PDL: tl.constexpr,
    FLAT: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1, XS: tl.constexpr = 0,
    TAIL: tl.constexpr = 0,
):
    """Blocks of 32 with one scale and WORDS quant words: Q8_0 (WORDS 8), Q4_0 (4), IQ4_NL and MXFP4 (4, their
    levels' TABLE 1 and 2; MXFP4's scale an E8M0 byte), IQ4_XS (XS: IQ4_NL's blocks, each scale from its
    super-block's record; NB and the split whole super-blocks). TAIL: NB does not divide the row's blocks
    (matvec_launch.RAGGED); the last split's whole tiles are followed by one partial tile, its missing
    blocks' quant words loaded as 0 and their scales set to 0 (x read at the row's last block instead)."""
    pdl.let_next_start(PDL)
    if EXPERTS:  # the expert ids come from the router, which the wait covers
        pdl.wait_for_inputs(PDL)
        base, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr = expert_program(
            ids_ptr, base, expert_bytes, xq_ptr, dx_ptr, sx_ptr, part_ptr, out_ptr, count_ptr, N, K, XDIV, SPLIT,
            BLOCK_N)
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 32, BLOCK_N, NB)
    if XS:  # each block's pointer at its super-block's record, which the tile's 8 blocks of it share
        qs, dp = block_planes(base, o0, r0, b0, o2, r2, r64, first, NB, WORDS, FLAT)
        dp = base + o0 + r64[:, None] * r0 + ((first + tl.arange(0, NB)) // 8)[None, :] * b0
    else:
        qs, dp = block_planes(base, o0, r0, b0, o1, r1, r64, first, NB, WORDS, FLAT)
    xb = first + tl.arange(0, NB)
    xw = (xb * 8)[:, None] + tl.arange(0, 4)[None, :]
    acc = zero_rows(M, BLOCK_N, NB)
    if CARRY:
        tile = _legacy_tile(qs, dp, WORDS // 4, E8M0, FLAT, XS)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _legacy_tile(qs, dp, WORDS // 4, E8M0, FLAT, XS)
        pdl.wait_for_inputs(PDL)  # the first tile's loads are in flight (a no-op after the first)
        more = it + 1 < n_iter
        qs += advance(more, NB * WORDS, CARRY)
        dp += advance(more, (NB // 8 if XS else NB) * b0, CARRY)
        if WORDS == 8:
            acc = _q8_0_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, NB, DOT)
        else:
            acc = _nibble_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M, BLOCK_N, NB, TABLE, DOT)
        if CARRY:
            # the next tile's loads (ptxas issues them mid-loop)
            tile = _legacy_tile(qs, dp, WORDS // 4, E8M0, FLAT, XS)
        xw += NB * 8
        xb += NB
    if TAIL:
        tb = first + n_iter * NB
        left = tl.minimum(first + blocks_per_split, K // 32) - tb  # > 0 in the last split only
        if left > 0:
            acc = _legacy_tail(acc, base, o0, r0, b0, o1, r1, r64, tb, left, xq_ptr, dx_ptr, sx_ptr, K, M, BLOCK_N,
                               NB, WORDS, TABLE, E8M0, FLAT, DOT)
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _legacy_tail(acc, base, o0, r0, b0, o1, r1, r64, tb, left, xq_ptr, dx_ptr, sx_ptr, K, M: tl.constexpr,
                 BLOCK_N: tl.constexpr, NB: tl.constexpr, WORDS: tl.constexpr, TABLE: tl.constexpr,
                 E8M0: tl.constexpr, FLAT: tl.constexpr, DOT: tl.constexpr):
    """The partial tile of `left` < NB blocks from block tb: loads masked to the row's blocks, the scales of
    the missing blocks 0, their activations read at the row's last block (any finite value: the scale
    zeroes the product)."""
    qs, dp = block_planes(base, o0, r0, b0, o1, r1, r64, tb, NB, WORDS, FLAT)
    live = tl.arange(0, NB) < left
    if FLAT:
        words = tl.load(qs, mask=(tl.arange(0, NB * WORDS) // WORDS < left)[None, :], other=0)
        if WORDS == 8:
            h0, h1 = tl.split(tl.permute(tl.reshape(words, [BLOCK_N, NB, 2, 4]), (0, 1, 3, 2)))
        else:
            h0 = tl.reshape(words, [BLOCK_N, NB, 4])
            h1 = h0
    else:
        h0 = tl.load(qs, mask=live[None, :, None], other=0)
        if WORDS == 8:
            h1 = tl.load(qs + 4, mask=live[None, :, None], other=0)
        else:
            h1 = h0
    if E8M0:
        d = half_scale(tl.load(dp, mask=live[None, :], other=0).to(tl.int32))
    else:
        d = tl.load(dp.to(tl.pointer_type(tl.float16)), mask=live[None, :], other=0).to(tl.float32)
    d = tl.where(live[None, :], d, 0.0)
    xb = tl.minimum(tb + tl.arange(0, NB), K // 32 - 1)
    xw = (xb * 8)[:, None] + tl.arange(0, 4)[None, :]
    if WORDS == 8:
        acc = _q8_0_dots((d, h0, h1), acc, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, NB, DOT)
    else:
        acc = _nibble_dots((d, h0, h1), acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M, BLOCK_N, NB, TABLE, DOT)
    return acc


@triton.jit
def _q4_k_tile(qs, dm, sp):
    """Loads of one Q4_K tile: d, dmin, the scale words, and the four 16-byte runs of each group."""
    d = tl.load(dm.to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((dm + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    a, b, c = q4_k_scale_words(sp)
    return d, dmin, a, b, c, tl.load(qs), tl.load(qs + 4), tl.load(qs + 16), tl.load(qs + 20)


@triton.jit
def _q4_k_acts(xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M: tl.constexpr):
    """Loads of the activations one Q4_K tile multiplies, per row m of x: the [1, G, 4] int32 runs of
    sub-blocks 2j, 2j + 1 (chunk j) and 2j + 4, 2j + 5 (chunk j + 2), their q8_1 scales and sums [1, G]."""
    out = ()
    for m in tl.static_range(M):
        xrow = xq_ptr + m * (K // 4)
        runs = ()
        for r in tl.static_range(8):  # chunk cc = r // 4: words 32 cc + 4 (r % 4)
            runs = runs + (tl.load(xrow + xw + 32 * (r // 4) + 4 * (r % 4))[None, :, :],)
        xs = dx_ptr + m * (K // 32) + xb
        ss = sx_ptr + m * (K // 32) + xb
        dx = (tl.load(xs), tl.load(xs + 1), tl.load(xs + 4), tl.load(xs + 5))
        sx = (tl.load(ss), tl.load(ss + 1), tl.load(ss + 4), tl.load(ss + 5))
        out = out + ((runs, dx, sx),)
    return out


@triton.jit
def _q4_k_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
               G: tl.constexpr, DOT: tl.constexpr):
    """The tile's products, the activations loaded per chunk and row of x (all of them at once would take
    40 registers per row of x)."""
    d, dmin, a, b, c, q0, q1, q2, q3 = tile
    sc_a, sc_b, mn_a, mn_b = q4_k_scale_decode(a, b, c)
    scales = (sc_a, sc_b)
    mins = (mn_a, mn_b)
    runs = ((q0, q1), (q2, q3))
    new = acc
    for cc in tl.static_range(2):  # chunk j, then chunk j + 2
        words = split4(runs[cc][0]) + split4(runs[cc][1])
        lo = ()
        hi = ()
        for i in tl.static_range(8):
            lo = lo + (words[i] & 0x0F0F0F0F,)
            hi = hi + ((words[i] >> 4) & 0x0F0F0F0F,)
        sc_lo = d * (scales[cc] & 63).to(tl.float32)
        sc_hi = d * ((scales[cc] >> 8) & 63).to(tl.float32)
        mn_lo = dmin * (mins[cc] & 63).to(tl.float32)
        mn_hi = dmin * ((mins[cc] >> 8) & 63).to(tl.float32)
        acc_c = ()
        for m in tl.static_range(M):
            xr, dx, sx = _q4_k_acts(xq_ptr + m * (K // 4), dx_ptr + m * (K // 32), sx_ptr + m * (K // 32),
                                    xw, xb, K, 1)[0]
            xl = split4(xr[4 * cc]) + split4(xr[4 * cc + 1])
            xh = split4(xr[4 * cc + 2]) + split4(xr[4 * cc + 3])
            s_lo = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            s_hi = tl.zeros([BLOCK_N, G], dtype=tl.int32)
            for i in tl.static_range(8):
                s_lo = dot4(lo[i], xl[i], s_lo, DOT)
                s_hi = dot4(hi[i], xh[i], s_hi, DOT)
            acc_c = acc_c + (new[m] + sc_lo * dx[2 * cc] * s_lo.to(tl.float32)
                             + sc_hi * dx[2 * cc + 1] * s_hi.to(tl.float32)
                             - mn_lo * sx[2 * cc] - mn_hi * sx[2 * cc + 1],)
        new = acc_c
    return new


@triton.jit
def _q4_k_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): dm, scales, qs
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
    # group (super-block, j) holds chunks j and j + 2 (sub-blocks 2j, 2j + 1 and 2j + 4, 2j + 5); byte l
    # of chunk c: low nibble element 64c + l, high nibble 64c + 32 + l
    G: tl.constexpr = 2 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs, dm, sp, sb, j = q4_k_groups(base, o0, r0, b0, o1, r1, b1, o2, r2, r64, first, NB)
    xw = (sb * 64 + j * 16)[:, None] + tl.arange(0, 4)[None, :]  # int32 word of sub-block 2j's first element
    # q8_1 block of sub-block 2j, [BLOCK_N, G] (the same for every row): loaded in the accumulators'
    # shape, a [1, G] load got a layout of its own and a conversion through shared memory per row of x
    xb = (sb * 8 + 2 * j)[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _q4_k_tile(qs, dm, sp)
        pdl.wait_for_inputs(PDL)  # the weight loads before it overlap the previous kernel's end
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q4_k_tile(qs, dm, sp)
            pdl.wait_for_inputs(PDL)  # a no-op after the first
        more = it + 1 < n_iter
        acc = _q4_k_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M, BLOCK_N, G, DOT)
        qs += advance(more, NB * 32, CARRY)
        dm += advance(more, NB * b0, CARRY)
        sp += advance(more, NB * b1, CARRY)
        xw += advance(more, NB * 64, CARRY)
        xb += advance(more, NB * 8, CARRY)
        if CARRY:
            tile = _q4_k_tile(qs, dm, sp)  # the next tile's loads (ptxas issues them mid-loop)
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _q6_k_tile(qh_p, ql_p, sp, dp, l4):
    """Loads of one Q6_K tile: d, the group's four scales (codes 0 .. 3, gm + 2 gh), its qh run and its two
    ql runs."""
    d = tl.load(dp.to(tl.pointer_type(tl.float16))).to(tl.float32)
    return d, q6_k_scales(sp, l4), tl.load(qh_p), tl.load(ql_p), tl.load(ql_p + 8)


@triton.jit
def _q6_k_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
               DOT: tl.constexpr):
    d, scales, qh_w, ql0, ql1 = tile
    qh = split4(qh_w)
    qls = (ql0, ql1)
    new = acc
    for gm in tl.static_range(2):
        ql = split4(qls[gm])
        lo = ()
        hi = ()
        for i in tl.static_range(4):
            lo = lo + (minus_32((ql[i] & 0x0F0F0F0F) | ((qh[i] << (4 - 2 * gm)) & 0x30303030)),)
            hi = hi + (minus_32(((ql[i] >> 4) & 0x0F0F0F0F) | ((qh[i] >> (2 * gm)) & 0x30303030)),)
        sc_lo = d * scales[gm].to(tl.float32)  # code gm
        sc_hi = d * scales[gm + 2].to(tl.float32)  # code gm + 2
        acc_g = ()
        for m in tl.static_range(M):
            xrow = xq_ptr + m * (K // 4)
            xl = x_words(xrow, xw, 8 * gm)
            xh = x_words(xrow, xw, 8 * gm + 16)
            s_lo, s_hi = low_high_sums(lo, hi, xl, xh, BLOCK_N, G, DOT)
            xs = dx_ptr + m * (K // 32) + xb + gm
            dx_lo, dx_hi = tl.load(xs)[None, :], tl.load(xs + 2)[None, :]
            acc_g = acc_g + (new[m] + sc_lo * dx_lo * s_lo + sc_hi * dx_hi * s_hi,)
        new = acc_g
    return new


@triton.jit
def _q6_k_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): ql, qh, scales, d
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
    # group (super-block, half h, l4) holds qh bytes l = 16 l4 .. 16 l4 + 15 of half h
    # and the ql runs gm = 0, 1 that use them; element 128h + 32j + l has code j = gm + 2 gh (gh: low or
    # high nibble), its two high bits at bit 2j of qh byte l, its scale 8h + l4 + 2j
    G: tl.constexpr = 4 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qh_p, ql_p, sp, dp, sb, h, l4 = q6_k_groups(base, o0, r0, o1, r1, o2, r2, b2, o3, r3, b3, r64, first, NB)
    xw = (sb * 64 + h * 32 + l4 * 4)[:, None] + tl.arange(0, 4)[None, :]  # + 8j: the words of code j's 16 elements
    xb = sb * 8 + h * 4  # + j: their q8_1 block
    acc = zero_rows(M, BLOCK_N, G)
    if CARRY:
        tile = _q6_k_tile(qh_p, ql_p, sp, dp, l4)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q6_k_tile(qh_p, ql_p, sp, dp, l4)
        pdl.wait_for_inputs(PDL)  # after the first tile's loads; a no-op after the first
        more = it + 1 < n_iter
        acc = _q6_k_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, G, DOT)
        qh_p += advance(more, NB * 16, CARRY)
        ql_p += advance(more, NB * 32, CARRY)
        sp += advance(more, NB * b2, CARRY)
        dp += advance(more, NB * b3, CARRY)
        if CARRY:
            tile = _q6_k_tile(qh_p, ql_p, sp, dp, l4)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 64
        xb += NB * 8
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


# type -> (kernel, its type's constexprs)
_LEGACY = {"TABLE": 0, "E8M0": False, "XS": 0, "TAIL": 0}  # TAIL: set by the launch where its tile leaves a part
_KERNELS = {T.Q8_0: (_legacy_kernel, {**_LEGACY, "WORDS": 8}), T.Q4_0: (_legacy_kernel, {**_LEGACY, "WORDS": 4}),
            T.IQ4_NL: (_legacy_kernel, {**_LEGACY, "WORDS": 4, "TABLE": 1}),
            T.IQ4_XS: (_legacy_kernel, {**_LEGACY, "WORDS": 4, "TABLE": 1, "XS": 1}),
            T.MXFP4: (_legacy_kernel, {**_LEGACY, "WORDS": 4, "TABLE": 2, "E8M0": True}),
            T.Q4_K: (_q4_k_kernel, {}), T.Q6_K: (_q6_k_kernel, {}),
            T.Q3_K: (q3_k_kernel, {}), T.Q2_K: (q2_k_kernel, {}),
            T.IQ2_XXS: (iq2_xxs_kernel, {}),
            T.IQ2_XS: (iq2_pairs_kernel, {"S": 0}), T.IQ2_S: (iq2_pairs_kernel, {"S": 1}),
            T.IQ3_XXS: (iq3_kernel, {"S": 0}), T.IQ3_S: (iq3_kernel, {"S": 1}),
            T.IQ1_S: (iq1_kernel, {"M1": 0}), T.IQ1_M: (iq1_kernel, {"M1": 1})}
TYPES = frozenset(_KERNELS)


def candidates(type_id: int, n: int, k: int, m: int, sm_count: int) -> list[dict[str, int]]:
    """The launch configs a sweep times: the rule's tile candidates (matvec_launch), each with the tile loaded
    ahead (carry 1) and in its own iteration (carry 0)."""
    return unique([{**c, "carry": carry} for c in launch_candidates(type_id, n, k, m, sm_count) for carry in (1, 0)])


def type_args(type_id: int) -> dict[str, int]:
    """The constexprs that say a 32-element type's words, table and scale (the lanes kernel takes them too;
    IQ4_XS's scales from records, XS, and the partial last tile, TAIL, are this kernel's only)."""
    return {key: v for key, v in _KERNELS[type_id][1].items() if key not in ("XS", "TAIL")}


def dot_kind(device: torch.device) -> int:
    """Which dot4 the device runs: the integer emulation under the interpreter (or on a CPU tensor)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return EMULATE
    return AMDGCN_DOT4 if torch.version.hip else PTX_DP4A


def kernel_for(type_id: int, m: int) -> tuple[object, dict[str, int]]:
    """The kernel a launch of m activation rows takes and its type's constexprs (benchmarks/kernel_resources.py
    compiles the same choice without a GPU). The 32-element types load each row's quant words of a tile as
    one run (FLAT 1), except Q8_0 above one row, where the [rows, blocks, 4] load measured faster."""
    kernel, type_args = _KERNELS[type_id]
    if kernel is _legacy_kernel:
        return kernel, {**type_args, "FLAT": int(m == 1 or type_id != T.Q8_0)}
    return kernel, type_args


def tail_args(type_args: dict[str, int], type_id: int, k: int, per_tile: int) -> dict[str, int]:
    """kernel_for's constexprs with TAIL set where a RAGGED type's tile of per_tile blocks leaves a partial
    last tile of rows of k (benchmarks/kernel_resources.py compiles the same)."""
    if "TAIL" not in type_args:
        return type_args
    return {**type_args, "TAIL": int(type_id in RAGGED and (k // 32) % per_tile != 0)}


def _carry(params: dict[str, int], device: torch.device) -> int:
    """The carry a launch gets: the params' (default 1), except in a compiled kernel launched without PDL,
    which loads each tile in its own iteration. On an H100 with Triton 3.6, the Q4_K kernel's carried loop
    compiled without the PDL wait between the first tile's loads and the loop gave 7.5% relative error against
    the float64 reference (1e-7 with the wait, or without the carry); that covers every GPU before sm_90, every
    AMD GPU and VEGASERVE_PDL=0 until the cause is found (tests/triton_kernels/test_matvec_int8.py's GPU
    test)."""
    return params.get("carry", 1) if device.type != "cuda" or pdl.enabled(device) else 0


def matvec_int8(x: torch.Tensor, w: PackedWeight, params: dict[str, int], q8_1: Q8_1 | None = None,
                out: torch.Tensor | None = None, experts: Experts | None = None) -> torch.Tensor:
    """x [M <= 8, K] -> y [M, N] f32 on x's q8_1 form (`q8_1`, else quantized here); params: block_n, nb,
    split_k, num_warps, carry (1: each tile's loads issued in the iteration before and carried into it; 0:
    at the top of their own, fewer registers). `out`: where y goes (Launch.outputs). `experts`: w a stack
    of experts, y [A, N] the assignments' products (Experts)."""
    if w.type_id not in TYPES:
        raise ValueError(f"the int8 mat-vec has no kernel for {w.type_name}")
    launch = plan("int8", x, w, params, experts, ragged=w.type_id in RAGGED)
    M, K = x.shape
    rows = experts.count if experts is not None else M
    q, dx, sx = q8_1 if q8_1 is not None else quantize_q8_1(x)
    kernel, type_args = kernel_for(w.type_id, 1 if experts is not None else M)
    part, y, counts = launch.outputs(rows, w.n, x.device, out)
    expert_args, expert_consts = launch.expert_args(w, experts)
    unit = 8 if type_args.get("XS") else 1  # IQ4_XS: the launch's super-blocks as the kernel's blocks of 32
    table = {"tab_ptr": grid_words(LATTICE[w.type_id], x.device)} if w.type_id in LATTICE else {}
    kernel[launch.grid(w.n)](
        q.view(torch.int32), dx, sx, w.data, part, y, counts, *w.field_args(), w.n, K, launch.per_split * unit,
        *expert_args, M=1 if experts is not None else M, BLOCK_N=params["block_n"], NB=launch.per_tile * unit,
        SPLIT=launch.split, DOT=dot_kind(x.device), CARRY=_carry(params, x.device),
        **tail_args(type_args, w.type_id, K, launch.per_tile), **expert_consts,
        num_warps=params["num_warps"], num_stages=1, **table, **pdl.launch_args(x.device),
    )
    return y
