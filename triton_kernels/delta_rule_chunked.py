"""The gated delta rule for prompts: each sequence in chunks of CHUNK tokens, the state carried from chunk to
chunk (layout and per-token math: delta_rule.py; torch reference: delta_rule.delta_rule_chunked_ref).

Inside a chunk, with S0 the state before it and G the running sum of the log decays from the chunk's start,
the token-by-token recurrence is one triangular solve and a few matrix products:

    A[i, j] = beta_i exp(G_i - G_j) k_i . k_j   (j < i)
    (I + A) u = beta (v - exp(G) K S0)                    u: each token's delta, by forward substitution
    o = exp(G) Q S0 + (exp(G_i - G_j) q_i . k_j, j <= i) u
    S = exp(G_last) S0 + (exp(G_last - G) K)^T u

exp is only taken of G_i - G_j where j <= i (never positive), so nothing overflows. One program per (sequence,
value head, block of BV value columns) walks its sequence's chunks in order; the dot products run in full f32
("ieee": tf32 would round k . k to 10 bits, and errors feed the state).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.delta_rule import check_inputs, strided_args


@triton.jit
def _delta_rule_chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, has_state_ptr, qstart_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    stride_slot, stride_sh,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    kh = h % HK if TILED else h // (HV // HK)
    dk = tl.arange(0, D)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    c = tl.arange(0, CHUNK)
    lower = c[:, None] > c[None, :]
    upto = c[:, None] >= c[None, :]
    start = tl.load(qstart_ptr + s)
    end = tl.load(qstart_ptr + s + 1)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    keep = tl.load(has_state_ptr + s) != 0
    sp = state_ptr + slot * stride_slot + h * stride_sh + dk[:, None] * D + cols[None, :]
    S = tl.where(keep, tl.load(sp), 0.0)  # [D, BV]; a first step starts from zeros
    for t0 in range(start, end, CHUNK):
        t = t0 + c
        m = t < end
        q = tl.load(q_ptr + t[:, None] * stride_qt + kh * stride_qh + dk[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t[:, None] * stride_kt + kh * stride_kh + dk[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + cols[None, :], mask=m[:, None], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h, mask=m, other=0.0)
        b = tl.load(beta_ptr + t * stride_bt + h, mask=m, other=0.0)
        G = tl.cumsum(g, axis=0)
        diff = G[:, None] - G[None, :]
        eG = tl.exp(G)
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        A = tl.where(lower, b[:, None] * tl.exp(tl.where(lower, diff, 0.0)) * kk, 0.0)
        u = b[:, None] * (v - eG[:, None] * tl.dot(k, S, input_precision=PRECISION))  # [CHUNK, BV]
        # forward substitution, row by row: rows past the sequence's end have A = 0 and u = 0 already
        for i in range(1, tl.minimum(end - t0, CHUNK)):
            a_i = tl.sum(tl.where(c[:, None] == i, A, 0.0), axis=0)
            u = tl.where(c[:, None] == i, u - tl.sum(a_i[:, None] * u, axis=0)[None, :], u)
        P = tl.where(upto, tl.dot(q, tl.trans(k), input_precision=PRECISION) * tl.exp(tl.where(upto, diff, 0.0)), 0.0)
        o = eG[:, None] * tl.dot(q, S, input_precision=PRECISION) + tl.dot(P, u, input_precision=PRECISION)
        tl.store(o_ptr + t[:, None] * stride_ot + h * stride_oh + cols[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=m[:, None])
        last = tl.sum(g, axis=0)  # G at the chunk's last token (rows past the end add 0)
        S = tl.exp(last) * S + tl.dot(tl.trans(k * tl.exp(last - G)[:, None]), u, input_precision=PRECISION)
    tl.store(sp, S)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, query_start: torch.Tensor,
                       tiled: bool, chunk: int = 64, block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    """o [T, HV, D] in v's type for every sequence of the flat batch; updates the state slots."""
    HK, HV, D = check_inputs(q, k, v, g, beta, state, slots)
    if D < 16:
        raise ValueError(f"the chunked kernel's products need heads of at least 16, got {D}")
    o = torch.empty_like(v)
    bv = max(16, min(block_v, D))
    S = slots.numel()
    if S:
        _delta_rule_chunked_kernel[(S, HV, D // bv)](
            *strided_args(q, k, v, g, beta, o, state, slots, has_state, query_start),
            HK=HK, HV=HV, TILED=tiled, D=D, BV=bv, CHUNK=chunk, PRECISION="ieee", num_warps=num_warps)
    return o
