"""mma.sync from Triton: every tensor of a kernel one value a lane, so that each lane's registers are the
instruction's fragment (matvec_mma.py's decode mat-vecs).

A [32 W] tensor with no contiguity for the coalescer to act on keeps Triton's default blocked layout, one
value a lane, lane i % 32 of warp i // 32 (`lanes`); an elementwise inline assembly over such tensors is
one instruction a lane with that lane's values as its registers. The tests check the layout in the
compiled kernels (tests/triton_kernels/test_matvec_int8_compile.py): one blocked layout, no conversion,
no shared memory.

The fragment of m16n8k32 (PTX ISA, "Matrix Fragments for mma.m16n8k32"), lane = 4 g + t:
  A (16 x 32, row): a0 row g, k 4t..4t+3 (a byte each); a1 row g + 8, same k; a2 row g, k 16+4t..16+4t+3;
     a3 row g + 8, k 16+4t..
  B (32 x 8, col): b0 column g, k 4t..4t+3; b1 column g, k 16+4t..
  D (16 x 8): d0 (g, 2t), d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8, 2t + 1).
m16n8k16 (int8): a0 row g, k 4t..4t+3; a1 row g + 8; b0 column g, k 4t..; D as above.
A sum over k does not care how k is numbered as long as A and B agree: a kernel may give k 4t+i to any
element of the block in lane t, which is how matvec_mma.py makes each lane's A and B words single loads.

Under the interpreter (DOT 0) the matrix instruction is emulated from the same per-lane registers
(the lanes' words regathered into the 16 x 32 and 32 x 8 matrices), so the tests check the fragment
bookkeeping above, not only the arithmetic. sm_80 and later; no AMD part (gfx906 has no matrix units).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vegaserve.triton_kernels.flat_words import store_split


@triton.jit
def lanes(W: tl.constexpr):
    """warp, g (lane // 4) and t (lane % 4) of each lane of the program's W warps, [32 W] each."""
    i = tl.arange(0, 32 * W)
    return i // 32, (i % 32) // 4, i % 4


@triton.jit
def lane_bytes(w):
    """[L] int32 -> [L, 4] its signed bytes, byte 0 first."""
    sh = (tl.arange(0, 4) * 8)[None, :]
    return (w[:, None] << (24 - sh)) >> 24


@triton.jit
def _fragment_rows(lo, hi, W: tl.constexpr):
    """The 8 rows (A) or columns (B) the lanes' two words hold, [W, 8, 32]: row g's k 4t + i from byte i of
    lo in lane 4g + t, k 16 + 4t + i from hi."""
    a = tl.reshape(lane_bytes(lo), [W, 8, 16])
    b = tl.reshape(lane_bytes(hi), [W, 8, 16])
    return tl.reshape(tl.permute(tl.join(a, b), (0, 1, 3, 2)), [W, 8, 32])


@triton.jit
def _result_lanes(d, W: tl.constexpr):
    """Rows [W, 8, 8] of a result (row g, column n) -> the lanes' (g, 2t) and (g, 2t + 1), [32 W] each."""
    e, o = tl.split(tl.reshape(d, [W, 8, 4, 2]))
    return tl.reshape(e, [32 * W]), tl.reshape(o, [32 * W])


@triton.jit
def mma_16x8x32(a0, a1, a2, a3, b0, b1, W: tl.constexpr, DOT: tl.constexpr):
    """The int32 products of A (16 x 32 int8) and B (32 x 8 int8) from the lanes' fragments (module
    docstring): d0, d1, d2, d3 [32 W]. DOT 1 (matvec_int8's PTX_DP4A: an NVIDIA GPU): the instruction;
    0: its emulation on the same registers."""
    if DOT == 1:
        zero = tl.zeros_like(a0)
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1, zero, zero, zero, zero],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        bt = _fragment_rows(b0, b1, W)[:, None, :, :]  # [W, 1, column, k]
        top = tl.sum(_fragment_rows(a0, a2, W)[:, :, None, :] * bt, axis=3)  # rows g: [W, g, column]
        bottom = tl.sum(_fragment_rows(a1, a3, W)[:, :, None, :] * bt, axis=3)  # rows g + 8
        d0, d1 = _result_lanes(top, W)
        d2, d3 = _result_lanes(bottom, W)
        return d0, d1, d2, d3


@triton.jit
def mma_16x8x16(a0, a1, b0, W: tl.constexpr, DOT: tl.constexpr):
    """m16n8k16 (int8): A's a0 row g, k 4t..4t+3 and a1 row g + 8; B's b0 column g, k 4t..; D as
    mma_16x8x32's. DOT 1: the instruction; 0: its emulation."""
    if DOT == 1:
        zero = tl.zeros_like(a0)
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5}, {$6}, {$7, $8, $9, $10};",
            "=r,=r,=r,=r,r,r,r,r,r,r,r", [a0, a1, b0, zero, zero, zero, zero],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        bt = tl.reshape(lane_bytes(b0), [W, 8, 16])[:, None, :, :]
        top = tl.sum(tl.reshape(lane_bytes(a0), [W, 8, 16])[:, :, None, :] * bt, axis=3)
        bottom = tl.sum(tl.reshape(lane_bytes(a1), [W, 8, 16])[:, :, None, :] * bt, axis=3)
        d0, d1 = _result_lanes(top, W)
        d2, d3 = _result_lanes(bottom, W)
        return d0, d1, d2, d3


@triton.jit
def load16(ptr, DOT: tl.constexpr):
    """The 16 bytes at ptr (16-byte aligned) in each lane as 4 int32 words, one 16-byte load (DOT 1; Triton
    gives a one-value-a-lane tensor no wider load than its element) or 4 loads of 4 (its emulation)."""
    if DOT == 1:
        return tl.inline_asm_elementwise("ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                         [ptr.to(tl.pointer_type(tl.int32))],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        w = ptr.to(tl.pointer_type(tl.int32))
        return tl.load(w), tl.load(w + 1), tl.load(w + 2), tl.load(w + 3)


@triton.jit
def swap_pairs(v, W: tl.constexpr, DOT: tl.constexpr):
    """Each lane gets v of lane ^ 2 (t and t ^ 2 of the same g swap): one shfl.sync.bfly (DOT 1) or its
    emulation on the [32 W] tensor."""
    if DOT == 1:
        return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;", "=r,r", [v],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = tl.permute(tl.reshape(v, [W * 8, 2, 2]), (0, 2, 1))  # (lane // 4, t % 2, t // 2)
        a, b = tl.split(r)
        return tl.reshape(tl.permute(tl.join(b, a), (0, 2, 1)), [32 * W])


@triton.jit
def exchange_halves(words, lo, W: tl.constexpr, DOT: tl.constexpr):
    """Two 32-byte runs of a row (Q4_K's chunks) as the fragment wants them, from one 16-byte
    load a lane at 16t of their 64 bytes (`words`, 4 int32; lo: t < 2): lanes t < 2 hold the first run,
    bytes 16 (t % 2).., the others the second. Each keeps its words 0 and 1 and takes words 2 and 3 of
    lane t ^ 2 (swap_pairs), so lane t ends with words 4 (t % 2) + 2 ((t // 2) ^ r) and the next of run r:
    ((first run's two words), (second run's)). A warp's load covers 8 rows x 64 bytes, 8 cache lines for
    512 bytes, where an 8-byte load at 8t of each run covers 8 lines for 256."""
    w0, w1, w2, w3 = words
    r2 = swap_pairs(w2, W, DOT)
    r3 = swap_pairs(w3, W, DOT)
    return (tl.where(lo, w0, r2), tl.where(lo, w1, r3)), (tl.where(lo, r2, w0), tl.where(lo, r3, w1))


@triton.jit
def pair_offsets(t):
    """Where lane t's 8 bytes sit in the first and in the second run of exchange_halves (x is read there)."""
    return 16 * (t % 2) + 8 * (t // 2), 16 * (t % 2) + 8 * (1 - t // 2)


@triton.jit
def halves(v):
    """int64 -> its low and high int32 words."""
    return v.to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def f32_run(ptr, live, COUNT: tl.constexpr):
    """COUNT consecutive f32 at ptr (8-byte aligned, COUNT even) from COUNT / 2 loads of 8 bytes, 0.0 where
    not live: a tuple of COUNT [32 W]."""
    out = ()
    for i in tl.static_range(COUNT // 2):
        lo, hi = halves(tl.load((ptr + 2 * i).to(tl.pointer_type(tl.int64)), mask=live, other=0))
        out = out + (lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True))
    return out


@triton.jit
def byte_words(ptr, NBYTES: tl.constexpr):
    """NBYTES (2, 4 or a multiple of 8) bytes at ptr (aligned to their size, 8 at most) as int32 words."""
    if NBYTES == 2:
        return (tl.load(ptr.to(tl.pointer_type(tl.int16))).to(tl.int32),)
    elif NBYTES == 4:
        return (tl.load(ptr.to(tl.pointer_type(tl.int32))),)
    else:
        out = ()
        for i in tl.static_range(NBYTES // 8):
            out = out + halves(tl.load((ptr + 8 * i).to(tl.pointer_type(tl.int64))))
        return out


@triton.jit
def lane_program(N, blocks_per_split, n_blocks, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """Where each lane works: its rows (group j: top + 16 j and + 8, as the tuple rows[2 j], rows[2 j + 1])
    and those clamped to N - 1 in int64 for the loads; its split's first block and the number of them; g
    and t; its columns of y (2t, 2t + 1; g is its column of x)."""
    R: tl.constexpr = BLOCK_N // (16 * W)
    warp, g, t = lanes(W)
    first = tl.program_id(1) * blocks_per_split
    n_iter = tl.minimum(first + blocks_per_split, n_blocks) - first
    top = tl.program_id(0) * BLOCK_N + warp * (16 * R) + g
    rows = ()
    r64 = ()
    for j in tl.static_range(2 * R):
        rows = rows + (top + 8 * j,)
        r64 = r64 + (tl.minimum(top + 8 * j, N - 1).to(tl.int64),)
    cols = (2 * t, 2 * t + 1)
    return rows, r64, first, n_iter, g, t, cols


@triton.jit
def store_lanes(part_ptr, out_ptr, count_ptr, acc, rows, cols, M: tl.constexpr, N, R: tl.constexpr,
                 SPLIT: tl.constexpr):
    """acc[j] = (top 2t, top 2t + 1, bottom 2t, bottom 2t + 1) of each group j into y (store_split)."""
    values = ()
    index = ()
    live = ()
    for j in tl.static_range(R):
        for h in tl.static_range(2):
            for cc in tl.static_range(min(M, 2)):  # at M = 1 no lane's 2t + 1 is a row of y: its sums are dead code
                values = values + (acc[j][2 * h + cc],)
                index = index + (cols[cc] * N + rows[2 * j + h],)
                live = live + ((cols[cc] < M) & (rows[2 * j + h] < N),)
    store_split(part_ptr, out_ptr, count_ptr, values, index, live, M * N, SPLIT)


@triton.jit
def zero_acc(R: tl.constexpr, W: tl.constexpr):
    acc = ()
    for j in tl.static_range(R):
        z = tl.zeros([32 * W], dtype=tl.float32)
        acc = acc + ((z, z, z, z),)
    return acc


@triton.jit
def scaled(acc, d0, d1, d2, d3, u0, u1, s_top, s_bottom):
    """acc (top 2t, top 2t + 1, bottom 2t, bottom 2t + 1) + each int32 result as f32 times its column's
    u and its row's s."""
    a0, a1, a2, a3 = acc
    return (a0 + s_top * (d0.to(tl.float32) * u0), a1 + s_top * (d1.to(tl.float32) * u1),
            a2 + s_bottom * (d2.to(tl.float32) * u0), a3 + s_bottom * (d3.to(tl.float32) * u1))
