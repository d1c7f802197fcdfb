"""Activations in q8_1, the int8-dot mat-vecs' input (matvec_int8.py): per block of 32 elements, the int8
codes q, the scale d and d * sum(q), as ggml's quantize_row_q8_1 and gguf's Q8_0 quantizer compute them
(d = amax / 127, q = x / d rounded half away from zero).

`quantize_q8_1` is one launch over x; `store_q8_1` (a run of blocks) and `store_q8_1_blocks` (any blocks)
are the same quantization inside another kernel, which writes the q8_1 copy of an output it has just
computed (fused.py: RMSNorm and SiLU-mul; attention_decode.py: the attention's output), so a decode layer
spends no launch on it. Torch reference: `reference_quantize_q8_1`, which gguf.quants' Q8_0 quantizer
matches code for code and scale for scale (tests/triton_kernels/test_matvec_int8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl

Q8_1 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (int8 [M, K], d f32 [M, K / 32], d * sum f32 [M, K / 32])


@triton.jit
def store_q8_1(x, b, q_ptr, d_ptr, s_ptr, n_blocks, BLOCKS: tl.constexpr):
    """Quantize x [BLOCKS * 32] f32, which holds blocks b .. b + BLOCKS - 1 of a row (b a scalar), into that
    row's q8_1 (q_ptr, d_ptr, s_ptr already at the row); blocks at n_blocks and past are not stored."""
    blk = b + tl.arange(0, BLOCKS)
    store_q8_1_blocks(tl.reshape(x, [BLOCKS, 32]), blk, blk < n_blocks, q_ptr, d_ptr, s_ptr)


@triton.jit
def store_q8_1_blocks(xb, blk, live, q_ptr, d_ptr, s_ptr):
    """Quantize the blocks xb [B, 32] f32 into q8_1 block numbers blk [B] of the row at q_ptr, d_ptr,
    s_ptr; blocks where live [B] is false are not stored (a kernel's padding rows)."""
    e = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    d = tl.div_rn(tl.max(tl.abs(xb), axis=1), tl.full([xb.shape[0]], 127.0, tl.float32))
    inv = tl.where(d > 0, tl.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d > 0, d, 1.0)), 0.0)
    v = xb * inv[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(q_ptr + e, q.to(tl.int8), mask=live[:, None])
    tl.store(d_ptr + blk, d, mask=live)
    tl.store(s_ptr + blk, d * tl.sum(q, axis=1), mask=live)


@triton.jit
def _quantize_q8_1_kernel(x_ptr, q_ptr, d_ptr, s_ptr, n_blocks, stride_xm, BLOCKS: tl.constexpr,
                          PDL: tl.constexpr):
    """Row program_id(0), BLOCKS blocks of 32 from program_id(1) * BLOCKS."""
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS
    e = b * 32 + tl.arange(0, BLOCKS * 32)
    x = tl.load(x_ptr + m * stride_xm + e, mask=e < n_blocks * 32, other=0.0).to(tl.float32)
    store_q8_1(x, b, q_ptr + m * n_blocks * 32, d_ptr + m * n_blocks, s_ptr + m * n_blocks, n_blocks, BLOCKS)


def q8_1_buffers(M: int, K: int, device: torch.device) -> Q8_1:
    """Empty q8_1 storage for x [M, K]."""
    if K % 32:
        raise ValueError(f"q8_1 quantizes blocks of 32; K={K}")
    q = torch.empty(M, K, dtype=torch.int8, device=device)
    d = torch.empty(M, K // 32, dtype=torch.float32, device=device)
    return q, d, torch.empty_like(d)


def reference_quantize_q8_1(x: torch.Tensor) -> Q8_1:
    """quantize_q8_1 in torch: the same arithmetic (d = amax / 127 in f32, x times the correctly rounded
    1 / d, rounded half away from zero), on any device."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    v = xb * inv[..., None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v))
    return q.to(torch.int8).reshape(M, K), d, d * q.sum(-1)


def quantize_q8_1(x: torch.Tensor) -> Q8_1:
    """x [M, K] (K a multiple of 32) -> (int8 [M, K], scale f32 [M, K / 32], scale * sum f32 [M, K / 32])."""
    M, K = x.shape
    q, d, s = q8_1_buffers(M, K, x.device)
    x = x.contiguous()
    blocks = 32
    _quantize_q8_1_kernel[(M, triton.cdiv(K // 32, blocks))](
        x, q, d, s, K // 32, x.stride(0), BLOCKS=blocks, **pdl.launch_args(x.device))
    return q, d, s
