"""The quantized GEMM: y[M, N] = x[M, K] @ W[N, K]^T for 9 rows of x up to the tuning file's `dense_from_m`
(batched decode, short prompt chunks), W in any served type and either layout, y f32.

Each program owns BLOCK_N weight rows, BLOCK_M rows of x and one K split. A weight tile is dequantized in
registers by the type's tile function (matmul.dequant_tile, shared with the decode mat-vec and the dense
dequantizer) once per BLOCK_M rows of x and fed to the matrix units as the left operand (tl.dot on x's type:
bf16 / fp16, f32 with IEEE products for the exact checks), the weight rows on the instruction's M side, so at
up to BLOCK_M rows every weight byte is read once. Q4_K can instead take a product a sub-block, its codes
straight from the nibbles in k order (SUB, _q4_k_subblocks: no interleaving of a chunk's two runs), which the
rule picks where it measured faster. Split-K partials go to a [SPLIT_K, M, N] f32 buffer summed
in fixed order. The mixture-of-experts grouped GEMM (moe.py) is this kernel with its rows taken from one
expert's run of assignments (GROUPED). Launch parameters: the tuning file's `gemm` table over `gemm_rule`.
Torch reference: matmul.reference_matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.dequant import GGMLType, spec_for
from vegaserve.triton_kernels.flat_words import q4_k_scale_min
from vegaserve.triton_kernels.layout import PackedWeight
from vegaserve.triton_kernels.matmul import SUPPORTED, dequant_tile, tile_split
from vegaserve.triton_kernels.tiles_iq import table_for


@triton.jit
def expert_run(m0, order_ptr, counts_ptr, starts_ptr, pstarts_ptr, n_experts, BLOCK_M: tl.constexpr,
               E_P2: tl.constexpr):
    """The grouped GEMMs' rows (moe.sort_by_expert's runs): (expert e whose padded run holds block m0, its
    assignment count (0 past the last run), the block's assignments a [BLOCK_M], valid [BLOCK_M])."""
    e_all = tl.arange(0, E_P2)
    live_e = e_all < n_experts
    count_all = tl.load(counts_ptr + e_all, mask=live_e, other=0)
    pstart_all = tl.load(pstarts_ptr + e_all, mask=live_e, other=0)
    hit = live_e & (pstart_all <= m0) & (m0 < pstart_all + (count_all + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    e = tl.sum(tl.where(hit, e_all, 0))
    count = tl.sum(tl.where(hit, count_all, 0))
    local = m0 - tl.sum(tl.where(hit, pstart_all, 0)) + tl.arange(0, BLOCK_M)
    valid = local < count
    a = tl.load(order_ptr + tl.load(starts_ptr + e) + local, mask=valid, other=0)
    return e, count, a, valid


@triton.jit
def _q4_k_subblocks(acc, base, o0, r0, b0, o2, r2, b2, rows64, rmask, blk, x_ptr, xrow, valid, stride_xm,
                    DOT_F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus Q4_K super-block `blk` of the rows times x's 256 elements there, a product
    of 32 elements a sub-block: sub-block 2c is the low nibbles of the quants' 32-byte chunk c and 2c + 1 its
    high nibbles, so each sub-block's codes come straight from one load in k order (the super-block tile
    interleaves the two runs through shared memory). The head record (d, dmin, the 12 scale bytes) is four
    words at field 0 in both layouts. Values as q4_k_tile's: q * (d sc) - dmin m."""
    hp = (base + o0 + rows64 * r0 + blk * b0).to(tl.pointer_type(tl.int32))
    dm = tl.load(hp, mask=rmask, other=0)
    sa = tl.load(hp + 1, mask=rmask, other=0)
    sb = tl.load(hp + 2, mask=rmask, other=0)
    scw = tl.load(hp + 3, mask=rmask, other=0)
    d = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dm >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    qp = base + o2 + rows64 * r2 + blk * b2
    j = tl.arange(0, 32)
    xp = x_ptr + xrow[:, None] * stride_xm + blk.to(tl.int64) * 256 + j[None, :]
    for c in tl.static_range(4):
        q = tl.load(qp[:, None] + 32 * c + j[None, :], mask=rmask[:, None], other=0)
        for h in tl.static_range(2):
            sc, mn = q4_k_scale_min(sa, sb, scw, 2 * c + h)
            codes = q & 15 if h == 0 else q >> 4
            w = codes.to(tl.float32) * (d * sc.to(tl.float32))[:, None] - (dmin * mn.to(tl.float32))[:, None]
            xt = tl.load(xp + 32 * (2 * c + h), mask=valid[:, None], other=0.0)
            if DOT_F32:
                acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), tl.trans(xt), acc)
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr, y_ptr, base,  # pointers: activations [R, K], output [SPLIT_K, rows, N] f32, weight bytes
    o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3,  # weight fields (layout.py)
    M, N, K, blocks_per_split,  # sizes (M: x's rows; GROUPED: the assignments)
    stride_xm, stride_ym, stride_ys,  # strides (x's rows, y's rows, y's splits)
    order_ptr, counts_ptr, starts_ptr, pstarts_ptr, n_experts, expert_bytes,  # GROUPED: moe.sort_by_expert
    WTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
    GROUPED: tl.constexpr = 0, XDIV: tl.constexpr = 1, E_P2: tl.constexpr = 1, DOT_F32: tl.constexpr = 0,
    SUB: tl.constexpr = 0,  # Q4_K a super-block an iteration, a product a sub-block (_q4_k_subblocks)
    tab_ptr=None,  # the lattice table of the IQ1/IQ2/IQ3 types (tiles_iq.table_for)
):
    # program_id(0): a block of BLOCK_M rows of x (GROUPED: of one expert's padded run of assignments),
    # program_id(1): BLOCK_N weight rows, program_id(2): a K split of whole tiles
    m0 = tl.program_id(0) * BLOCK_M
    first = tl.program_id(2) * blocks_per_split
    n_iter = (tl.minimum(first + blocks_per_split, K // QK) - first) // NB
    if GROUPED:  # one expert's run of assignments (none past the last run: nothing is read)
        e, count, yrow, valid = expert_run(m0, order_ptr, counts_ptr, starts_ptr, pstarts_ptr, n_experts, BLOCK_M,
                                           E_P2)
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
        if SUB:
            acc = _q4_k_subblocks(acc, base, o0, r0, b0, o2, r2, b2, rows64, rmask, first + i, x_ptr, xrow, valid,
                                  stride_xm, DOT_F32)
        else:
            blk = first + i * NB + tl.arange(0, NB)
            w = dequant_tile(WTYPE, base, o0, r0, b0, o1, r1, b1, o2, r2, b2, o3, r3, b3, rows64, rmask, blk, BLOCK_N,
                             NB, tab_ptr)
            kk = (first + i * NB) * QK + tl.arange(0, NB * QK)
            xt = tl.load(x_ptr + xrow[:, None] * stride_xm + kk[None, :], mask=valid[:, None], other=0.0)
            if DOT_F32:
                acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), tl.trans(xt), acc)
    out = y_ptr + tl.program_id(2) * stride_ys + yrow[None, :].to(tl.int64) * stride_ym + rows[:, None]
    tl.store(out, acc, mask=rmask[:, None] & valid[None, :])


GEMM_PARAMETERS = frozenset({"block_m", "block_n", "nb", "split_k", "num_warps", "num_stages", "sub"})


def gemm_rule(type_id: int, n: int, k: int, m: int, sms: int) -> dict[str, int]:
    """quant_gemm's launch parameters where the tuning file has no entry: all m rows in one block (16 to 64);
    128 weight rows a program where that grid alone holds 1.5 programs an SM, else 64 rows and K split in up
    to 4 while the grid holds fewer than 8 programs an SM; tiles of one super-block for the 256-element
    types, of 64 elements for the others with three stages. The best or within 11% of it on an H100 at
    16-128 rows on the Llama-3-8B shapes (the kernel is register-bound at two programs an SM, so small
    tiles, split K and pipelined loads are what feed it). Q4_K on the wide grid at 33-64 rows: a product a
    sub-block (`sub`): 93.2 against 103.0 us at 64 rows and 90.3 against 102.7 at 40 on 28672x4096 (H200,
    the same launch otherwise; its prototype 80.8 against 103.3 us at 64 rows on an H100).
    On the narrower Llama-3-8B shapes it was within 5% (slower at 16 rows on 6144x4096); at 16 rows on
    28672x4096 it was fastest with x on the M side and K split in two (62.0 against 84.0 us), a launch this
    kernel does not have, and with this launch not among the eight fastest."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    m_blocks = triton.cdiv(m, block_m)
    params = {"block_m": block_m, "block_n": 64, **gemm_tiles(type_id), "split_k": 1, "num_warps": 4}
    if m_blocks * triton.cdiv(n, 128) * 2 >= 3 * sms:
        sub = {"sub": 1} if type_id == GGMLType.Q4_K and m_blocks == 1 and block_m == 64 else {}
        return {**params, "block_n": 128, "nb": 8, "num_stages": 2, **sub}
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
                         f"at {m} rows sets {', '.join(sorted(unknown))}; "
                         f"the GEMM takes {', '.join(sorted(GEMM_PARAMETERS))}")
    return {**gemm_rule(w.type_id, w.n, w.k, m, sms), **entry}


def quant_gemm(x: torch.Tensor, w: PackedWeight, block_m: int = 64, block_n: int = 64, nb: int = 8,
               split_k: int = 1, num_warps: int = 4, num_stages: int = 2, grouped=None, sub: int = 0) -> torch.Tensor:
    """x [M, K] (bf16/fp16, or f32 with IEEE products) -> y [M, N] f32, W dequantized tile by tile in
    registers. `grouped` (order, counts, starts, pstarts, x_div, count): w a stack of experts and y [count,
    N] each assignment's expert times its row of x (moe.grouped_quant_gemm sorts them). nb counts 32-element
    units, as tile_split's. sub 1 (Q4_K, tiles of one super-block): a product a sub-block (_q4_k_subblocks)."""
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
    if sub and (w.type_id != GGMLType.Q4_K or nb != 1):
        raise ValueError(f"the GEMM's product a sub-block is Q4_K's with tiles of one super-block (nb 8); got "
                         f"{w.type_name} with nb {nb * _qk(w.type_id) // 32}")
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
            DOT_F32=int(x.dtype == torch.float32), SUB=int(bool(sub)), **group_consts,
            tab_ptr=table_for(w.type_id, w.data.device),
            num_warps=num_warps, num_stages=num_stages,
        )
    return y[0] if split_k == 1 else y.sum(0)


def _qk(type_id: int) -> int:
    return spec_for(type_id).block_size
