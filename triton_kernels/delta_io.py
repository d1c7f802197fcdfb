"""The small operations around a gated DeltaNet layer's delta rule (engine/layers/delta_net.py), one launch
each where torch takes a dozen elementwise and reduce launches:

  inputs   from the convolution's output y [T, C] (q | k | v channels) and the in-projection's rows p
           (its beta and alpha columns, at `gate_cols` [2, HV]): q and k [T, HK, D] f32, each head
           l2-normalized (q also scaled by 1 / sqrt(D)); beta = sigmoid(b) and the log decay
           g = a_h softplus(alpha + dt_h) [T, HV] f32, as delta_rule.py takes them.
  output   the rule's output o [T, HV, D] f32 through the gated RMSNorm of each head,
           o / sqrt(mean(o^2) + eps) w silu(z), into [T, HV D] (+ its q8_1 copy for the out-projection's
           int8 kernel where asked).

Torch references (the CPU path): GatedDeltaNet._qkv and the gate lines of its forward, and the tail of its
forward (`reference_inputs`, `reference_output` here are the same formulas, for the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.q8_1 import Q8_1, q8_1_buffers, store_q8_1

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's: past it softplus(x) is x


@triton.jit
def _inputs_kernel(y_ptr, p_ptr, cols_ptr, a_ptr, dt_ptr, q_ptr, k_ptr, g_ptr, beta_ptr, stride_y, stride_p, eps,
                   scale, HK: tl.constexpr, HV: tl.constexpr, HV_P2: tl.constexpr, D: tl.constexpr,
                   PDL: tl.constexpr):
    """Row program_id(0); head program_id(1) of q's HK then k's HK (and the row's gates in program 0)."""
    pdl.let_next_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, D)
    pdl.wait_for_inputs(PDL)
    x = tl.load(y_ptr + t * stride_y + j * D + d).to(tl.float32)  # q's heads, then k's (channels key_dim on)
    x = x / tl.sqrt(tl.sum(x * x, 0) + eps)
    if j < HK:
        tl.store(q_ptr + (t * HK + j) * D + d, x * scale)
    else:
        tl.store(k_ptr + (t * HK + j - HK) * D + d, x)
    if j == 0:
        h = tl.arange(0, HV_P2)
        live = h < HV
        b = tl.load(p_ptr + t * stride_p + tl.load(cols_ptr + h, mask=live, other=0), mask=live, other=0.0)
        al = tl.load(p_ptr + t * stride_p + tl.load(cols_ptr + HV + h, mask=live, other=0), mask=live, other=0.0)
        s = al.to(tl.float32) + tl.load(dt_ptr + h, mask=live, other=0.0)
        # softplus as torch computes it: s past the threshold, else log1p(exp(s)); log1p(e) as log(u) e / (u - 1)
        # with u = 1 + e rounded, exact to a few ulps where log(1 + e) alone loses e's low bits
        e = tl.exp(tl.minimum(s, SOFTPLUS_THRESHOLD))
        u = 1.0 + e
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        sp = tl.where(s > SOFTPLUS_THRESHOLD, s, sp)
        tl.store(g_ptr + t * HV + h, tl.load(a_ptr + h, mask=live, other=0.0) * sp, mask=live)
        tl.store(beta_ptr + t * HV + h, 1.0 / (1.0 + tl.exp(-b.to(tl.float32))), mask=live)


def inputs(y: torch.Tensor, p: torch.Tensor, gate_cols: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
           hk: int, d: int, eps: float) -> tuple[torch.Tensor, ...]:
    """y [T, C] (unit stride over C: q's HK heads of d, then k's, then v's), p [T, P] (the in-projection's
    output, unit stride), gate_cols [2, HV] int32 (b's and alpha's columns of p for each value head), ssm_a
    and dt_bias [HV] f32 -> (q, k [T, HK, d] f32, g, beta [T, HV] f32)."""
    T = y.shape[0]
    HV = gate_cols.shape[1]
    if (y.stride(1) != 1 or p.stride(1) != 1 or p.shape[0] != T or y.shape[1] < 2 * hk * d
            or gate_cols.shape != (2, HV) or ssm_a.shape != (HV,) or dt_bias.shape != (HV,) or d & (d - 1)):
        raise ValueError(f"delta inputs: y {tuple(y.shape)}, p {tuple(p.shape)}, gate columns "
                         f"{tuple(gate_cols.shape)}, {hk} key heads of {d}")
    q = torch.empty(T, hk, d, dtype=torch.float32, device=y.device)
    k = torch.empty_like(q)
    g = torch.empty(T, HV, dtype=torch.float32, device=y.device)
    beta = torch.empty_like(g)
    if T:
        _inputs_kernel[(T, 2 * hk)](y, p, gate_cols, ssm_a, dt_bias, q, k, g, beta, y.stride(0), p.stride(0), eps,
                                    d ** -0.5, HK=hk, HV=HV, HV_P2=triton.next_power_of_2(HV), D=d,
                                    **pdl.launch_args(y.device))
    return q, k, g, beta


@triton.jit
def _output_kernel(o_ptr, z_ptr, w_ptr, y_ptr, q_ptr, qd_ptr, qs_ptr, stride_z, eps, HV: tl.constexpr,
                   D: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0), value head program_id(1): its D outputs normed, scaled and gated."""
    pdl.let_next_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    w = tl.load(w_ptr + d)
    pdl.wait_for_inputs(PDL)
    o = tl.load(o_ptr + (t * HV + h) * D + d)
    z = tl.load(z_ptr + t * stride_z + h * D + d).to(tl.float32)
    y = o / tl.sqrt(tl.sum(o * o, 0) / D + eps) * w * (z / (1.0 + tl.exp(-z)))
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * (HV * D) + h * D + d, y)
    if Q8:
        n = HV * D
        store_q8_1(y.to(tl.float32), h * (D // 32), q_ptr + t * n, qd_ptr + t * (n // 32), qs_ptr + t * (n // 32),
                   n // 32, D // 32)


def output(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
           q8_1: bool = False) -> tuple[torch.Tensor, Q8_1 | None]:
    """o [T, HV, D] f32 contiguous, z [T, HV D] (unit stride), weight [D] f32 -> (the gated RMSNorm of each
    head [T, HV D] in `dtype`, its q8_1 where asked (D a multiple of 32), else None)."""
    T, HV, D = o.shape
    if (o.dtype != torch.float32 or not o.is_contiguous() or z.shape != (T, HV * D) or z.stride(1) != 1
            or weight.shape != (D,) or D & (D - 1) or (q8_1 and D % 32)):
        raise ValueError(f"delta output: o {tuple(o.shape)} {o.dtype}, z {tuple(z.shape)}, weight "
                         f"{tuple(weight.shape)}")
    y = torch.empty(T, HV * D, dtype=dtype, device=o.device)
    q8 = q8_1_buffers(T, HV * D, o.device) if q8_1 else None
    if T:
        _output_kernel[(T, HV)](o, z, weight, y, *(q8 or (y, y, y)), z.stride(0), eps, HV=HV, D=D,
                                Q8=q8 is not None, **pdl.launch_args(o.device))
    return y, q8


# -- torch references -------------------------------------------------------------------------------------

def reference_inputs(y: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, ssm_a: torch.Tensor,
                     dt_bias: torch.Tensor, hk: int, d: int, eps: float) -> tuple[torch.Tensor, ...]:
    """inputs' formulas in torch, from b and alpha [T, HV] themselves."""
    T = y.shape[0]
    q, k = (y[:, i * hk * d : (i + 1) * hk * d].float().reshape(T, hk, d) for i in range(2))
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + eps) * d ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps)
    g = ssm_a * torch.nn.functional.softplus(alpha.float() + dt_bias)
    return q, k, g, torch.sigmoid(b.float())


def reference_output(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """output's formula in torch: [T, HV, D] -> [T, HV D] f32."""
    T, HV, D = o.shape
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight
    return (o * torch.nn.functional.silu(z.float().view(T, HV, D))).reshape(T, HV * D)
