"""The quantized GEMM's int8 mode (gemm._gemm_kernel with INT8): W's integer codes times x's q8_1 codes
(q8_1.py) on the matrix units, one product per 32-element sub-block of K.

For sub-block s the weight rows' codes are int8 [BLOCK_N, 32] and x's int8 [32, BLOCK_M] (the weight rows on
the instruction's M side, as in the bf16 mode); tl.dot gives their int32 sums, exact (|code| <= 127 over 32
elements), which go into the f32 accumulator times the weight's scale of (row, s) and x's d of (x row, s):

    acc += dot(wq, xq) * sw[:, None] * dx[None, :]   (Q4_K, Q5_K: - (dmin m[s])[:, None] * sx[None, :])

sx = dx * sum(xq) of the block, q8_1's third plane. Codes and scales per type, as matvec_int8's:
  Q8_0    q, d.                  Q4_0    q - 8, d.
  IQ4_NL  the code's level, d.   MXFP4   the e2m1 value doubled, 2^(e - 128) (the E8M0 scale halved).
  Q4_K, Q5_K  the unsigned 4 / 5-bit code, d sc[s]; the min term dmin m[s] times x's sums.
  Q6_K    q - 32, d sc[i] per 16 elements: a 32-element chunk has two scales, so it is two products, each
          with the other half's codes zeroed. int8 tl.dot takes K >= 32 on NVIDIA; zeroing keeps K = 32
          and both products on the same operand tiles (x's is loaded once), at twice the chunk's matrix work.
The codes are decoded from both layouts with the tile dequantizers' loaders (tiles_legacy, tiles_kquants'
head words as gemm._q4_k_subblocks reads them, tiles_mxfp4). Torch reference:
matvec_int8.reference_matvec_q8_1 (x dequantized from its q8_1 form, then the float64 product).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.flat_words import q4_k_scale_min
from vegaserve.triton_kernels.tiles_legacy import iq4_nl_value, load_bytes, load_f16, nibbles_natural
from vegaserve.triton_kernels.tiles_mxfp4 import e2m1_doubled, half_scale

INT8_TYPES = frozenset({T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.Q4_0, T.IQ4_NL, T.MXFP4})


@triton.jit
def _x_subblock(x_ptr, xd_ptr, xs_ptr, xrow, valid, stride_xm, KB, sblk):
    """x's q8_1 sub-block sblk of rows xrow: codes int8 [32, BLOCK_M] (transposed for the dot), d and
    d sum(q) [BLOCK_M]; rows past the end read as 0. KB: x's blocks a row (the row stride of d and sums)."""
    j = tl.arange(0, 32)
    xq = tl.load(x_ptr + xrow[:, None] * stride_xm + sblk * 32 + j[None, :], mask=valid[:, None], other=0)
    dx = tl.load(xd_ptr + xrow * KB + sblk, mask=valid, other=0.0)
    sx = tl.load(xs_ptr + xrow * KB + sblk, mask=valid, other=0.0)
    return tl.trans(xq), dx, sx


@triton.jit
def _scaled(acc, wq, xt, sw, dx):
    """acc + the int32 product of the codes, times the weight's scale per row and x's per column."""
    return acc + tl.dot(wq, xt, out_dtype=tl.int32).to(tl.float32) * sw[:, None] * dx[None, :]


@triton.jit
def _legacy_block(WTYPE: tl.constexpr, base, o0, r0, b0, o1, r1, b1, rows, rmask, blk, BLOCK_N: tl.constexpr):
    """A 32-element block's codes int8 [BLOCK_N, 32] and scale [BLOCK_N]: Q8_0, Q4_0, IQ4_NL, MXFP4."""
    b = blk + tl.arange(0, 1)
    if WTYPE == 39:  # MXFP4: E8M0 byte e, scale 2^(e - 128) for the doubled levels
        e = load_bytes(base, o0, r0, b0, rows, b, rmask, 1).to(tl.int32)
        d = half_scale(tl.reshape(e, [BLOCK_N]))
    else:
        d = tl.reshape(load_f16(base, o0, r0, b0, rows, b, rmask), [BLOCK_N])
    if WTYPE == 8:
        q = load_bytes(base, o1, r1, b1, rows, b, rmask, 32).to(tl.int8, bitcast=True)
    else:
        codes = nibbles_natural(load_bytes(base, o1, r1, b1, rows, b, rmask, 16), BLOCK_N, 1)
        if WTYPE == 2:
            q = codes - 8
        elif WTYPE == 20:
            q = iq4_nl_value(codes).to(tl.int32)
        else:
            q = e2m1_doubled(codes)
        q = q.to(tl.int8)
    return tl.reshape(q, [BLOCK_N, 32]), d


@triton.jit
def _k_min_block(acc, base, o0, r0, b0, o2, r2, b2, o3, r3, b3, rows, rmask, blk, x_ptr, xd_ptr, xs_ptr, xrow,
                 valid, stride_xm, KB, FIVE: tl.constexpr):
    """Q4_K (FIVE 0) or Q5_K super-block blk: 8 products of 32, a sub-block's codes straight from one load
    (chunk c's low nibbles are sub-block 2c, its high ones 2c + 1; Q5_K's fifth bit s of qh[l]). The head
    record (d, dmin, the 12 scale bytes) is four words at field 0 in both layouts."""
    hp = (base + o0 + rows * r0 + blk * b0).to(tl.pointer_type(tl.int32))
    dm = tl.load(hp, mask=rmask, other=0)
    sa = tl.load(hp + 1, mask=rmask, other=0)
    sb = tl.load(hp + 2, mask=rmask, other=0)
    scw = tl.load(hp + 3, mask=rmask, other=0)
    d = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dm >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    j = tl.arange(0, 32)
    if FIVE:  # fields dm, scales, qh, qs
        qp = base + o3 + rows * r3 + blk * b3
        qh = tl.load((base + o2 + rows * r2 + blk * b2)[:, None] + j[None, :], mask=rmask[:, None], other=0)
    else:  # dm, scales, qs
        qp = base + o2 + rows * r2 + blk * b2
    for c in tl.static_range(4):
        q = tl.load(qp[:, None] + 32 * c + j[None, :], mask=rmask[:, None], other=0)
        for h in tl.static_range(2):
            sc, mn = q4_k_scale_min(sa, sb, scw, 2 * c + h)
            codes = q & 15 if h == 0 else q >> 4
            if FIVE:
                codes = codes | (((qh >> (2 * c + h)) & 1) << 4)
            xt, dx, sx = _x_subblock(x_ptr, xd_ptr, xs_ptr, xrow, valid, stride_xm, KB, blk * 8 + 2 * c + h)
            acc = _scaled(acc, codes.to(tl.int8), xt, d * sc.to(tl.float32), dx)
            acc -= (dmin * mn.to(tl.float32))[:, None] * sx[None, :]
    return acc


@triton.jit
def _q6_k_block(acc, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, x_ptr, xd_ptr, xs_ptr,
                xrow, valid, stride_xm, KB):
    """Q6_K super-block blk (fields ql, qh, scales, d): chunk c = 4h + g of 32 elements takes nibble g // 2 of
    ql[64h + 32 (g % 2) + l] and bits 2g, 2g + 1 of qh[32h + l] (as q6_k_tile), scales sc[2c], sc[2c + 1]."""
    d = tl.reshape(load_f16(base, o3, r3, b3, rows, blk + tl.arange(0, 1), rmask), [rows.shape[0]])
    j = tl.arange(0, 32)
    first_half = (j < 16)[None, :]
    for h in tl.static_range(2):
        qh = tl.load((base + o1 + rows * r1 + blk * b1 + 32 * h)[:, None] + j[None, :], mask=rmask[:, None],
                     other=0).to(tl.int32)
        for r in tl.static_range(2):
            ql = tl.load((base + o0 + rows * r0 + blk * b0 + 64 * h + 32 * r)[:, None] + j[None, :],
                         mask=rmask[:, None], other=0).to(tl.int32)
            for nib in tl.static_range(2):
                g = r + 2 * nib
                c = 4 * h + g
                codes = ((((ql >> (4 * nib)) & 15) | (((qh >> (2 * g)) & 3) << 4)) - 32).to(tl.int8)
                sp = base + o2 + rows * r2 + blk * b2 + 2 * c
                sc0 = tl.load(sp, mask=rmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                sc1 = tl.load(sp + 1, mask=rmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                xt, dx, _ = _x_subblock(x_ptr, xd_ptr, xs_ptr, xrow, valid, stride_xm, KB, blk * 8 + c)
                acc = _scaled(acc, tl.where(first_half, codes, 0).to(tl.int8), xt, d * sc0, dx)
                acc = _scaled(acc, tl.where(first_half, 0, codes).to(tl.int8), xt, d * sc1, dx)
    return acc


@triton.jit
def int8_products(acc, WTYPE: tl.constexpr, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask,
                  blk0, x_ptr, xd_ptr, xs_ptr, xrow, valid, stride_xm, K, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus the tile of NB blocks from blk0 (super-blocks for the K-quants) of the
    rows times x's q8_1 codes there (x_ptr: the int8 codes [R, K], xd_ptr / xs_ptr: d and d sum(q) [R, K/32])."""
    KB = K // 32
    for t in tl.static_range(NB):
        blk = blk0 + t
        if WTYPE == 12 or WTYPE == 13:
            acc = _k_min_block(acc, base, o0, r0, b0, o2, r2, b2, o3, r3, b3, rows, rmask, blk, x_ptr, xd_ptr, xs_ptr,
                               xrow, valid, stride_xm, KB, WTYPE == 13)
        elif WTYPE == 14:
            acc = _q6_k_block(acc, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, x_ptr,
                              xd_ptr, xs_ptr, xrow, valid, stride_xm, KB)
        else:
            wq, sw = _legacy_block(WTYPE, base, o0, r0, b0, o1, r1, b1, rows, rmask, blk, BLOCK_N)
            xt, dx, _ = _x_subblock(x_ptr, xd_ptr, xs_ptr, xrow, valid, stride_xm, KB, blk)
            acc = _scaled(acc, wq, xt, sw, dx)
    return acc
