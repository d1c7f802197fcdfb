"""y[M, N] = x[M, K] @ W[N, K]^T for a quantized W, dequantized tile by tile in registers.

`dequant_tile` dispatches to the per-type tile dequantizers (tiles_*.py); three kernels share it:
  tile_matvec  M <= 8: the `tiles` kernel of the decode mat-vec (matvec.py), any type and either layout.
          Each program owns BLOCK_N rows and one K split; the weight tile is read once and multiplied by all
          M activation rows in f32 (FMA + row sums). Split-K partials go to a [SPLIT_K, M, N] f32 buffer
          summed afterwards in fixed order (no atomics: the result is the same on every run).
  quant_gemm  (gemm.py) 9 rows up to the tuning file's `dense_from_m` (batched decode, short chunks): the
          tile fed to the matrix units, each weight byte read once per BLOCK_M rows.
  dequantize_dense  from `dense_from_m` rows (prefill, `dense_gemm`): W dequantized into a scratch buffer
          of x's type, then the vendor GEMM (cuBLAS / hipBLAS).
Torch reference: `reference_matmul` (dequantize with the torch references, then x @ W^T in f64/f32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize, spec_for
from vegaserve.triton_kernels.layout import PackedWeight, unpack_to_canonical
from vegaserve.triton_kernels.tiles_legacy import (
    bf16_tile,
    f16_tile,
    f32_tile,
    iq4_nl_tile,
    q4_0_tile,
    q4_1_tile,
    q5_0_tile,
    q5_1_tile,
    q8_0_tile,
)
from vegaserve.triton_kernels.tiles_iq import (
    iq1_m_tile,
    iq1_s_tile,
    iq2_s_tile,
    iq2_xs_tile,
    iq2_xxs_tile,
    iq3_s_tile,
    iq3_xxs_tile,
    iq4_xs_tile,
    table_for,
)
from vegaserve.triton_kernels.tiles_kquants import q4_k_tile, q5_k_tile, q6_k_tile
from vegaserve.triton_kernels.tiles_kquants_low import q2_k_tile, q3_k_tile
from vegaserve.triton_kernels.tiles_mxfp4 import mxfp4_tile

SUPPORTED = frozenset(GGML_TYPES)  # every served type has a tile dequantizer (dequant_tile's ids)


@triton.jit
def dequant_tile(WTYPE: tl.constexpr, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk,
                 BLOCK_N: tl.constexpr, NB: tl.constexpr, tab=None):
    # tab: the lattice table of the IQ1/IQ2/IQ3 types (tiles_iq.table_for), None for the others
    if WTYPE == 8:
        w = q8_0_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 2:
        w = q4_0_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 3:
        w = q4_1_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 6:
        w = q5_0_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 7:
        w = q5_1_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 20:
        w = iq4_nl_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 12:
        w = q4_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 13:
        w = q5_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 14:
        w = q6_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 10:
        w = q2_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 11:
        w = q3_k_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 23:
        w = iq4_xs_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 18:
        w = iq3_xxs_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 21:
        w = iq3_s_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 16:
        w = iq2_xxs_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 17:
        w = iq2_xs_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 22:
        w = iq2_s_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 19:
        w = iq1_s_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 29:
        w = iq1_m_tile(base, tab, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 39:
        w = mxfp4_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 1:
        w = f16_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    elif WTYPE == 30:
        w = bf16_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    else:
        w = f32_tile(base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows, rmask, blk, BLOCK_N, NB)
    return w


@triton.jit
def _matvec_kernel(
    x_ptr, part_ptr, base,  # pointers: activations [M, K], partials [SPLIT_K, M, N] f32, weight bytes
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # weight fields (layout.py)
    N, K, blocks_per_split,  # sizes
    stride_xm, stride_pk,  # strides (x's rows, the partials' splits)
    ids_ptr, expert_bytes,  # EXPERTS: each assignment's expert, the stride between experts' bytes
    WTYPE: tl.constexpr, QK: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,  # meta
    BLOCK_N: tl.constexpr, NB: tl.constexpr, EXPERTS: tl.constexpr = 0, XDIV: tl.constexpr = 1,
    tab_ptr=None,  # the lattice table of the IQ1/IQ2/IQ3 types (tiles_iq.table_for)
):
    # The launcher makes NB divide both the block count and blocks_per_split, so every tile is whole.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if EXPERTS:  # program_id(2) = assignment a: expert ids[a] times row a // XDIV of x, into row a
        a = tl.program_id(2)
        base += tl.load(ids_ptr + a).to(tl.int64) * expert_bytes
        x_ptr += (a // XDIV) * stride_xm
        part_ptr += a * N
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)
    first = pid_k * blocks_per_split
    n_iter = (tl.minimum(first + blocks_per_split, K // QK) - first) // NB
    mcol = tl.arange(0, MP)
    if M == 1:
        # one activation row: accumulate elementwise and reduce across k once, after the loop
        acc1 = tl.zeros([BLOCK_N, NB * QK], dtype=tl.float32)
        for i in range(0, n_iter):
            blk = first + i * NB + tl.arange(0, NB)
            w = dequant_tile(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk, BLOCK_N, NB,
                     tab_ptr)
            x = tl.load(x_ptr + (first + i * NB) * QK + tl.arange(0, NB * QK)).to(tl.float32)
            acc1 += w * x[None, :]
        acc = tl.where(mcol[None, :] == 0, tl.sum(acc1, axis=1)[:, None], 0.0)
    else:
        acc = tl.zeros([BLOCK_N, MP], dtype=tl.float32)
        for i in range(0, n_iter):
            blk = first + i * NB + tl.arange(0, NB)
            w = dequant_tile(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk, BLOCK_N, NB,
                     tab_ptr)
            kk = (first + i * NB) * QK + tl.arange(0, NB * QK)
            for m in tl.static_range(M):
                x = tl.load(x_ptr + m * stride_xm + kk).to(tl.float32)
                s = tl.sum(w * x[None, :], axis=1)
                acc += tl.where(mcol[None, :] == m, s[:, None], 0.0)
    out = part_ptr + pid_k * stride_pk + mcol[None, :] * N + rows[:, None]
    tl.store(out, acc, mask=rmask[:, None] & (mcol[None, :] < M))


@triton.jit
def _dequant_kernel(
    out_ptr, base,  # pointers: dense output [rows, K] (bf16/fp16/f32), weight bytes
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # weight fields
    N, K,  # sizes
    row0, n_rows,  # the window of W's rows written: row0 .. row0 + n_rows - 1, to out's rows 0 .. n_rows - 1
    counts_ptr, expert_bytes,  # EXPERTS: assignments per expert (none: the expert is not read), its stride
    WTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, EXPERTS: tl.constexpr = 0,
    tab_ptr=None,  # the lattice table of the IQ1/IQ2/IQ3 types (tiles_iq.table_for)
):
    local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row0 + local
    live = n_rows
    if EXPERTS:  # program_id(2) = expert e of a stack, into out[e]; skipped where no assignment uses it
        e = tl.program_id(2)
        base += e.to(tl.int64) * expert_bytes
        out_ptr += e.to(tl.int64) * n_rows * K
        live = tl.where(tl.load(counts_ptr + e) > 0, n_rows, 0)
    rmask = (local < live) & (rows < N)
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    w = dequant_tile(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk, BLOCK_N, NB,
                     tab_ptr)
    k = tl.program_id(1) * NB * QK + tl.arange(0, NB * QK)
    tl.store(out_ptr + local[:, None].to(tl.int64) * K + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])


def dequantize_dense(w: PackedWeight, out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                     block_n: int = 16, nb: int = 8, num_warps: int = 4,
                     counts: torch.Tensor | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """W as a dense [N, K] matrix on its device: the scratch operand of the vendor GEMM for long prompts. A
    stack of experts (layout.stack_experts) gives [E, N, K]; with `counts` [E] only the experts with
    assignments are written (the grouped GEMM reads no other). `rows` (first, count): that window of every
    matrix's rows alone, [count, K] (or [E, count, K])."""
    qk = _qk(w.type_id)
    if qk == 1:
        nb = max(nb * 32, 64)
    nb = max(1, nb * 32 // qk) if qk > 32 else nb
    nb = divisor_at_most(w.k // qk, nb)
    row0, n_rows = rows if rows is not None else (0, w.n)
    if not (0 <= row0 and 0 < n_rows and row0 + n_rows <= w.n):
        raise ValueError(f"rows {row0}..{row0 + n_rows - 1} of a matrix of {w.n}")
    stacked = w.expert_bytes > 0
    if out is None:
        out = torch.empty(*((w.experts,) if stacked else ()), n_rows, w.k, dtype=dtype, device=w.data.device)
    grid = (triton.cdiv(n_rows, block_n), w.k // qk // nb) + ((w.experts,) if stacked else ())
    if stacked and counts is None:
        counts = torch.ones(w.experts, dtype=torch.int64, device=w.data.device)
    _dequant_kernel[grid](out, w.data, *w.field_args(), w.n, w.k, row0, n_rows, counts if stacked else out,
                          w.expert_bytes, WTYPE=w.type_id, QK=qk, BLOCK_N=block_n, NB=nb, EXPERTS=int(stacked),
                          tab_ptr=table_for(w.type_id, w.data.device), num_warps=num_warps)
    return out


def row_windows(n: int, k: int, room: int | None, matrices: int = 1) -> list[tuple[int, int]]:
    """(first, count) windows of n rows whose dequantized K columns, for `matrices` matrices at once, fit in
    `room` elements (None: one window of all); a window holds a multiple of 256 rows where it can (the
    vendor GEMM's and the grouped GEMM's tiles stay whole)."""
    if room is None or room >= matrices * n * k:
        return [(0, n)]
    step = room // (matrices * k)
    step = step // 256 * 256 or step
    if step < 1:
        raise ValueError(f"a scratch of {room} elements holds no row of {matrices} x {k} columns")
    return [(r, min(step, n - r)) for r in range(0, n, step)]


def dense_gemm(x: torch.Tensor, w: PackedWeight, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Long prompts: dequantize W into `scratch` (x's dtype) and call the vendor GEMM (cuBLAS / hipBLAS); a
    matrix larger than the scratch goes through it a window of rows at a time."""
    windows = row_windows(w.n, w.k, None if scratch is None else scratch.numel())
    if len(windows) == 1:
        buf = scratch[: w.n * w.k].view(w.n, w.k) if scratch is not None else None
        return x @ dequantize_dense(w, out=buf, dtype=x.dtype).T
    y = torch.empty(x.shape[0], w.n, dtype=x.dtype, device=x.device)
    for r0, n in windows:
        dense = dequantize_dense(w, out=scratch[: n * w.k].view(n, w.k), dtype=x.dtype, rows=(r0, n))
        torch.mm(x, dense.T, out=y[:, r0 : r0 + n])
    return y


def _qk(type_id: int) -> int:
    return spec_for(type_id).block_size


def tile_blocks(n_blocks: int, want: int, ragged: bool = False) -> int:
    """Blocks a tile of a row of n_blocks, at most `want`: the largest power of two that divides the row
    (divisor_at_most), or with `ragged` (a kernel that masks a partial last tile) the largest power of two
    at most want, and at most the row's blocks rounded up to one."""
    if not ragged:
        return divisor_at_most(n_blocks, want)
    return min(1 << max(0, want.bit_length() - 1), triton.next_power_of_2(n_blocks))


def divisor_at_most(n: int, want: int) -> int:
    """The largest power of two <= want that divides n (tiles never straddle the end of a row)."""
    d = 1
    while d * 2 <= want and n % (d * 2) == 0:
        d *= 2
    return d


def tile_matvec(x: torch.Tensor, w: PackedWeight, block_n: int = 32, nb: int = 2, split_k: int = 1,
                num_warps: int = 4, num_stages: int = 2, experts=None) -> torch.Tensor:
    """x [M <= 8, K] (f32/bf16/f16) -> y [M, N] f32. `experts` (matvec_launch.Experts): w a stack of
    experts, y [A, N] the assignments' products, x any number of rows."""
    M, K = x.shape
    if experts is not None:
        if K != w.k or M * experts.x_div != experts.count or w.expert_bytes == 0:
            raise ValueError(f"the tile expert mat-vec: {experts.count} assignments of x {tuple(x.shape)} rows "
                             f"taken {experts.x_div} at a time by a stack of {w.n}x{w.k} experts")
    elif K != w.k or M > 8 or M < 1:
        raise ValueError(f"the tile mat-vec takes 1..8 rows of K={w.k}; got x {tuple(x.shape)}")
    if w.type_id not in SUPPORTED:
        raise ValueError(f"no Triton kernel for {w.type_name} yet")
    if block_n < 8:
        # Triton 3.6 on an H200 returned wrong sums for BLOCK_N 2 and 4 (the interpreter was right)
        raise ValueError(f"the tile mat-vec's block_n must be at least 8, got {block_n}")
    x = x.contiguous()
    nb, per_split, split_k = tile_split(w.type_id, K, nb, split_k)
    rows = experts.count if experts is not None else M
    part = torch.empty(split_k, rows, w.n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(w.n, block_n), split_k) + ((rows,) if experts is not None else ())
    expert_args = (experts.ids, w.expert_bytes) if experts is not None else (x, 0)
    expert_consts = {"EXPERTS": 1, "XDIV": experts.x_div} if experts is not None else {}
    _matvec_kernel[grid](
        x, part, w.data, *w.field_args(), w.n, K, per_split, x.stride(0), rows * w.n, *expert_args,
        **tile_constexprs(w.type_id, 1 if experts is not None else M, block_n, nb), **expert_consts,
        tab_ptr=table_for(w.type_id, w.data.device), num_warps=num_warps, num_stages=num_stages,
    )
    return part[0] if split_k == 1 else part.sum(0)


def tile_split(type_id: int, k: int, nb: int, split_k: int, ragged: bool = False) -> tuple[int, int, int]:
    """A mat-vec's K split of rows of k: (blocks a tile, blocks a split, splits). nb counts 32-element units
    (one super-block for the K-quants; float weights tile max(32 nb, 64) elements); a tile divides the
    row's blocks and a split holds whole tiles. `ragged` (a kernel that masks a last, partial tile): the
    tile is the power of two at most nb (and at most the row's blocks rounded up to one), whether or not it
    divides them; every split but the last holds whole tiles, the last ends in the partial one."""
    qk = _qk(type_id)
    if qk == 1:  # float weights: a "block" is one element
        nb = max(nb * 32, 64)
    nb = max(1, nb * 32 // qk) if qk > 32 else nb
    n_blocks = k // qk
    nb = tile_blocks(n_blocks, nb, ragged)
    per_split = -(-n_blocks // (split_k * nb)) * nb  # a multiple of nb
    return nb, per_split, -(-n_blocks // per_split)


def tile_constexprs(type_id: int, m: int, block_n: int, nb: int) -> dict[str, int]:
    """_matvec_kernel's meta-parameters for m activation rows and tiles of nb blocks (tile_split)."""
    return dict(WTYPE=type_id, QK=_qk(type_id), M=m, MP=max(triton.next_power_of_2(m), 2), BLOCK_N=block_n, NB=nb)


def reference_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """dequant(W) @ x in float64 with the torch reference dequantizers (the ground truth)."""
    dense = dequantize(unpack_to_canonical(w).reshape(-1), w.type_id, (w.n, w.k))
    return (x.double() @ dense.double().T)
