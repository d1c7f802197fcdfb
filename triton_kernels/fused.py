"""The small per-layer operations of a decoder as one launch each: RMSNorm (alone or after the residual
add), rotary embedding, SiLU-mul.

In torch each is a chain of 3-12 elementwise, reduce and index kernels of 1-3 us; on an 8B decode step
they were ~600 launches and a third of the kernel time (docs/PERF.md, 2026-12-03). Each kernel here reads
its inputs once and writes its output once, in f32 arithmetic.

Torch references (the CPU path, and what these are tested against): engine/layers/norm.py RMSNorm
(and h + delta before it), engine/layers/rotary.py RotaryEmbedding, and F.silu(gate) * up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, h_ptr, w_ptr, y_ptr, stride_x, stride_d, stride_y, N, eps,
                     BLOCK: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    """y = norm(x) * w; with ADD, h = x + delta is written first and normed (the residual stream)."""
    pdl.let_next_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    pdl.wait_for_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    if ADD:
        x = x + tl.load(d_ptr + row * stride_d + cols, mask=live, other=0.0)
        tl.store(h_ptr + row * N + cols, x, mask=live)
    x = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(y_ptr + row * stride_y + cols, (x * r * w).to(y_ptr.dtype.element_ty), mask=live)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} takes [T, N] rows with unit stride; got {tuple(x.shape)} {x.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] with unit stride along N (rows may be strided) -> x / sqrt(mean(x^2) + eps) * w, x's type."""
    _check_rows("rms_norm", x)
    T, N = x.shape
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, x, x, weight, y, x.stride(0), 0, y.stride(0), N, eps,
                               BLOCK=triton.next_power_of_2(N), ADD=False, **pdl.launch_args(x.device))
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + delta and rms_norm(h), in one launch: (h [T, N] contiguous, norm [T, N]), both in x's type,
    which delta must share (so that h is exactly torch's x + delta)."""
    _check_rows("add_rms_norm", x)
    _check_rows("add_rms_norm", delta)
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and delta {tuple(delta.shape)} "
                         f"{delta.dtype} differ")
    T, N = x.shape
    h = torch.empty(T, N, dtype=x.dtype, device=x.device)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, delta, h, weight, y, x.stride(0), delta.stride(0), y.stride(0), N, eps,
                               BLOCK=triton.next_power_of_2(N), ADD=True, **pdl.launch_args(x.device))
    return h, y


_ROPE_HEADS = 4  # heads per program


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, H,
                 D: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                 HALF: tl.constexpr, REST: tl.constexpr, PDL: tl.constexpr):
    """Token program_id(0), heads program_id(1) * BLOCK_H onwards: pairs (i, i + ROT/2) (NEOX) or
    (2i, 2i + 1) rotate by the angle of pair i at the token's position; features ROT.. D are copied."""
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, HALF)[None, :]
    live = (h < H) & (i < ROT // 2)
    cos = tl.load(cos_ptr + p * (ROT // 2) + i, mask=i < ROT // 2, other=0.0)
    sin = tl.load(sin_ptr + p * (ROT // 2) + i, mask=i < ROT // 2, other=0.0)
    if NEOX:
        ia = i
        ib = i + ROT // 2
    else:
        ia = 2 * i
        ib = 2 * i + 1
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = y_ptr + (t * H + h) * D
    a = tl.load(src + ia, mask=live, other=0.0).to(tl.float32)
    b = tl.load(src + ib, mask=live, other=0.0).to(tl.float32)
    tl.store(dst + ia, (a * cos - b * sin).to(y_ptr.dtype.element_ty), mask=live)
    tl.store(dst + ib, (b * cos + a * sin).to(y_ptr.dtype.element_ty), mask=live)
    if REST > 0:
        j = ROT + tl.arange(0, REST)[None, :]
        keep = (h < H) & (j < D)
        tl.store(dst + j, tl.load(src + j, mask=keep, other=0.0), mask=keep)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
         neox: bool) -> torch.Tensor:
    """x [T, H, D] (any strides over T and H, unit stride over D), positions [T], cos/sin [max_pos,
    rope_dim / 2] f32 (the angles times the magnitude scale) -> rotated copy [T, H, D], x's type."""
    T, H, D = x.shape
    if x.stride(2) != 1 or rope_dim % 2 or rope_dim > D:
        raise ValueError(f"rope takes [T, H, D] with unit stride over D and an even rope_dim <= D; got "
                         f"{tuple(x.shape)} {x.stride()} rope_dim {rope_dim}")
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        rest = D - rope_dim
        # a few heads per program: one program for a decode token's 40 heads took 8.8 us on an H200 (one
        # SM), a tenth of the launch's data per program spreads it over ten
        block_h = min(triton.next_power_of_2(H), _ROPE_HEADS)
        _rope_kernel[(T, triton.cdiv(H, block_h))](
            x, y, positions, cos.contiguous(), sin.contiguous(), x.stride(0), x.stride(1), H,
            D=D, ROT=rope_dim, NEOX=neox, BLOCK_H=block_h,
            HALF=triton.next_power_of_2(max(rope_dim // 2, 1)), REST=triton.next_power_of_2(rest) if rest else 0,
            **pdl.launch_args(x.device),
        )
    return y


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_x, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * F + cols, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=live)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] (gate then up, unit stride along features) -> silu(gate) * up [T, F]."""
    T, F2 = gate_up.shape
    if F2 % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul takes [T, 2F] with unit feature stride; got {tuple(gate_up.shape)}")
    F = F2 // 2
    y = torch.empty(T, F, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(F))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(F, block))](gate_up, y, gate_up.stride(0), F, BLOCK=block,
                                                      **pdl.launch_args(gate_up.device))
    return y
