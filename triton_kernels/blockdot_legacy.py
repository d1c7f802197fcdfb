"""Decode mat-vec for the 32-element block types, one dot product per block in the shape it is loaded in.

For each block of 32 weights, sum_j q_j * x_j is taken on the raw codes and only then scaled by the
block's d (and, for the types with a min m, plus m * sum_j x_j): one scale per block instead of per
weight, and no reshape or permute of the weight tile. 4-bit codes keep their storage order (byte j holds
elements j and j + 16), so the activation is read in that order rather than the weights reordered.
Measured 1.5-1.75x over the dequantize-a-tile form on an H200 (docs/PERF.md). The math is that of
quants/legacy.py and quants/iq4_nl.py; the tests compare against them.
"""

import triton
import triton.language as tl

from vegaserve.triton_kernels.tiles_legacy import iq4_nl_value, load_bytes, load_f16

# ggml type ids served here
BLOCKDOT_TYPES = (2, 3, 6, 7, 8, 20)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL


@triton.jit
def _fifth_bits(base, off, rs, bs, rows, rmask, blk):
    """(bits of elements j, bits of elements j + 16), each [BN, NB, 16], from the 4 qh bytes."""
    qh = load_bytes(base, off, rs, bs, rows, blk, rmask, 4).to(tl.int32)  # [BN, NB, 4]
    shift = tl.arange(0, 4) * 8
    word = tl.sum(qh << shift[None, None, :], axis=2)  # little-endian u32 as int32
    j = tl.arange(0, 16)
    lo = (word[:, :, None] >> j[None, None, :]) & 1
    hi = (word[:, :, None] >> (j[None, None, :] + 16)) & 1
    return lo, hi


@triton.jit
def legacy_block_dots(
    WTYPE: tl.constexpr, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
    x_ptr, stride_xm, acc, M: tl.constexpr, MP: tl.constexpr,
):
    """acc [BN, NB, MP] += per-block dot products of the weights with activation rows 0..M-1."""
    mcol = tl.arange(0, MP)
    d = load_f16(base, o0, r0, b0, rows, blk, rmask)  # every type here starts with d
    if WTYPE == 8:
        j = tl.arange(0, 32)
        q = load_bytes(base, o1, r1, b1, rows, blk, rmask, 32).to(tl.int8, bitcast=True).to(tl.float32)
        for m in tl.static_range(M):
            x = tl.load(x_ptr + m * stride_xm + blk[:, None] * 32 + j[None, :]).to(tl.float32)
            s = tl.sum(q * x[None, :, :], axis=2) * d
            acc += tl.where(mcol[None, None, :] == m, s[:, :, None], 0.0)
    else:
        j = tl.arange(0, 16)
        if WTYPE == 2 or WTYPE == 20:
            qs = load_bytes(base, o1, r1, b1, rows, blk, rmask, 16)
        elif WTYPE == 3 or WTYPE == 6:
            qs = load_bytes(base, o2, r2, b2, rows, blk, rmask, 16)
        else:
            qs = load_bytes(base, o3, r3, b3, rows, blk, rmask, 16)
        lo = (qs & 15).to(tl.int32)
        hi = (qs >> 4).to(tl.int32)
        if WTYPE == 6:
            h_lo, h_hi = _fifth_bits(base, o1, r1, b1, rows, rmask, blk)
            lo, hi = lo | (h_lo << 4), hi | (h_hi << 4)
        if WTYPE == 7:
            h_lo, h_hi = _fifth_bits(base, o2, r2, b2, rows, rmask, blk)
            lo, hi = lo | (h_lo << 4), hi | (h_hi << 4)
        if WTYPE == 20:
            wl, wh = iq4_nl_value(lo).to(tl.float32), iq4_nl_value(hi).to(tl.float32)
        elif WTYPE == 2:
            wl, wh = lo.to(tl.float32) - 8.0, hi.to(tl.float32) - 8.0
        elif WTYPE == 6:
            wl, wh = lo.to(tl.float32) - 16.0, hi.to(tl.float32) - 16.0
        else:
            wl, wh = lo.to(tl.float32), hi.to(tl.float32)
        if WTYPE == 3 or WTYPE == 7:
            mn = load_f16(base, o1, r1, b1, rows, blk, rmask)
        for m in tl.static_range(M):
            xb = x_ptr + m * stride_xm + blk[:, None] * 32 + j[None, :]
            x_lo = tl.load(xb).to(tl.float32)
            x_hi = tl.load(xb + 16).to(tl.float32)
            s = tl.sum(wl * x_lo[None, :, :] + wh * x_hi[None, :, :], axis=2) * d
            if WTYPE == 3 or WTYPE == 7:
                s += mn * tl.sum(x_lo + x_hi, axis=1)[None, :]
            acc += tl.where(mcol[None, None, :] == m, s[:, :, None], 0.0)
    return acc


@triton.jit
def matvec_blockdot_kernel(
    x_ptr, part_ptr, base,  # pointers: activations [M, K], partials [SPLIT_K, M, N] f32, weight bytes
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # weight fields (layout.py)
    N, K, blocks_per_split,  # sizes
    stride_xm,  # strides
    WTYPE: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)
    first = pid_k * blocks_per_split
    n_iter = (tl.minimum(first + blocks_per_split, K // 32) - first) // NB
    acc = tl.zeros([BLOCK_N, NB, MP], dtype=tl.float32)
    for i in range(0, n_iter):
        blk = first + i * NB + tl.arange(0, NB)
        acc = legacy_block_dots(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk,
                                x_ptr, stride_xm, acc, M, MP)
    mcol = tl.arange(0, MP)
    out = part_ptr + pid_k * M * N + mcol[None, :] * N + rows[:, None]
    tl.store(out, tl.sum(acc, axis=1), mask=rmask[:, None] & (mcol[None, :] < M))
