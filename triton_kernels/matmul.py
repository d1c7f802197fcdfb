"""y[M, N] = x[M, K] @ W[N, K]^T for a quantized W, dequantized tile by tile in registers.

Three kernels share the per-type tile dequantizers (tiles_*.py):
  tile_matvec  M <= 8: the `tiles` kernel of the decode mat-vec (matvec.py), any type and either layout.
          Each program owns BLOCK_N rows and one K split; the weight tile is read once and multiplied by all
          M activation rows in f32 (FMA + row sums). Split-K partials go to a [SPLIT_K, M, N] f32 buffer
          summed afterwards in fixed order (no atomics: the result is the same on every run).
  quant_gemm  9 rows up to the tuning file's `dense_from_m` (batched decode, short chunks): each program
          owns BLOCK_N weight rows, BLOCK_M rows of x and one K split; a weight tile is dequantized in
          registers once per BLOCK_M rows of x and fed to the matrix units (tl.dot, x's type: bf16 / fp16,
          f32 with IEEE products for the exact checks), so at up to BLOCK_M rows every weight byte is read
          once. Split-K as tile_matvec's. The mixture-of-experts grouped GEMM (moe.py) is this kernel with
          its rows taken from one expert's run of assignments (GROUPED).
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
def _gemm_kernel(
    x_ptr, y_ptr, base,  # pointers: activations [R, K], output [SPLIT_K, rows, N] f32, weight bytes
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # weight fields (layout.py)
    M, N, K, blocks_per_split,  # sizes (M: x's rows; GROUPED: the assignments)
    stride_xm, stride_ym, stride_ys,  # strides (x's rows, y's rows, y's splits)
    order_ptr, counts_ptr, starts_ptr, pstarts_ptr, n_experts, expert_bytes,  # GROUPED: moe.sort_by_expert
    WTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
    GROUPED: tl.constexpr = 0, XDIV: tl.constexpr = 1, E_P2: tl.constexpr = 1, DOT_F32: tl.constexpr = 0,
    tab_ptr=None,  # the lattice table of the IQ1/IQ2/IQ3 types (tiles_iq.table_for)
):
    # program_id(0): a block of BLOCK_M rows of x (GROUPED: of one expert's padded run of assignments),
    # program_id(1): BLOCK_N weight rows, program_id(2): a K split of whole tiles
    m0 = tl.program_id(0) * BLOCK_M
    first = tl.program_id(2) * blocks_per_split
    n_iter = (tl.minimum(first + blocks_per_split, K // QK) - first) // NB
    if GROUPED:  # the expert whose padded run holds block m0 (none past the last run: nothing is read)
        e_all = tl.arange(0, E_P2)
        live_e = e_all < n_experts
        count_all = tl.load(counts_ptr + e_all, mask=live_e, other=0)
        pstart_all = tl.load(pstarts_ptr + e_all, mask=live_e, other=0)
        hit = live_e & (pstart_all <= m0) & (m0 < pstart_all + (count_all + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        e = tl.sum(tl.where(hit, e_all, 0))
        count = tl.sum(tl.where(hit, count_all, 0))
        local = m0 - tl.sum(tl.where(hit, pstart_all, 0)) + tl.arange(0, BLOCK_M)
        valid = local < count
        yrow = tl.load(order_ptr + tl.load(starts_ptr + e) + local, mask=valid, other=0)
        xrow = yrow // XDIV
        base += e.to(tl.int64) * expert_bytes
        n_iter = tl.where(count > 0, n_iter, 0)
    else:
        yrow = m0 + tl.arange(0, BLOCK_M)
        valid = yrow < M
        xrow = tl.where(valid, yrow, 0)
    xrow = xrow.to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T: the weight rows fill the matrix unit's M side
    for i in range(0, n_iter):
        blk = first + i * NB + tl.arange(0, NB)
        w = dequant_tile(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk, BLOCK_N, NB,
                         tab_ptr)
        kk = (first + i * NB) * QK + tl.arange(0, NB * QK)
        xt = tl.load(x_ptr + xrow[:, None] * stride_xm + kk[None, :], mask=valid[:, None], other=0.0)
        if DOT_F32:
            acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(xt.dtype), tl.trans(xt), acc)
    out = y_ptr + tl.program_id(2) * stride_ys + yrow[None, :].to(tl.int64) * stride_ym + rows[:, None]
    tl.store(out, acc, mask=rmask[:, None] & valid[None, :])


GEMM_PARAMETERS = frozenset({"block_m", "block_n", "nb", "split_k", "num_warps", "num_stages"})


def gemm_rule(type_id: int, n: int, k: int, m: int, sms: int) -> dict[str, int]:
    """quant_gemm's launch parameters where the tuning file has no entry: all m rows in one block (16 to 64);
    128 weight rows a program where that grid alone holds 1.5 programs an SM, else 64 rows and K split in up
    to 4 while the grid holds fewer than 8 programs an SM; tiles of one super-block for the 256-element
    types, of 64 elements for the others with three stages. The best or within 10% of it on an H100 at
    16-128 rows on the Llama-3-8B shapes (the kernel is register-bound at two programs an SM, so small
    tiles, split K and pipelined loads are what feed it)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, block_m)
    params = {"block_m": block_m, "block_n": 64, **gemm_tiles(type_id), "split_k": 1, "num_warps": 4}
    if m_blocks * triton.cdiv(n, 128) * 2 >= 3 * sms:
        return {**params, "block_n": 128, "nb": 8, "num_stages": 2}
    nb, _, _ = tile_split(type_id, k, params["nb"], 1)
    tiles = k // _qk(type_id) // nb
    while params["split_k"] < 4 and m_blocks * triton.cdiv(n, 64) * params["split_k"] < 8 * sms \
            and tiles >= 4 * params["split_k"]:
        params["split_k"] *= 2
    return params


def gemm_tiles(type_id: int) -> dict[str, int]:
    """The GEMM's tile (nb, in 32-element units) and pipeline stages of a type: one super-block, two stages
    for the 256-element types; 64 elements, three stages for the others."""
    return {"nb": 8, "num_stages": 2} if _qk(type_id) > 32 else {"nb": 2, "num_stages": 3}


def gemm_params(w: PackedWeight, m: int, tuning, sms: int) -> dict[str, int]:
    """The tuning file's `gemm` entry for w at m rows over the rule; an entry naming a parameter the
    launcher does not take is refused (it would be ignored without a word)."""
    entry = tuning.gemm(w.type_name, w.n, w.k, m)
    unknown = set(entry) - GEMM_PARAMETERS
    if unknown:
        raise ValueError(f"tuning file {tuning.file or tuning.target}: the {w.type_name} {w.n}x{w.k} gemm entry "
                         f"at {m} rows sets {', '.join(sorted(unknown))}; the GEMM takes {', '.join(sorted(GEMM_PARAMETERS))}")
    return {**gemm_rule(w.type_id, w.n, w.k, m, sms), **entry}


def quant_gemm(x: torch.Tensor, w: PackedWeight, block_m: int = 64, block_n: int = 64, nb: int = 8,
               split_k: int = 1, num_warps: int = 4, num_stages: int = 2, grouped=None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, or f32 with IEEE products) -> y [M, N] f32, W dequantized tile by tile in
    registers. `grouped` (order, counts, starts, pstarts, x_div, count): w a stack of experts and y [count,
    N] each assignment's expert times its row of x (moe.grouped_gemm sorts them). nb counts 32-element
    units, as tile_split's."""
    M, K = x.shape
    if K != w.k or (grouped is None and w.expert_bytes):
        raise ValueError(f"the quantized GEMM takes x [M, {w.k}] and one matrix; got x {tuple(x.shape)}")
    if w.type_id not in SUPPORTED:
        raise ValueError(f"no Triton kernel for {w.type_name} yet")
    if min(block_m, block_n) < 16:
        raise ValueError(f"the quantized GEMM's blocks are at least 16 rows (the matrix units' size), got "
                         f"block_m {block_m}, block_n {block_n}")
    x = x.contiguous()
    nb, per_split, split_k = tile_split(w.type_id, K, nb, split_k)
    rows = grouped[5] if grouped is not None else M
    y = torch.empty(split_k, rows, w.n, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(rows, block_m) + (w.experts if grouped is not None else 0)
    grid = (m_blocks, triton.cdiv(w.n, block_n), split_k)
    if grouped is not None:
        order, counts, starts, pstarts, x_div, _ = grouped
        group_args = (order, counts, starts, pstarts, w.experts, w.expert_bytes)
        group_consts = {"GROUPED": 1, "XDIV": x_div, "E_P2": triton.next_power_of_2(w.experts)}
    else:
        group_args, group_consts = (x, x, x, x, 0, 0), {}
    if rows:
        _gemm_kernel[grid](
            x, y, w.data, *w.field_args(), M, w.n, K, per_split, x.stride(0), w.n, rows * w.n, *group_args,
            WTYPE=w.type_id, QK=_qk(w.type_id), BLOCK_M=block_m, BLOCK_N=block_n, NB=nb,
            DOT_F32=int(x.dtype == torch.float32), **group_consts, tab_ptr=table_for(w.type_id, w.data.device),
            num_warps=num_warps, num_stages=num_stages,
        )
    return y[0] if split_k == 1 else y.sum(0)


@triton.jit
def _dequant_kernel(
    out_ptr, base,  # pointers: dense output [N, K] (bf16/fp16/f32), weight bytes
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # weight fields
    N, K,  # sizes
    counts_ptr, expert_bytes,  # EXPERTS: assignments per expert (none: the expert is not read), its stride
    WTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, EXPERTS: tl.constexpr = 0,
    tab_ptr=None,  # the lattice table of the IQ1/IQ2/IQ3 types (tiles_iq.table_for)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_rows = N
    if EXPERTS:  # program_id(2) = expert e of a stack, into out[e]; skipped where no assignment uses it
        e = tl.program_id(2)
        base += e.to(tl.int64) * expert_bytes
        out_ptr += e.to(tl.int64) * N * K
        live_rows = tl.where(tl.load(counts_ptr + e) > 0, N, 0)
    rmask = rows < live_rows
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    w = dequant_tile(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk, BLOCK_N, NB,
                     tab_ptr)
    k = tl.program_id(1) * NB * QK + tl.arange(0, NB * QK)
    tl.store(out_ptr + rows64[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def dequantize_dense(w: PackedWeight, out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                     block_n: int = 16, nb: int = 8, num_warps: int = 4,
                     counts: torch.Tensor | None = None) -> torch.Tensor:
    """W as a dense [N, K] matrix on its device: the scratch operand of the vendor GEMM for long prompts. A
    stack of experts (layout.stack_experts) gives [E, N, K]; with `counts` [E] only the experts with
    assignments are written (the grouped GEMM reads no other)."""
    qk = _qk(w.type_id)
    if qk == 1:
        nb = max(nb * 32, 64)
    nb = max(1, nb * 32 // qk) if qk > 32 else nb
    nb = divisor_at_most(w.k // qk, nb)
    stacked = w.expert_bytes > 0
    if out is None:
        out = torch.empty(*((w.experts,) if stacked else ()), w.n, w.k, dtype=dtype, device=w.data.device)
    grid = (triton.cdiv(w.n, block_n), w.k // qk // nb) + ((w.experts,) if stacked else ())
    if stacked and counts is None:
        counts = torch.ones(w.experts, dtype=torch.int64, device=w.data.device)
    _dequant_kernel[grid](out, w.data, *w.field_args(), w.n, w.k, counts if stacked else out, w.expert_bytes,
                          WTYPE=w.type_id, QK=qk, BLOCK_N=block_n, NB=nb, EXPERTS=int(stacked),
                          tab_ptr=table_for(w.type_id, w.data.device), num_warps=num_warps)
    return out


def dense_gemm(x: torch.Tensor, w: PackedWeight, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Long prompts: dequantize W into `scratch` (x's dtype) and call the vendor GEMM (cuBLAS / hipBLAS)."""
    n_el = w.n * w.k
    buf = scratch[:n_el].view(w.n, w.k) if scratch is not None and scratch.numel() >= n_el else None
    dense = dequantize_dense(w, out=buf, dtype=x.dtype)
    return x @ dense.T


def _qk(type_id: int) -> int:
    return spec_for(type_id).block_size


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


def tile_split(type_id: int, k: int, nb: int, split_k: int) -> tuple[int, int, int]:
    """A mat-vec's K split of rows of k: (blocks a tile, blocks a split, splits). nb counts 32-element units
    (one super-block for the K-quants; float weights tile max(32 nb, 64) elements); a tile divides the
    row's blocks and a split holds whole tiles."""
    qk = _qk(type_id)
    if qk == 1:  # float weights: a "block" is one element
        nb = max(nb * 32, 64)
    nb = max(1, nb * 32 // qk) if qk > 32 else nb
    n_blocks = k // qk
    nb = divisor_at_most(n_blocks, nb)
    per_split = -(-n_blocks // (split_k * nb)) * nb  # a multiple of nb
    return nb, per_split, -(-n_blocks // per_split)


def tile_constexprs(type_id: int, m: int, block_n: int, nb: int) -> dict[str, int]:
    """_matvec_kernel's meta-parameters for m activation rows and tiles of nb blocks (tile_split)."""
    return dict(WTYPE=type_id, QK=_qk(type_id), M=m, MP=max(triton.next_power_of_2(m), 2), BLOCK_N=block_n, NB=nb)


def reference_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """dequant(W) @ x in float64 with the torch reference dequantizers (the ground truth)."""
    dense = dequantize(unpack_to_canonical(w).reshape(-1), w.type_id, (w.n, w.k))
    return (x.double() @ dense.double().T)
