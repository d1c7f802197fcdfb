"""The gated delta rule of a gated DeltaNet layer, over a flat batch of sequences, each with its recurrent state
in a slot: token by token (decode and verify steps) and in chunks of 64 tokens (prompts), with the torch
references beside them (the CPU path's).

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

The chunked form (`delta_rule_chunked_ref` gives its algebra) is five launches. Three work on every chunk
at once, one program a (chunk, value head): `_chunk_kkt_kernel` writes its running log decay G and its A;
`_chunk_solve_kernel` turns A into (I + A)^-1 by blocks of 16 rows (each diagonal block's inverse by forward
substitution, the blocks below it from the solved ones, so every product is a dot of at least 16 x 16);
`_chunk_wu_kernel` multiplies the inverse into both right-hand sides, u0 (from v) and w (from k). Then
`_chunk_state_kernel` walks each sequence's chunks in order, one program a (sequence, value head, block of
value columns), writing the state each chunk starts from, two products a chunk where the recurrence takes
a loop step a token; and `_chunk_output_kernel` gives every chunk's outputs at once from that state.
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


# -- the chunked form (prompts) ------------------------------------------------------------------------------

CHUNK = 64  # rows a chunk: four blocks of SUB
SUB = 16  # the smallest dot's side
# f32 products at f32 accuracy: three tf32 passes on NVIDIA's matrix cores, plain f32 elsewhere
DOT_PRECISION = "ieee" if getattr(torch.version, "hip", None) else "tf32x3"


@triton.jit
def _chunk_rows(qstart_ptr):
    """(first row, end of its sequence) of the chunk of program (sequence, chunk of it) = program_id(0, 1); a
    first row at or past the end: the sequence has fewer chunks."""
    s = tl.program_id(0)
    return tl.load(qstart_ptr + s) + tl.program_id(1) * 64, tl.load(qstart_ptr + s + 1)


@triton.jit
def _chunk_kkt_kernel(
    k_ptr, g_ptr, beta_ptr, gc_ptr, a_ptr, qstart_ptr, stride_kt, stride_kh, stride_gt, stride_bt,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
):
    """Program (sequence, chunk of it, value head): the chunk's running log decay G into gc [T, HV], and its
    A [i, j] = beta_i exp(G_i - G_j) k_i . k_j below the diagonal (zeros on and above it) into a [T, HV,
    CHUNK], row i at the chunk's row i. A chunk past its sequence's end exits."""
    h = tl.program_id(2)
    kh = h % HK if TILED else h // (HV // HK)
    row0, end = _chunk_rows(qstart_ptr)
    if row0 >= end:
        return
    i = tl.arange(0, 64)
    d = tl.arange(0, D)
    r = row0 + i
    m = r < end  # rows past the end: no decay, no update
    G = tl.cumsum(tl.load(g_ptr + r * stride_gt + h, mask=m, other=0.0), 0)
    tl.store(gc_ptr + r * HV + h, G, mask=m)
    b = tl.load(beta_ptr + r * stride_bt + h, mask=m, other=0.0)
    k = tl.load(k_ptr + r[:, None] * stride_kt + kh * stride_kh + d[None, :], mask=m[:, None], other=0.0)
    k = k.to(tl.float32)
    lower = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf")))
    A = b[:, None] * decay * tl.dot(k, tl.trans(k), input_precision=PREC)
    tl.store(a_ptr + (r[:, None] * HV + h) * 64 + i[None, :], A, mask=m[:, None])


@triton.jit
def _block(a_ptr, row0, end, h, bi: tl.constexpr, bj: tl.constexpr, HV: tl.constexpr):
    """The [SUB, SUB] block (bi, bj) of a chunk's [CHUNK, CHUNK] matrix in a [T, HV, CHUNK]; rows past the
    sequence's end read as zeros."""
    i = tl.arange(0, 16)
    r = row0 + bi * 16 + i
    return tl.load(a_ptr + (r[:, None] * HV + h) * 64 + bj * 16 + i[None, :], mask=(r < end)[:, None], other=0.0)


@triton.jit
def _unit_lower_inverse(a_ptr, row0, end, h, b: tl.constexpr, HV: tl.constexpr):
    """(I + A_bb)^-1 of the chunk's strictly lower diagonal block b, by forward substitution a row at a time,
    each row of A read from memory (rows past the end: zeros, their rows of the inverse the identity's)."""
    i = tl.arange(0, 16)
    X = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for j in tl.static_range(1, 16):
        r = row0 + b * 16 + j
        a = tl.load(a_ptr + (r * HV + h) * 64 + b * 16 + i, mask=(i < j) & (i * 0 + r < end), other=0.0)
        row = tl.where(i == j, 1.0, 0.0) - tl.sum(a[:, None] * X, 0)
        X = tl.where(i[:, None] == j, row[None, :], X)
    return X


@triton.jit
def _chunk_solve_kernel(a_ptr, m_ptr, qstart_ptr, HV: tl.constexpr, PREC: tl.constexpr):
    """Program (sequence, chunk of it, value head): (I + A)^-1 of a's chunk A into m, by blocks of SUB:
    each diagonal block's inverse M_ii by forward substitution, then M_ij = -M_ii sum_k A_ik M_kj (j <= k <
    i) down each column; the blocks above the diagonal are written as zeros."""
    h = tl.program_id(2)
    row0, end = _chunk_rows(qstart_ptr)
    if row0 >= end:
        return
    A21 = _block(a_ptr, row0, end, h, 1, 0, HV)
    A31 = _block(a_ptr, row0, end, h, 2, 0, HV)
    A32 = _block(a_ptr, row0, end, h, 2, 1, HV)
    A41 = _block(a_ptr, row0, end, h, 3, 0, HV)
    A42 = _block(a_ptr, row0, end, h, 3, 1, HV)
    A43 = _block(a_ptr, row0, end, h, 3, 2, HV)
    M11 = _unit_lower_inverse(a_ptr, row0, end, h, 0, HV)
    M22 = _unit_lower_inverse(a_ptr, row0, end, h, 1, HV)
    M33 = _unit_lower_inverse(a_ptr, row0, end, h, 2, HV)
    M44 = _unit_lower_inverse(a_ptr, row0, end, h, 3, HV)
    M21 = -tl.dot(M22, tl.dot(A21, M11, input_precision=PREC), input_precision=PREC)
    M32 = -tl.dot(M33, tl.dot(A32, M22, input_precision=PREC), input_precision=PREC)
    M31 = -tl.dot(M33, tl.dot(A31, M11, input_precision=PREC) + tl.dot(A32, M21, input_precision=PREC),
                  input_precision=PREC)
    M43 = -tl.dot(M44, tl.dot(A43, M33, input_precision=PREC), input_precision=PREC)
    M42 = -tl.dot(M44, tl.dot(A42, M22, input_precision=PREC) + tl.dot(A43, M32, input_precision=PREC),
                  input_precision=PREC)
    M41 = -tl.dot(M44, tl.dot(A41, M11, input_precision=PREC) + tl.dot(A42, M21, input_precision=PREC)
                  + tl.dot(A43, M31, input_precision=PREC), input_precision=PREC)
    i = tl.arange(0, 16)
    zero = tl.zeros((16, 16), tl.float32)
    base = m_ptr + ((row0 + i[:, None]) * HV + h) * 64 + i[None, :]
    for b in tl.static_range(4):  # block row b: M_b1 .. M_b4
        live = (row0 + b * 16 + i < end)[:, None]
        p = base + b * 16 * HV * 64
        tl.store(p, M11 if b == 0 else (M21 if b == 1 else (M31 if b == 2 else M41)), mask=live)
        tl.store(p + 16, zero if b < 1 else (M22 if b == 1 else (M32 if b == 2 else M42)), mask=live)
        tl.store(p + 32, zero if b < 2 else (M33 if b == 2 else M43), mask=live)
        tl.store(p + 48, zero if b < 3 else M44, mask=live)


@triton.jit
def _chunk_wu_kernel(
    k_ptr, v_ptr, beta_ptr, gc_ptr, m_ptr, uw_ptr, qstart_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bt, stride_half,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (sequence, chunk of it, (value head, half, block of BD columns)): X = (I + A)^-1 R, with the
    inverse from m, for half 0's R = beta v (X: u0) or half 1's R = beta exp(G) k (X: w), into uw [2, T,
    HV, D] f32 at [half]."""
    h = tl.program_id(2) // (2 * D // BD)
    half = tl.program_id(2) // (D // BD) % 2
    cols = tl.program_id(2) % (D // BD) * BD + tl.arange(0, BD)
    kh = h % HK if TILED else h // (HV // HK)
    row0, end = _chunk_rows(qstart_ptr)
    if row0 >= end:
        return
    i = tl.arange(0, 64)
    r = row0 + i
    m = r < end
    M = tl.load(m_ptr + (r[:, None] * HV + h) * 64 + i[None, :], mask=m[:, None], other=0.0)
    b = tl.load(beta_ptr + r * stride_bt + h, mask=m, other=0.0)
    if half == 0:
        R = tl.load(v_ptr + r[:, None] * stride_vt + h * stride_vh + cols[None, :], mask=m[:, None], other=0.0)
        R = b[:, None] * R.to(tl.float32)
    else:
        G = tl.load(gc_ptr + r * HV + h, mask=m, other=0.0)
        R = tl.load(k_ptr + r[:, None] * stride_kt + kh * stride_kh + cols[None, :], mask=m[:, None], other=0.0)
        R = (b * tl.exp(G))[:, None] * R.to(tl.float32)
    X = tl.dot(M, R, input_precision=PREC)
    tl.store(uw_ptr + half * stride_half + (r[:, None] * HV + h) * D + cols[None, :], X, mask=m[:, None])


@triton.jit
def _chunk_state_kernel(
    k_ptr, uw_ptr, g_ptr, h_ptr, state_ptr, slots_ptr, has_state_ptr, qstart_ptr, cstart_ptr,
    stride_kt, stride_kh, stride_gt, stride_half, stride_slot, stride_sh,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (sequence, value head, block of BV value columns), over the sequence's chunks in order, with
    S0 the state before a chunk: writes S0 into h [chunks, HV, D, D] at the chunk's index (cstart[s] on),
    u = u0 - w S0 over u0 in uw[0], and S = exp(G_last) S0 + (exp(G_last - G) K)^T u."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    kh = h % HK if TILED else h // (HV // HK)
    start = tl.load(qstart_ptr + s)
    end = tl.load(qstart_ptr + s + 1)
    chunk = tl.load(cstart_ptr + s).to(tl.int64)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    keep = tl.load(has_state_ptr + s) != 0
    d = tl.arange(0, D)  # key index
    cols = tl.program_id(2) * BV + tl.arange(0, BV)  # value index
    i = tl.arange(0, 64)
    sp = state_ptr + slot * stride_slot + h * stride_sh + d[:, None] * D + cols[None, :]
    S = tl.where(keep, tl.load(sp), 0.0)  # a first step starts from zeros
    hp = h_ptr + (chunk * HV + h) * D * D + d[:, None] * D + cols[None, :]
    for row0 in range(start, end, 64):
        r = row0 + i
        m = r < end
        tl.store(hp, S)
        hp += HV * D * D
        g = tl.load(g_ptr + r * stride_gt + h, mask=m, other=0.0)
        # the decay from a row to the chunk's end, summed from the end: exact to f32 where it is near 1
        # (a difference of running sums would carry their rounding, 3e-5 at -500)
        tail = tl.cumsum(g, 0, reverse=True) - g
        w = tl.load(uw_ptr + stride_half + r[:, None] * (HV * D) + h * D + d[None, :], mask=m[:, None], other=0.0)
        up = uw_ptr + r[:, None] * (HV * D) + h * D + cols[None, :]
        u = tl.load(up, mask=m[:, None], other=0.0) - tl.dot(w, S, input_precision=PREC)
        tl.store(up, u, mask=m[:, None])
        k = tl.load(k_ptr + r[:, None] * stride_kt + kh * stride_kh + d[None, :], mask=m[:, None], other=0.0)
        kd = k.to(tl.float32) * tl.exp(tail)[:, None]
        S = tl.exp(tl.sum(g, 0)) * S + tl.dot(tl.trans(kd), u, input_precision=PREC)
    tl.store(sp, S)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, uw_ptr, gc_ptr, h_ptr, o_ptr, qstart_ptr, cstart_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (sequence, chunk of it, value head h * D / BV + block of BV value columns), every chunk at once:
    o = exp(G) Q S0 + (exp(G_i - G_j) q_i . k_j, j <= i) u, from the chunk's S0 in h and u in uw[0]."""
    s = tl.program_id(0)
    h = tl.program_id(2) // (D // BV)
    cols = tl.program_id(2) % (D // BV) * BV + tl.arange(0, BV)  # value index
    kh = h % HK if TILED else h // (HV // HK)
    row0, end = _chunk_rows(qstart_ptr)
    if row0 >= end:
        return
    chunk = tl.load(cstart_ptr + s).to(tl.int64) + tl.program_id(1)
    i = tl.arange(0, 64)
    d = tl.arange(0, D)
    r = row0 + i
    m = r < end
    G = tl.load(gc_ptr + r * HV + h, mask=m, other=0.0)
    q = tl.load(q_ptr + r[:, None] * stride_qt + kh * stride_qh + d[None, :], mask=m[:, None], other=0.0)
    k = tl.load(k_ptr + r[:, None] * stride_kt + kh * stride_kh + d[None, :], mask=m[:, None], other=0.0)
    S0 = tl.load(h_ptr + (chunk * HV + h) * D * D + d[:, None] * D + cols[None, :])
    u = tl.load(uw_ptr + r[:, None] * (HV * D) + h * D + cols[None, :], mask=m[:, None], other=0.0)
    q = q.to(tl.float32)
    qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PREC)
    P = tl.where((i[:, None] >= i[None, :]) & m[None, :], tl.exp(G[:, None] - G[None, :]), 0.0) * qk
    o = tl.exp(G)[:, None] * tl.dot(q, S0, input_precision=PREC) + tl.dot(P, u, input_precision=PREC)
    tl.store(o_ptr + r[:, None] * stride_ot + h * stride_oh + cols[None, :], o.to(o_ptr.dtype.element_ty),
             mask=m[:, None])


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, query_start: torch.Tensor,
                       max_query_len: int, tiled: bool, block_v: int = 32, block_d: int = 64) -> torch.Tensor:
    """o [T, HV, D] in v's type, in chunks of CHUNK rows (prompts; max_query_len bounds the chunks a
    sequence has); updates the state slots like delta_rule_recurrent."""
    HK, HV, D = check_inputs(q, k, v, g, beta, state, slots)
    if D < SUB:
        raise ValueError(f"the chunked delta rule needs heads of at least {SUB}, got {D}")
    T, S = v.shape[0], slots.numel()
    o = torch.empty_like(v)
    if not S or not T:
        return o
    uw = torch.empty(2, T, HV, D, dtype=torch.float32, device=v.device)  # u0 (then u), w
    gc = torch.empty(T, HV, dtype=torch.float32, device=v.device)
    a, minv = (torch.empty(T, HV, CHUNK, dtype=torch.float32, device=v.device) for _ in range(2))  # A, (I + A)^-1
    lengths = query_start[1:] - query_start[:-1]
    cstart = torch.cat([lengths.new_zeros(1), ((lengths + CHUNK - 1) // CHUNK).cumsum(0)]).to(torch.int32)
    states = torch.empty(T // CHUNK + S, HV, D, D, dtype=torch.float32, device=v.device)  # each chunk's S0
    grid = (S, triton.cdiv(max_query_len, CHUNK), HV)
    _chunk_kkt_kernel[grid](k, g, beta, gc, a, query_start, k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
                            HK=HK, HV=HV, TILED=tiled, D=D, PREC=DOT_PRECISION, num_warps=4)
    _chunk_solve_kernel[grid](a, minv, query_start, HV=HV, PREC=DOT_PRECISION, num_warps=2)
    bd = min(block_d, D)
    _chunk_wu_kernel[grid[:2] + (HV * 2 * (D // bd),)](
        k, v, beta, gc, minv, uw, query_start, k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0),
        uw.stride(0), HK=HK, HV=HV, TILED=tiled, D=D, BD=bd, PREC=DOT_PRECISION, num_warps=8)
    bv = min(block_v, D)
    _chunk_state_kernel[(S, HV, D // bv)](
        k, uw, g, states, state, slots, has_state, query_start, cstart, k.stride(0), k.stride(1), g.stride(0),
        uw.stride(0), state.stride(0), state.stride(1), HK=HK, HV=HV, TILED=tiled, D=D, BV=bv, PREC=DOT_PRECISION,
        num_warps=8)
    # eight warps on 16 value columns: an illegal address on an H100 under Triton 3.6 (the products' [64, 16]
    # tiles); four there ran the GPU tests clean, eight from 32 columns on as before
    _chunk_output_kernel[grid[:2] + (HV * (D // bv),)](
        q, k, uw, gc, states, o, query_start, cstart, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        o.stride(0), o.stride(1), HK=HK, HV=HV, TILED=tiled, D=D, BV=bv, PREC=DOT_PRECISION,
        num_warps=8 if bv >= 32 else 4)
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
