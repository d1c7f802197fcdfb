"""Decode mat-vec with int8 dot products: y[M, N] = x[M, K] @ W[N, K]^T for M <= 8, the activations
quantized to q8_1 once (int8 per element, a scale and a scaled sum per 32), W repacked (layout.py).

A candidate beside matmul.matvec and matvec_flat.matvec_flat, with their signature and result (up to the
activation's quantization, which is the one llama.cpp's MMVQ kernels apply). Four products per
instruction: `dot4` is dp4a on NVIDIA, v_dot4_i32_i8 on AMD (gfx906 has it and no matrix cores; this
path has not run on an AMD GPU yet), and plain integer arithmetic under the interpreter. Quant words are
loaded 16 bytes per thread as in matvec_flat (the same tiles: flat_words.py), and a 4-bit word becomes two dot4 operands with one mask
each (low nibbles, high nibbles), so a block of 32 costs 8 dot4, 8 masks and a few float operations per
activation row, where the float kernels spend 2-3 instructions on every element.

Loads go along the rows: each row's quant words of a tile are one contiguous run (`flat` for the 32-element
types; the `pieces` kernels for Q4_K and Q6_K in matvec_pieces.py, whose unit is a 16-byte piece of the
quant plane with its scales decoded from the super-block's scale words), so a warp instruction reads 512
contiguous bytes.
Triton 3.6 lays a [rows, blocks, 4] load across 16 rows (16 cache lines an instruction), which kept these
kernels L1-bound (docs/PERF.md, 2026-12-04, fourth sitting). At M > 1 the K-quants keep their groups kernels
(per-group loads, the activations per row), and Q4_K has a matrix-unit kernel (`mma`; on the H200 at block_n
128 about 62 us at 2, 4 and 8 rows of 28672x4096, against dp4a's 40, 51 and 86 us; far slower on 4096x14336;
the tuning file's choice where it won). mma 2 takes the lanes kernels of matvec_mma.py instead (Q4_K, Q6_K,
Q8_0, Q4_0, IQ4_NL, MXFP4; NVIDIA sm_80+): one mma.sync a block and 16 rows with no shared memory, the H200
file's choice at M = 8 of the 8B model's gate-up and down shapes (1.3-3.5x, docs/PERF.md, eighth sitting).

Per type (the activation's q8_1 block b has scale dx[b] and sx[b] = dx[b] * sum(xq) over the block):
  Q8_0  (d * dx) * sum(q * xq).
  Q4_0  d * (dx * sum(q * xq) - 8 sx), q the unsigned nibble.
  IQ4_NL, MXFP4  d * dx * sum(v[q] * xq), v the type's 16 int8 levels (MXFP4: e2m1 doubled, d = 2^(e - 128));
        a word of 8 nibbles becomes two words of levels with byte permutes from the 16-byte table
        (8 prmt on NVIDIA, as llama.cpp's get_int_from_table_16; 6 v_perm_b32 on AMD, whose byte
        selectors take four nibbles at once; the integer emulation under the interpreter).
  Q4_K  per 32-element sub-block s: d * sc[s] * dx[s] * sum(q * xq) - dmin * m[s] * sx[s].
  Q6_K  per 16-element sub-block i: d * sc[i] * dx * sum((q - 32) * xq); the six-bit code is made from
        its ql nibble and qh pair in place and turned into the signed byte q - 32 with an add and an
        XOR per word (code + 96 never carries out of its byte; flipping bit 7 subtracts 128).
Torch reference: `reference_matvec_q8_1` (the activation dequantized from its q8_1 form, then
matmul.reference_matmul in float64). The activation's q8_1 form: q8_1.py (here as `quantize_q8_1` too).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.flat_words import (
    block_planes,
    program_rows,
    row_runs,
    q4_k_groups,
    q4_k_scale_decode,
    q4_k_scale_min,
    q4_k_scale_words,
    q6_k_groups,
    q6_k_scales,
    split4,
    store_rows,
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
from vegaserve.triton_kernels.matvec_flat import arrival_counts, plan_launch
from vegaserve.triton_kernels.matvec_flat import candidates as flat_candidates
from vegaserve.triton_kernels.matvec_mma import BLOCK_LANES, Q4_K_LANES, Q6_K_LANES, lanes_kernel
from vegaserve.triton_kernels.matvec_pieces import pieces_pair_kernel, q4_k_pieces_kernel, q6_k_pieces_kernel
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.tiles_mxfp4 import half_scale

Q4_0, Q8_0, Q4_K, Q6_K, IQ4_NL, MXFP4 = 2, 8, 12, 14, 20, 39


def reference_matvec_q8_1(q: torch.Tensor, d: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The product the kernels compute: the q8_1 activation dequantized, times dequant(W)^T in float64."""
    x = (q.double().view(q.shape[0], -1, 32) * d.double()[..., None]).view(q.shape)
    return reference_matmul(x, w)


@triton.jit
def _x_words(xrow, xw, OFF: tl.constexpr):
    """Four int32 words of q8_1 activations per group at word xw + OFF: [1, G] each (one 16-byte load)."""
    return split4(tl.load(xrow + xw + OFF)[None, :, :])


@triton.jit
def _legacy_tile(qs, dp, HALVES: tl.constexpr, E8M0: tl.constexpr, FLAT: tl.constexpr):
    """Loads of one tile of a 32-element type: the scales (f16, or E8M0 bytes as MXFP4's halved scale) and
    HALVES 16-byte runs of each block."""
    if E8M0:
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
        xv = _x_words(xrow, xw, 0) + _x_words(xrow, xw, 4)
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
        xl = _x_words(xrow, xw, 0)
        xh = _x_words(xrow, xw, 4)
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
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): d, qs
    N, K, blocks_per_split,
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, WORDS: tl.constexpr, TABLE: tl.constexpr, E8M0: tl.constexpr, PDL: tl.constexpr,
    FLAT: tl.constexpr,
):
    """Blocks of 32 with one scale and WORDS quant words: Q8_0 (WORDS 8), Q4_0 (4), IQ4_NL and MXFP4 (4, their
    levels' TABLE 1 and 2; MXFP4's scale an E8M0 byte)."""
    pdl.let_next_start(PDL)
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 32, BLOCK_N, NB)
    qs, dp = block_planes(base, o0, r0, b0, o1, r1, r64, first, NB, WORDS, FLAT)
    xb = first + tl.arange(0, NB)
    xw = (xb * 8)[:, None] + tl.arange(0, 4)[None, :]
    acc = zero_rows(M, BLOCK_N, NB)
    if CARRY:
        tile = _legacy_tile(qs, dp, WORDS // 4, E8M0, FLAT)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _legacy_tile(qs, dp, WORDS // 4, E8M0, FLAT)
        pdl.wait_for_inputs(PDL)  # the first tile's loads are in flight (a no-op after the first)
        more = it + 1 < n_iter
        qs += advance(more, NB * WORDS, CARRY)
        dp += advance(more, NB * b0, CARRY)
        if WORDS == 8:
            acc = _q8_0_dots(tile, acc, xq_ptr, dx_ptr, xw, xb, K, M, BLOCK_N, NB, DOT)
        else:
            acc = _nibble_dots(tile, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M, BLOCK_N, NB, TABLE, DOT)
        if CARRY:
            tile = _legacy_tile(qs, dp, WORDS // 4, E8M0, FLAT)  # the next tile's loads (ptxas issues them mid-loop)
        xw += NB * 8
        xb += NB
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


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
def _q4_k_acts_staged(xq_ptr, dx_ptr, sx_ptr, w0, b0, NB: tl.constexpr):
    """_q4_k_acts at M = 1 from two contiguous loads: the tile's NB * 64 activation words and NB * 8
    scales and sums, each lane reading neighbouring addresses, then redistributed to the groups (Triton
    converts through shared memory). The per-group loads of _q4_k_acts touch up to 16 cache lines per
    warp-wide load, which kept the L1 at 88% of its throughput on 28672x4096 (docs/PERF.md, 2026-12-04).
    w0, b0: the tile's first word and first q8_1 block. Runs [1, G, 4], scales and sums [1, G] as there."""
    xt = tl.load(xq_ptr + w0 + tl.arange(0, NB * 64))
    # word sb * 64 + cc * 32 + j * 16 + (2 q1 + q0) * 4 + w  ->  (g = 2 sb + j, w, cc, q1, q0)
    xt = tl.permute(tl.reshape(xt, (NB, 2, 2, 2, 2, 4)), (0, 2, 5, 1, 3, 4))
    x0, x1 = tl.split(tl.reshape(xt, (2 * NB, 4, 2, 2, 2)))  # q0 = 0, 1
    x00, x01 = tl.split(x0)  # q1 = 0, 1
    x10, x11 = tl.split(x1)
    r0, r4 = tl.split(x00)  # cc = 0, 1: run r = 4 cc + 2 q1 + q0
    r2, r6 = tl.split(x01)
    r1, r5 = tl.split(x10)
    r3, r7 = tl.split(x11)
    runs = (r0[None, :, :], r1[None, :, :], r2[None, :, :], r3[None, :, :],
            r4[None, :, :], r5[None, :, :], r6[None, :, :], r7[None, :, :])
    return ((runs, _q4_k_block_values(dx_ptr, b0, NB), _q4_k_block_values(sx_ptr, b0, NB)),)


@triton.jit
def _q4_k_tile_acts(xq_ptr, dx_ptr, sx_ptr, xw, xb, w0, b0, K, NB: tl.constexpr, ACTS: tl.constexpr,
                    STAGED: tl.constexpr):
    """The activations loaded with a tile (M = 1; none at M > 1, where the dots load them per row): staged
    (contiguous loads, w0 and b0 the tile's first word and block) or per group (xw, xb)."""
    if STAGED:
        return _q4_k_acts_staged(xq_ptr, dx_ptr, sx_ptr, w0, b0, NB)
    else:
        return _q4_k_acts(xq_ptr, dx_ptr, sx_ptr, xw, xb, K, ACTS)


@triton.jit
def _q4_k_block_values(ptr, b0, NB: tl.constexpr):
    """The tile's NB * 8 per-block values (q8_1 scales or sums) from one contiguous load, as the four
    [1, G] of sub-blocks 2j, 2j + 1, 2j + 4, 2j + 5 of each group g = 2 sb + j."""
    # block sb * 8 + h * 4 + j * 2 + p  ->  (g, h, p)
    v = tl.load(ptr + b0 + tl.arange(0, NB * 8))
    p0, p1 = tl.split(tl.reshape(tl.permute(tl.reshape(v, (NB, 2, 2, 2)), (0, 2, 1, 3)), (2 * NB, 2, 2)))
    h0p0, h1p0 = tl.split(p0)
    h0p1, h1p1 = tl.split(p1)
    return h0p0[None, :], h0p1[None, :], h1p0[None, :], h1p1[None, :]


@triton.jit
def _q4_k_dots(tile, acts, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M: tl.constexpr, BLOCK_N: tl.constexpr,
               G: tl.constexpr, DOT: tl.constexpr):
    """The tile's products; the activations from `acts` (_q4_k_acts) at M = 1, loaded here per chunk
    and row of x above (all of them at once would take 40 registers per row of x)."""
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
            if M == 1:
                xr, dx, sx = acts[0]
            else:
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
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, STAGE: tl.constexpr, PDL: tl.constexpr,
):
    pdl.let_next_start(PDL)
    # groups as in matvec_flat: (super-block, j) holds chunks j and j + 2 (sub-blocks 2j, 2j + 1 and
    # 2j + 4, 2j + 5); byte l of chunk c: low nibble element 64c + l, high nibble 64c + 32 + l
    G: tl.constexpr = 2 * NB
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, NB)
    qs, dm, sp, sb, j = q4_k_groups(base, o0, r0, b0, o1, r1, b1, o2, r2, r64, first, NB)
    xw = (sb * 64 + j * 16)[:, None] + tl.arange(0, 4)[None, :]  # int32 word of sub-block 2j's first element
    # q8_1 block of sub-block 2j, [BLOCK_N, G] (the same for every row): loaded in the accumulators'
    # shape, a [1, G] load got a layout of its own and a conversion through shared memory per row of x
    xb = (sb * 8 + 2 * j)[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    acc = zero_rows(M, BLOCK_N, G)
    ACTS: tl.constexpr = 1 if M == 1 else 0  # rows of x whose activations are loaded with the tile
    STAGED: tl.constexpr = STAGE and M == 1
    w0 = first * 64  # the tile's first activation word and q8_1 block (STAGED)
    b0_x = first * 8
    if CARRY:
        tile = _q4_k_tile(qs, dm, sp)
        pdl.wait_for_inputs(PDL)  # the weight loads before it overlap the previous kernel's end
        acts = _q4_k_tile_acts(xq_ptr, dx_ptr, sx_ptr, xw, xb, w0, b0_x, K, NB, ACTS, STAGED)
    for it in range(0, n_iter):
        if not CARRY:
            tile = _q4_k_tile(qs, dm, sp)
            pdl.wait_for_inputs(PDL)  # a no-op after the first
            acts = _q4_k_tile_acts(xq_ptr, dx_ptr, sx_ptr, xw, xb, w0, b0_x, K, NB, ACTS, STAGED)
        more = it + 1 < n_iter
        acc = _q4_k_dots(tile, acts, acc, xq_ptr, dx_ptr, sx_ptr, xw, xb, K, M, BLOCK_N, G, DOT)
        qs += advance(more, NB * 32, CARRY)
        dm += advance(more, NB * b0, CARRY)
        sp += advance(more, NB * b1, CARRY)
        xw += advance(more, NB * 64, CARRY)
        xb += advance(more, NB * 8, CARRY)
        w0 += advance(more, NB * 64, CARRY)
        b0_x += advance(more, NB * 8, CARRY)
        if CARRY:
            tile = _q4_k_tile(qs, dm, sp)  # the next tile's loads (ptxas issues them mid-loop)
            acts = _q4_k_tile_acts(xq_ptr, dx_ptr, sx_ptr, xw, xb, w0, b0_x, K, NB, ACTS, STAGED)
    pdl.wait_for_inputs(PDL)  # no store before the wait, also in a program with no tile (none today)
    store_rows(part_ptr, out_ptr, count_ptr, acc, M, N, rows, SPLIT)


@triton.jit
def _eighths(v):
    """v [..., 2, 2, 2] (index s = 4 s2 + 2 s1 + s0 on the last three axes) -> its eight [...] in s order."""
    e, o = tl.split(v)  # s0
    e0, e1 = tl.split(e)  # s1
    o0, o1 = tl.split(o)
    s0, s4 = tl.split(e0)  # s2
    s2, s6 = tl.split(e1)
    s1, s5 = tl.split(o0)
    s3, s7 = tl.split(o1)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _q4_k_mma_kernel(
    xq_ptr, dx_ptr, sx_ptr, base, part_ptr, out_ptr, count_ptr,
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # fields (layout.py): dm, scales (one head plane), qs
    N, K, blocks_per_split,  # super-blocks of 256
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr,
):
    """Q4_K for 2..8 rows of x on the matrix units: per 32-element sub-block one int8 tl.dot of the
    weight's codes [BLOCK_N, 32] with the activation's [32, 16] (rows of x padded to 16), its int32
    result scaled by d sc[s] dx[s] and the min term d_min m[s] sx[s] taken off, in f32. One super-block an
    iteration (the launch's NB, CARRY and DOT are not used); the quant bytes and head records loaded as
    contiguous runs per row."""
    pdl.let_next_start(PDL)
    MP: tl.constexpr = 16
    rows, r64, first, n_iter = program_rows(N, blocks_per_split, K // 256, BLOCK_N, 1)
    qs = row_runs(base, o2, r2, r64, first * 128, 128, tl.uint8)
    hd = row_runs(base, o0, r0, r64, first * 4, 4, tl.int32)
    mr = tl.arange(0, MP)
    live = (mr < M)[:, None]
    xp = xq_ptr.to(tl.pointer_type(tl.int8)) + mr[:, None] * K + first * 256 + tl.arange(0, 256)[None, :]
    vp = mr[:, None] * (K // 32) + first * 8 + tl.arange(0, 8)[None, :]
    acc = tl.zeros([BLOCK_N, MP], dtype=tl.float32)
    pdl.wait_for_inputs(PDL)
    for it in range(0, n_iter):
        q = tl.reshape(tl.load(qs), [BLOCK_N, 4, 32])  # byte l of chunk c: sub-block 2c (low), 2c + 1 (high)
        dm, a, b, c = split4(tl.reshape(tl.load(hd), [BLOCK_N, 1, 4]))
        x = tl.load(xp, mask=live, other=0)
        dx = tl.load(dx_ptr + vp, mask=live, other=0.0)
        sx = tl.load(sx_ptr + vp, mask=live, other=0.0)
        qs += 128
        hd += 4
        xp += 256
        vp += 8
        # codes [BLOCK_N, 32, 8] with sub-block s = 2c + nibble on the last axis
        codes = tl.join((q & 15).to(tl.int8), (q >> 4).to(tl.int8))  # [BLOCK_N, 4, 32, 2]
        codes = tl.reshape(tl.permute(codes, (0, 2, 1, 3)), [BLOCK_N, 32, 2, 2, 2])
        w_s = _eighths(codes)
        x_s = _eighths(tl.reshape(tl.permute(tl.reshape(x, [MP, 8, 32]), (2, 0, 1)), [32, MP, 2, 2, 2]))
        dx_s = _eighths(tl.reshape(dx, [MP, 2, 2, 2]))
        sx_s = _eighths(tl.reshape(sx, [MP, 2, 2, 2]))
        d = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dm >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for s in tl.static_range(8):
            sc, mn = q4_k_scale_min(a, b, c, s)
            prod = tl.dot(w_s[s], x_s[s], out_dtype=tl.int32)
            acc += (prod.to(tl.float32) * (d * sc.to(tl.float32)) * dx_s[s][None, :]
                    - (dmin * mn.to(tl.float32)) * sx_s[s][None, :])
    out = ()
    for m in tl.static_range(M):
        out = out + (tl.where(mr[None, :] == m, acc, 0.0),)
    store_rows(part_ptr, out_ptr, count_ptr, out, M, N, rows, SPLIT)


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
            xl = _x_words(xrow, xw, 8 * gm)
            xh = _x_words(xrow, xw, 8 * gm + 16)
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
    M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    CARRY: tl.constexpr, PDL: tl.constexpr,
):
    pdl.let_next_start(PDL)
    # groups as in matvec_flat: (super-block, half h, l4) holds qh bytes l = 16 l4 .. 16 l4 + 15 of half h
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


# type id -> kernel; the tiles (and so the launch rule) are matvec_flat's
_LEGACY = {"TABLE": 0, "E8M0": False}
_KERNELS = {Q8_0: (_legacy_kernel, {**_LEGACY, "WORDS": 8}), Q4_0: (_legacy_kernel, {**_LEGACY, "WORDS": 4}),
            IQ4_NL: (_legacy_kernel, {**_LEGACY, "WORDS": 4, "TABLE": 1}),
            MXFP4: (_legacy_kernel, {"WORDS": 4, "TABLE": 2, "E8M0": True}),
            Q4_K: (_q4_k_kernel, {}), Q6_K: (_q6_k_kernel, {})}
SUPPORTED = frozenset(_KERNELS)


def candidates(type_id: int, n: int, k: int, m: int, sm_count: int,
               matrix_units: bool = False) -> list[dict[str, int]]:
    """The launch configs a sweep times: matvec_flat's tile candidates, each with the tile loaded ahead
    (carry 1) and in its own iteration (carry 0); for Q4_K and Q6_K at M = 1 both kernels, the pieces
    kernel also with 8 and 32 rows a program (its best on the H200 was often a smaller block_n than the
    groups kernel's: Q6_K 8), each with unpack 0 and 1 and gather 0 and 1. matrix_units
    (has_matrix_units): also the lanes
    kernels' (lanes_candidates)."""
    tiles = flat_candidates(type_id, n, k, m, sm_count)
    out = [{**c, "carry": carry} for c in tiles for carry in (1, 0)]
    if m == 1 and type_id in (Q4_K, Q6_K):
        out = [{**c, "pieces": 0} for c in out]
        out += [{**c, "carry": carry, "block_n": bn, "pieces": 1, "unpack": unpack, "gather": gather}
                for c in tiles for carry in (1, 0) for bn in sorted({c["block_n"], 8, 32}) for unpack in (0, 1)
                for gather in (0, 1)]
    if matrix_units:  # every int8 type has a lanes kernel
        out += lanes_candidates(type_id, n, k, sm_count)
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in out)]


def lanes_candidates(type_id: int, n: int, k: int, sm_count: int) -> list[dict[str, int]]:
    """mma 2 (matvec_mma.py): 2 groups of 16 rows a warp on 1, 2 or 4 warps, 1 on 4 (the H200's sweep of
    the eighth sitting, docs/PERF.md: 8 warps lost everywhere, 1 and 2 won on four of the seven shapes); the
    32-element types with 4 and 8 blocks a tile (Q4_K: a super-block an iteration, nb 8); the smallest
    power-of-two split-K that gives two programs an SM, with at least two tiles a split, and twice that.
    Each also with pipe 1 and 2, at its split and half of it (pipe 2's registers leave fewer programs an
    SM, so fewer programs may be the faster launch)."""
    qk = 256 if type_id in (Q4_K, Q6_K) else 32
    out = []
    for block_n, warps in ((32, 1), (64, 2), (64, 4), (128, 4)):
        for nb in (8,) if qk == 256 else (4, 8):
            tiles = k // qk // max(1, nb * 32 // qk)
            split = 1
            while -(-n // block_n) * split < 2 * sm_count and tiles // (2 * split) >= 2:
                split *= 2
            out += [{"mma": 2, "block_n": block_n, "num_warps": warps, "nb": nb, "split_k": s, "carry": 1}
                    for s in sorted({split, split * 2 if tiles // (2 * split) >= 2 else split})]
    # and the pipelined loops (matvec_mma._pipelined), at half the split too
    out += [{**c, "pipe": pipe, "split_k": s} for c in list(out) for pipe in (1, 2)
            for s in sorted({c["split_k"], max(1, c["split_k"] // 2)})]
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in out)]


def has_matrix_units(device: torch.device) -> bool:
    """Whether the lanes kernels (mma 2) run on `device`: an NVIDIA GPU of sm_80 or later."""
    return (device.type == "cuda" and not torch.version.hip
            and torch.cuda.get_device_capability(device) >= (8, 0))


def dot_kind(device: torch.device) -> int:
    """Which dot4 the device runs: the integer emulation under the interpreter (or on a CPU tensor)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return EMULATE
    return AMDGCN_DOT4 if torch.version.hip else PTX_DP4A


def choose_kernel(type_id: int, m: int, params: dict[str, int]) -> tuple[object, dict[str, int]]:
    """The kernel a launch of m activation rows with these launch parameters takes, and its type's
    constexprs (benchmarks/kernel_resources.py compiles the same choice without a GPU)."""
    kernel, type_args = _KERNELS[type_id]
    if params.get("mma", 0) == 2:
        # one mma.sync per block (Q4_K: sub-block) and 16 rows, operands in the lanes' registers
        # (matvec_mma.py)
        kind = {Q4_K: Q4_K_LANES, Q6_K: Q6_K_LANES}.get(type_id, BLOCK_LANES)
        return lanes_kernel, {"WORDS": 4, "TABLE": 0, "E8M0": False, **type_args, "W": params["num_warps"],
                              "KIND": kind, "PIPE": params.get("pipe", 0)}
    if type_id not in (Q4_K, Q6_K):
        # 1.26-1.47x at M = 1 on the 8B shapes, Q4_0 1.34x at M = 8, Q8_0 0.77x there (docs/PERF.md)
        return kernel, {**type_args, "FLAT": params.get("flat", int(m == 1 or type_id != Q8_0))}
    if type_id == Q4_K and m > 1 and params.get("mma", 0):
        return _q4_k_mma_kernel, {}  # where the tuning file says (docs/PERF.md): no default
    if type_id == Q4_K and params.get("pieces", int(m == 1)):
        # M = 1: 1.38-1.52x on the 8B shapes; M = 8: 0.72x. unpack 1 (fewer slow instructions): the tuning
        # file's choice per shape (28672x4096: 22.3 -> 20.6 us at block_n 16, nb 32 on an H200)
        return q4_k_pieces_kernel, {"UNPACK": params.get("unpack", 0), "GATHER": params.get("gather", 0)}
    if type_id == Q6_K and params.get("pieces", int(m == 1)):
        # M = 1: 1.3-2.8x with block_n 8 (the tuning file's); unpack 1: no faster on the H200's shapes
        return q6_k_pieces_kernel, {"UNPACK": params.get("unpack", 0), "GATHER": params.get("gather", 0)}
    if type_id == Q4_K:
        return kernel, {**type_args, "STAGE": params.get("stage", 1)}  # 1.04-1.09x on the 8B shapes
    return kernel, type_args


def matvec_int8(x: torch.Tensor, w: PackedWeight, block_n: int | None = None, nb: int | None = None,
                split_k: int | None = None, num_warps: int | None = None, carry: int | None = None,
                stage: int | None = None, flat: int | None = None, pieces: int | None = None,
                mma: int | None = None, unpack: int | None = None, pipe: int | None = None,
                gather: int | None = None,
                q8_1: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 8, K] -> y [M, N] f32 as matvec_flat; `q8_1`: x already quantized (quantize_q8_1), which
    several matmuls of one activation share. carry 1: each tile's loads are issued at the end of the
    iteration before and carried into it; 0: loaded at the top of their own iteration (fewer registers).
    flat 1 (32-element types): each row's quant words of a tile in one contiguous load, which puts the
    lanes of a warp along the row (flat 0: a [rows, blocks, 4] load, whose lanes Triton 3.6 lays across 16
    rows, a cache line each; the default except for Q8_0 at M > 1). Q4_K: pieces 1 (the default at M = 1)
    takes the pieces kernel, whose loads go along the rows the same way; else the groups kernel, where
    stage 1 (M = 1) loads the tile's activations in contiguous runs, redistributed through shared memory.
    mma 1 (Q4_K, M > 1, NVIDIA): the matrix-unit kernel, an int8 tl.dot per sub-block; mma 2 (Q4_K, Q6_K,
    Q8_0, Q4_0, IQ4_NL, MXFP4; NVIDIA sm_80+): one mma.sync per block (Q4_K: sub-block) and 16 rows with each
    lane's operands loaded in place (matvec_mma.py; block_n 16 x num_warps x the 16-row groups a warp
    takes; for the 32-element types a tile of one block, nb 1 or a row of an odd number of blocks, runs
    the dp4a kernel instead); unpack 1 (the
    pieces kernels): int-to-float by exact adds (Q4_K: and its scales decoded with per-piece masks).
    gather 1 (the pieces kernels): the activations, their q8_1 scales (and Q4_K's head words) loaded
    where each thread uses them instead of in runs rearranged through shared memory (no barrier in the
    loop). pipe 1, 2 (mma 2; the 32-element types with tiles of 4 blocks or more): the lanes kernel
    issues its weight loads ahead of the products before them (matvec_mma._pipelined: 1 half a tile
    ahead, 2 a whole one) in place of carry's loads after them.
    mma and unpack 1 are the tuning file's choice per shape (on the H200: mma 2 at M = 8 of 28672x4096
    and 4096x14336).
    Unset launch parameters: the tuning file's "matvec_int8" entry, else matvec_flat's rule (carry 1).
    `out`: where y goes (Launch.outputs: at M = 1 a column slice of a wider output, so the matrices of one
    activation with different types write one output without a cat)."""
    plan = plan_launch("matvec_int8", x, w, SUPPORTED, {"block_n": block_n, "nb": nb, "split_k": split_k,
                                                        "num_warps": num_warps, "carry": carry, "stage": stage,
                                                        "flat": flat, "pieces": pieces, "mma": mma,
                                                        "unpack": unpack, "pipe": pipe, "gather": gather})
    M, K = x.shape
    mma = plan.params.get("mma", 0)
    if mma and torch.version.hip:
        raise ValueError(f"mma {mma} is an NVIDIA matrix-unit kernel; gfx906 has no matrix units")
    if plan.params.get("pipe", 0) not in (0, 1, 2):
        raise ValueError(f"pipe is 0, 1 or 2; got {plan.params['pipe']}")
    if plan.params.get("pipe", 0) and mma != 2:
        raise ValueError(f"pipe is the lanes kernels' loop (mma 2); got mma {mma}")
    if plan.params.get("pipe", 0) and w.type_id not in (Q4_K, Q6_K) and plan.per_tile < 4:
        raise ValueError(f"pipe takes tiles of 4 blocks or more (two halves read in pairs); got {plan.per_tile}")
    if mma == 2:
        lanes_rows = 16 * plan.params["num_warps"]
        if plan.params["block_n"] % lanes_rows:
            raise ValueError(f"mma 2 takes block_n a multiple of 16 x num_warps ({lanes_rows}); got "
                             f"{plan.params['block_n']}")
        if w.type_id not in (Q4_K, Q6_K) and plan.per_tile == 1:
            # the lanes kernel reads a tile's q8_1 scales in pairs; a tile is a power of two of blocks that
            # divides the row (matvec_tiles), so one block a tile (nb 1, or a row of an odd number of
            # blocks) goes to the dp4a kernel with the same launch
            plan = dataclasses.replace(plan, params={**plan.params, "mma": 0})
        if dot_kind(x.device) == PTX_DP4A and not has_matrix_units(x.device):
            raise ValueError("mma 2 takes mma.sync m16n8k32 (int8), sm_80 and later")
    q, dx, sx = q8_1 if q8_1 is not None else quantize_q8_1(x)
    kernel, type_args = choose_kernel(w.type_id, M, plan.params)
    part, y, counts = plan.outputs(M, w.n, x.device, out)
    kernel[plan.grid(w.n)](
        q.view(torch.int32), dx, sx, w.data, part, y, counts, *w.field_args(), w.n, K, plan.per_split,
        M=M, BLOCK_N=plan.params["block_n"], NB=plan.per_tile, SPLIT=plan.split, DOT=dot_kind(x.device),
        CARRY=plan.params.get("carry", 1), **type_args, num_warps=plan.params["num_warps"], num_stages=1,
        **pdl.launch_args(x.device),
    )
    return y


_PIECES = {q4_k_pieces_kernel: Q4_K, q6_k_pieces_kernel: Q6_K}


def pairs(a: tuple[PackedWeight, dict[str, int]], b: tuple[PackedWeight, dict[str, int]]) -> bool:
    """Whether matvec_int8_pair takes these two matrices with these (complete) launch parameters at one row:
    both repacked K-quants whose one-row kernel is the pieces kernel (Q4_K, Q6_K), on the same warp count,
    with different types (matrices of one type are stacked into one at load instead)."""
    kinds = []
    for w, params in (a, b):
        if not w.repacked or w.type_id not in (Q4_K, Q6_K):
            return False
        kinds.append(_PIECES.get(choose_kernel(w.type_id, 1, params)[0]))
    return None not in kinds and a[0].type_id != b[0].type_id and a[1]["num_warps"] == b[1]["num_warps"]


def matvec_int8_pair(x: torch.Tensor, a: tuple[PackedWeight, dict[str, int]], b: tuple[PackedWeight, dict[str, int]],
                     q8_1: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One row of x times two matrices of different K-quant types in one launch: y [1, Na + Nb] =
    [x Wa^T, x Wb^T], each part as matvec_int8 computes it with its own launch parameters (the layer's
    Q4_K q and k stacked, beside its Q6_K v: one launch a layer fewer). `pairs(a, b)` must hold; `out`:
    where y goes (a column slice of a wider output is fine, as matvec_int8's)."""
    if x.shape[0] != 1:
        raise ValueError(f"matvec_int8_pair takes one row of x; got {tuple(x.shape)}")
    if not pairs(a, b):
        raise ValueError("matvec_int8_pair takes a Q4_K and a Q6_K matrix (repacked) whose one-row kernels "
                         "are the pieces kernels, on the same number of warps")
    (wa, pa), (wb, pb) = a, b
    plan_a = plan_launch("matvec_int8", x, wa, SUPPORTED, pa)
    plan_b = plan_launch("matvec_int8", x, wb, SUPPORTED, pb)
    K = x.shape[1]
    if out is None:
        out = torch.empty(1, wa.n + wb.n, dtype=torch.float32, device=x.device)
    elif out.shape != (1, wa.n + wb.n):
        raise ValueError(f"out must be f32 [1, {wa.n + wb.n}]; got {tuple(out.shape)}")
    part_a, y_a, _ = plan_a.outputs(1, wa.n, x.device, out[:, :wa.n])
    part_b, y_b, _ = plan_b.outputs(1, wb.n, x.device, out[:, wa.n:])
    tiles_a, tiles_b = plan_a.grid(wa.n)[0], plan_b.grid(wb.n)[0]
    counts = arrival_counts(x.device, tiles_a + tiles_b)  # b's row tiles count after a's
    q, dx, sx = q8_1 if q8_1 is not None else quantize_q8_1(x)
    fa, fb = wa.field_args(), wb.field_args()
    offsets_a = [v for i in range(0, 12, 3) for v in fa[i:i + 2]]  # each field's offset and row stride
    offsets_b = [v for i in range(0, 12, 3) for v in fb[i:i + 2]]
    pieces_pair_kernel[(tiles_a * plan_a.split + tiles_b * plan_b.split,)](
        q.view(torch.int32), dx, sx, K,
        wa.data, part_a, y_a, counts, *offsets_a, wa.n, plan_a.per_split,
        wb.data, part_b, y_b, counts[tiles_a:], *offsets_b, wb.n, plan_b.per_split,
        KIND_A=wa.type_id, BLOCK_N_A=pa["block_n"], NB_A=plan_a.per_tile, SPLIT_A=plan_a.split,
        CARRY_A=pa.get("carry", 1), UNPACK_A=pa.get("unpack", 0), GATHER_A=pa.get("gather", 0),
        KIND_B=wb.type_id, BLOCK_N_B=pb["block_n"], NB_B=plan_b.per_tile, SPLIT_B=plan_b.split,
        CARRY_B=pb.get("carry", 1), UNPACK_B=pb.get("unpack", 0), GATHER_B=pb.get("gather", 0),
        DOT=dot_kind(x.device), num_warps=pa["num_warps"], num_stages=1, **pdl.launch_args(x.device),
    )
    return out
