"""The mixture-of-experts expert matmuls, one entry point: y[a] = W[ids[a]] x[a // x_div] for the A expert
assignments of a step (a = t * k + j: token t's j-th expert), W a stack of E experts (layout.stack_experts).

  decode   (few tokens, the tuning file's dense_from_m): the decode mat-vec kernel the tuning file names
           for one expert's shape at one row (matvec.py), with one program column per assignment: each
           program reads its expert id on the device and that expert's tiles only, so no host sync and
           only the chosen experts' bytes are read. The expert ids come from the router kernel before it,
           so the kernels wait for it before their first load.
  grouped  (more tokens): the assignments sorted by expert on the device (counts, starts, a stable
           argsort), then one grouped GEMM launch: each program owns BLOCK_M assignments of one expert (each
           expert's run padded to whole blocks: at most A / BLOCK_M + E blocks) and BLOCK_N output columns,
           and writes the rows of its assignments in their original order. Below the tuning file's
           dense_from_m tokens (batched decode) it is the quantized GEMM (gemm.quant_gemm, GROUPED): each
           expert in use read once, dequantized in registers; from there (prefill) the experts in use are
           dequantized into a scratch stack [E, N, K] of x's type first and the launch multiplies that.
Torch reference: `reference_expert_matmul` (each assignment's expert dequantized, float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.dequant import dequantize
from vegaserve.triton_kernels.layout import PackedWeight, expert, unpack_to_canonical
from vegaserve.triton_kernels.gemm import expert_run, gemm_tiles, quant_gemm
from vegaserve.triton_kernels.matmul import dequantize_dense, row_windows
from vegaserve.triton_kernels.matvec import Choice
from vegaserve.triton_kernels.matvec_launch import Experts  # the engine's handle on a layer's assignments
from vegaserve.triton_kernels.q8_1 import Q8_1


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr,  # pointers: x [R, K], experts [E, N, K] (x's type), y [A, N] f32
    order_ptr, counts_ptr, starts_ptr, pstarts_ptr,  # the assignments by expert, and each expert's run
    N, K, n_experts,  # sizes
    stride_xm, stride_ym,  # strides
    XDIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_P2: tl.constexpr, DOT_F32: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # the expert whose padded run holds block m0 (none past the last run: the block stores nothing)
    e, _, a, valid = expert_run(m0, order_ptr, counts_ptr, starts_ptr, pstarts_ptr, n_experts, BLOCK_M, E_P2)
    xrow = (a // XDIV).to(tl.int64)
    w_e = w_ptr + e.to(tl.int64) * N * K
    cmask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        xt = tl.load(x_ptr + xrow[:, None] * stride_xm + kk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_e + cols[None, :].to(tl.int64) * K + kk[:, None], mask=cmask[None, :] & kmask[:, None],
                     other=0.0)
        if DOT_F32:
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc)
    tl.store(y_ptr + a[:, None].to(tl.int64) * stride_ym + cols[None, :], acc, mask=valid[:, None] & cmask[None, :])


def sort_by_expert(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(order [A]: the assignments by expert, stable; counts [E]; starts [E]: each expert's first place in
    order; pstarts [E]: the same with every run padded to whole blocks of block_m), all on the device."""
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    return order, counts, torch.cumsum(counts, 0) - counts, torch.cumsum(padded, 0) - padded


def sorted_runs(experts: Experts, n_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """sort_by_expert of the assignments, made once per (experts, block_m) where `experts` carries a memo."""
    if experts.sorts is None:
        return sort_by_expert(experts.ids, n_experts, block_m)
    key = (n_experts, block_m)
    if key not in experts.sorts:
        experts.sorts[key] = sort_by_expert(experts.ids, n_experts, block_m)
    return experts.sorts[key]


def grouped_quant_gemm(x: torch.Tensor, w: PackedWeight, experts: Experts, block_n: int = 64) -> torch.Tensor:
    """The grouped path on the quantized stack: x [R, K] (bf16/fp16, or f32 with IEEE products) -> y [A, N]
    f32, each expert in use read once per BLOCK_M of its assignments: BLOCK_M the power of two (16 to 64)
    holding an expert's share of the assignments were they spread evenly; tiles and stages as
    gemm.gemm_tiles gives them for the type, no K split (the experts in use fill the grid)."""
    A = experts.count
    block_m = min(64, max(16, triton.next_power_of_2(-(-A // w.experts))))
    order, counts, starts, pstarts = sorted_runs(experts, w.experts, block_m)
    return quant_gemm(x, w, block_m=block_m, block_n=block_n, **gemm_tiles(w.type_id),
                      grouped=(order, counts, starts, pstarts, experts.x_div, A))


def grouped_gemm(x: torch.Tensor, w: PackedWeight, experts: Experts, block_m: int = 64, block_n: int = 64,
                 block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped path: x [R, K] (bf16/fp16, or f32 with IEEE products for exact checks) -> y [A, N] f32.
    `scratch`: room for the dequantized stack; a stack larger than it is dequantized and multiplied a window
    of every expert's rows at a time (row_windows)."""
    A = experts.count
    order, counts, starts, pstarts = sorted_runs(experts, w.experts, block_m)
    x = x.contiguous()
    y = torch.empty(A, w.n, dtype=torch.float32, device=x.device)
    for r0, n in row_windows(w.n, w.k, None if scratch is None else scratch.numel(), w.experts):
        buf = scratch[: w.experts * n * w.k].view(w.experts, n, w.k) if scratch is not None else None
        dense = dequantize_dense(w, out=buf, dtype=x.dtype, counts=counts, rows=(r0, n))
        out = y[:, r0:]  # the window's columns of y: its pointer, y's row stride
        grid = (triton.cdiv(A, block_m) + w.experts, triton.cdiv(n, block_n))
        _grouped_gemm_kernel[grid](
            x, dense, out, order, counts, starts, pstarts, n, w.k, w.experts, x.stride(0), y.stride(0),
            XDIV=experts.x_div, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            E_P2=triton.next_power_of_2(w.experts), DOT_F32=x.dtype == torch.float32,
            num_warps=num_warps, num_stages=num_stages,
        )
    return y


def expert_matmul(x: torch.Tensor, w: PackedWeight, experts: Experts, choice: Choice, grouped: bool,
                  q8_1: Q8_1 | None = None, scratch: torch.Tensor | None = None, quant: bool = False) -> torch.Tensor:
    """y [A, N] f32 = each assignment's expert times its row of x: the decode kernel `choice` (matvec.choose
    of one expert at one row) with a program column per assignment, or where `grouped` the grouped GEMM on
    x in the scratch's type (the layer's prefill GEMM type), on the quantized experts where `quant`."""
    if grouped:
        dtype = scratch.dtype if scratch is not None else torch.bfloat16
        if quant:
            return grouped_quant_gemm(x.to(dtype), w, experts)
        return grouped_gemm(x.to(dtype), w, experts, scratch=scratch)
    if choice.kernel.name == "lanes":
        raise ValueError("the lanes kernel takes several rows of x a weight; an expert assignment is one")
    return choice.kernel.launch(x, w, choice.params, q8_1, None, experts)


def reference_expert_matmul(x: torch.Tensor, w: PackedWeight, experts: Experts) -> torch.Tensor:
    """Float64 [A, N]: each assignment's expert dequantized by the torch references, times its row of x."""
    ids = experts.ids.tolist()
    out = []
    for a, e in enumerate(ids):
        one = expert(w, e)
        dense = dequantize(unpack_to_canonical(one).reshape(-1).cpu(), w.type_id, (w.n, w.k)).double()
        out.append(dense @ x[a // experts.x_div].double().cpu())
    return torch.stack(out)
