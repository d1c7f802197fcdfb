"""The gated delta rule of a gated DeltaNet layer, over a flat batch of sequences, each with its recurrent state
in a slot: the token-by-token recurrence (decode and prompts alike) and the torch references, the chunked
one the CPU path's for prompts.

Layout: q, k [T, HK, D] (l2-normalized; q also scaled by 1 / sqrt(D)), v [T, HV, D], g [T, HV] (log decay,
<= 0), beta [T, HV], all rows of all sequences concatenated (sequence s owns rows query_start[s] ..
query_start[s + 1] - 1); state [slots, HV, D, D] f32, index [key dim, value dim]. Value head h reads key head
h % HK (tiled) or h // (HV / HK) (grouped), as the model's converter laid the heads out. Per head and token:

    S <- exp(g) S                     decay
    u  = beta (v - S^T k)             the delta: what S predicts for k, corrected towards v
    S <- S + k u^T
    o  = S^T q

A sequence with has_state 0 starts from S = 0 (its first step) whatever its slot holds; the final S of each
sequence goes back to its slot. Value columns are independent (u's column j reads S's column j only), so a
program owns one (sequence, value head, block of BV value columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_rule_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, has_state_ptr, qstart_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    stride_slot, stride_sh,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    kh = h % HK if TILED else h // (HV // HK)
    rows = tl.arange(0, D)  # key index
    cols = tl.program_id(2) * BV + tl.arange(0, BV)  # value index
    start = tl.load(qstart_ptr + s)
    end = tl.load(qstart_ptr + s + 1)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    keep = tl.load(has_state_ptr + s) != 0
    sp = state_ptr + slot * stride_slot + h * stride_sh + rows[:, None] * D + cols[None, :]
    S = tl.where(keep, tl.load(sp), 0.0)  # a first step starts from zeros
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + kh * stride_qh + rows).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + kh * stride_kh + rows).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h)
        b = tl.load(beta_ptr + t * stride_bt + h)
        S = S * tl.exp(g)
        u = b * (v - tl.sum(S * k[:, None], axis=0))
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + cols, o.to(o_ptr.dtype.element_ty))
    tl.store(sp, S)


def check_inputs(q, k, v, g, beta, state, slots) -> tuple[int, int, int]:
    """(HK, HV, D) after checking the layout above."""
    T, HK, D = q.shape
    HV = v.shape[1]
    if k.shape != q.shape or v.shape != (T, HV, D) or g.shape != (T, HV) or beta.shape != (T, HV):
        raise ValueError(f"q/k [T, HK, D], v [T, HV, D], g/beta [T, HV]: got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    if HV % HK or D & (D - 1):
        raise ValueError(f"{HV} value heads over {HK} key heads of width {D}: need a whole multiple and a power of 2")
    if state.dtype != torch.float32 or state.shape[1:] != (HV, D, D) or not state.is_contiguous():
        raise ValueError(f"state must be contiguous f32 [slots, {HV}, {D}, {D}], got {tuple(state.shape)}")
    if g.dtype != torch.float32 or beta.dtype != torch.float32:
        raise ValueError("g and beta must be f32")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v need contiguous heads")
    return HK, HV, D


def strided_args(q, k, v, g, beta, o, state, slots, has_state, query_start) -> tuple:
    """The pointer and stride arguments of this file's kernel, in their order."""
    return (q, k, v, g, beta, o, state, slots, has_state, query_start,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), o.stride(0), o.stride(1), state.stride(0), state.stride(1))


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, query_start: torch.Tensor,
                         tiled: bool, block_v: int = 32) -> torch.Tensor:
    """o [T, HV, D] in v's type, token by token (decode: one token a sequence); updates the state slots."""
    HK, HV, D = check_inputs(q, k, v, g, beta, state, slots)
    o = torch.empty_like(v)
    bv = min(block_v, D)
    S = slots.numel()
    if S:
        _delta_rule_recurrent_kernel[(S, HV, D // bv)](
            *strided_args(q, k, v, g, beta, o, state, slots, has_state, query_start),
            HK=HK, HV=HV, TILED=tiled, D=D, BV=bv)
    return o


# -- torch references (the CPU path) -----------------------------------------------------------------------

def expand_heads(x: torch.Tensor, hv: int, tiled: bool) -> torch.Tensor:
    """[n, HK, D] -> [n, HV, D]: each value head's key head."""
    r = hv // x.shape[1]
    return x.repeat(1, r, 1) if tiled else x.repeat_interleave(r, dim=1)


def delta_rule_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token: q, k, v [n, H, D] (heads already expanded), g, beta [n, H]; state
    [H, D, D] or None (zeros) -> (o [n, H, D] f32, the final state f32)."""
    n, H, D = v.shape
    S = v.new_zeros(H, D, D, dtype=torch.float32) if state is None else state.float().clone()
    o = torch.empty(n, H, D, dtype=torch.float32, device=v.device)
    for t in range(n):
        S = S * g[t].float().exp()[:, None, None]
        u = beta[t].float()[:, None] * (v[t].float() - torch.einsum("hk,hkv->hv", k[t].float(), S))
        S = S + k[t].float()[:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t].float(), S)
    return o, S


def delta_rule_chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in chunks of `chunk` tokens (the CPU path's for prompts: a few matrix products a chunk where the
    recurrence takes a loop step a token): inside a chunk, with G the decay's running sum from the chunk's
    start and S0 the state before it,

        (I + A) u = beta (v - exp(G) K S0),   A[i, j] = beta_i exp(G_i - G_j) k_i . k_j  for j < i
        o = exp(G) Q S0 + (exp(G_i - G_j) q_i . k_j, j <= i) u
        S = exp(G_last) S0 + (exp(G_last - G) K)^T u
    """
    n, H, D = v.shape
    pad = -n % chunk  # zero rows: no decay, no update, outputs dropped
    q, k, v, g, beta = (torch.cat([x.float(), x.new_zeros(pad, *x.shape[1:], dtype=torch.float32)])
                        for x in (q, k, v, g, beta))
    N = (n + pad) // chunk
    # [H, N, C, ...]
    q, k, v = (x.view(N, chunk, H, D).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.view(N, chunk, H).permute(2, 0, 1) for x in (g, beta))
    G = g.cumsum(-1)
    i = torch.arange(chunk, device=v.device)
    lower, upto = i[:, None] > i[None, :], i[:, None] >= i[None, :]
    diff = G[..., :, None] - G[..., None, :]
    decay = lambda m: torch.where(m, diff, torch.full_like(diff, float("-inf"))).exp()  # noqa: E731
    A = beta[..., :, None] * decay(lower) * (k @ k.transpose(-1, -2))
    # (I + A) X = [beta v, beta exp(G) k] by forward substitution, row by row, every chunk and head at once
    # (torch's batched triangular solve is ~100x slower at these sizes on a CPU)
    x = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    for r in range(1, chunk):
        x[..., r, :] -= (A[..., r, :r, None] * x[..., :r, :]).sum(-2)
    u0, w = x.split([D, D], dim=-1)  # [H, N, C, D] each
    P = decay(upto) * (q @ k.transpose(-1, -2))
    S = v.new_zeros(H, D, D) if state is None else state.float().clone()
    o = torch.empty_like(v)
    for c in range(N):
        u = u0[:, c] - w[:, c] @ S
        o[:, c] = G[:, c, :, None].exp() * (q[:, c] @ S) + P[:, c] @ u
        last = G[:, c, -1]
        S = last.exp()[:, None, None] * S + ((last[:, None] - G[:, c]).exp()[..., None] * k[:, c]).transpose(-1, -2) @ u
    return o.permute(1, 2, 0, 3).reshape(N * chunk, H, D)[:n], S
