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

The chunked form (`delta_rule_chunked_ref` gives its algebra) is two launches: `_chunk_solve_kernel`, one
program a (chunk, value head, half), solves each chunk's triangular system (I + A) X = R for both halves of
its right-hand side, u0 (from v) and w (from k), independently of every other chunk; `_chunk_state_kernel`
then walks each sequence's chunks in order, one program a (sequence, value head, block of value columns),
with four matrix products a chunk where the recurrence takes a loop step a token. The solve goes by blocks
of 16 rows: each diagonal block's inverse by forward substitution, the blocks below it by substitution of
the solved ones, so that every product is a dot of at least 16 x 16.
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
def _unit_lower_inverse(A):
    """(I + A)^-1 of a strictly lower triangular [SUB, SUB] A, by forward substitution a row at a time."""
    i = tl.arange(0, 16)
    X = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for r in tl.static_range(1, 16):
        a = tl.sum(tl.where(i[:, None] == r, A, 0.0), 0)  # row r of A (zero from column r on)
        row = tl.sum(tl.where(i[:, None] == r, X, 0.0), 0) - tl.sum(a[:, None] * X, 0)
        X = tl.where(i[:, None] == r, row[None, :], X)
    return X


@triton.jit
def _decayed_keys(ki, kj, bi, Gi, Gj, DIAG: tl.constexpr, PREC: tl.constexpr):
    """A's block (i, j): beta_r exp(G_r - G_c) k_r . k_c, strictly below the diagonal where DIAG."""
    a = bi[:, None] * tl.exp(Gi[:, None] - Gj[None, :]) * tl.dot(ki, tl.trans(kj), input_precision=PREC)
    if DIAG:
        i = tl.arange(0, 16)
        a = tl.where(i[:, None] > i[None, :], a, 0.0)
    return a


@triton.jit
def _chunk_solve_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, gc_ptr, uw_ptr, qstart_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_half,
    HK: tl.constexpr, HV: tl.constexpr, TILED: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr,
):
    """Program (sequence, chunk of it, (value head, half, block of BD columns)): X = (I + A)^-1 R for half
    0's R = beta v (X: u0) or half 1's R = beta exp(G) k (X: w), into uw [2, T, HV, D] f32 at [half]; the
    first program of a head also writes the chunk's running log decay G into gc [T, HV]. A chunk past its
    sequence's end exits."""
    s = tl.program_id(0)
    h = tl.program_id(2) // (2 * D // BD)
    half = tl.program_id(2) // (D // BD) % 2
    cols = tl.program_id(2) % (D // BD) * BD + tl.arange(0, BD)
    kh = h % HK if TILED else h // (HV // HK)
    row0 = tl.load(qstart_ptr + s) + tl.program_id(1) * 64
    end = tl.load(qstart_ptr + s + 1)
    if row0 >= end:
        return
    i = tl.arange(0, 16)
    d = tl.arange(0, D)
    r1, r2, r3, r4 = row0 + i, row0 + 16 + i, row0 + 32 + i, row0 + 48 + i
    m1, m2, m3, m4 = r1 < end, r2 < end, r3 < end, r4 < end  # rows past the end: no decay, no update
    g1 = tl.load(g_ptr + r1 * stride_gt + h, mask=m1, other=0.0)
    g2 = tl.load(g_ptr + r2 * stride_gt + h, mask=m2, other=0.0)
    g3 = tl.load(g_ptr + r3 * stride_gt + h, mask=m3, other=0.0)
    g4 = tl.load(g_ptr + r4 * stride_gt + h, mask=m4, other=0.0)
    G1 = tl.cumsum(g1, 0)
    G2 = tl.cumsum(g2, 0) + tl.sum(g1, 0)
    G3 = tl.cumsum(g3, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
    G4 = tl.cumsum(g4, 0) + tl.sum(g1, 0) + tl.sum(g2, 0) + tl.sum(g3, 0)
    b1 = tl.load(beta_ptr + r1 * stride_bt + h, mask=m1, other=0.0)
    b2 = tl.load(beta_ptr + r2 * stride_bt + h, mask=m2, other=0.0)
    b3 = tl.load(beta_ptr + r3 * stride_bt + h, mask=m3, other=0.0)
    b4 = tl.load(beta_ptr + r4 * stride_bt + h, mask=m4, other=0.0)
    kp = k_ptr + kh * stride_kh + d[None, :]
    k1 = tl.load(kp + r1[:, None] * stride_kt, mask=m1[:, None], other=0.0).to(tl.float32)
    k2 = tl.load(kp + r2[:, None] * stride_kt, mask=m2[:, None], other=0.0).to(tl.float32)
    k3 = tl.load(kp + r3[:, None] * stride_kt, mask=m3[:, None], other=0.0).to(tl.float32)
    k4 = tl.load(kp + r4[:, None] * stride_kt, mask=m4[:, None], other=0.0).to(tl.float32)
    A21 = _decayed_keys(k2, k1, b2, G2, G1, False, PREC)
    A31 = _decayed_keys(k3, k1, b3, G3, G1, False, PREC)
    A32 = _decayed_keys(k3, k2, b3, G3, G2, False, PREC)
    A41 = _decayed_keys(k4, k1, b4, G4, G1, False, PREC)
    A42 = _decayed_keys(k4, k2, b4, G4, G2, False, PREC)
    A43 = _decayed_keys(k4, k3, b4, G4, G3, False, PREC)
    T1 = _unit_lower_inverse(_decayed_keys(k1, k1, b1, G1, G1, True, PREC))
    T2 = _unit_lower_inverse(_decayed_keys(k2, k2, b2, G2, G2, True, PREC))
    T3 = _unit_lower_inverse(_decayed_keys(k3, k3, b3, G3, G3, True, PREC))
    T4 = _unit_lower_inverse(_decayed_keys(k4, k4, b4, G4, G4, True, PREC))
    if half == 0:
        vp = v_ptr + h * stride_vh + cols[None, :]
        R1 = b1[:, None] * tl.load(vp + r1[:, None] * stride_vt, mask=m1[:, None], other=0.0).to(tl.float32)
        R2 = b2[:, None] * tl.load(vp + r2[:, None] * stride_vt, mask=m2[:, None], other=0.0).to(tl.float32)
        R3 = b3[:, None] * tl.load(vp + r3[:, None] * stride_vt, mask=m3[:, None], other=0.0).to(tl.float32)
        R4 = b4[:, None] * tl.load(vp + r4[:, None] * stride_vt, mask=m4[:, None], other=0.0).to(tl.float32)
    else:
        kc = k_ptr + kh * stride_kh + cols[None, :]
        R1 = (b1 * tl.exp(G1))[:, None] * tl.load(kc + r1[:, None] * stride_kt, mask=m1[:, None], other=0.0).to(tl.float32)
        R2 = (b2 * tl.exp(G2))[:, None] * tl.load(kc + r2[:, None] * stride_kt, mask=m2[:, None], other=0.0).to(tl.float32)
        R3 = (b3 * tl.exp(G3))[:, None] * tl.load(kc + r3[:, None] * stride_kt, mask=m3[:, None], other=0.0).to(tl.float32)
        R4 = (b4 * tl.exp(G4))[:, None] * tl.load(kc + r4[:, None] * stride_kt, mask=m4[:, None], other=0.0).to(tl.float32)
    X1 = tl.dot(T1, R1, input_precision=PREC)
    X2 = tl.dot(T2, R2 - tl.dot(A21, X1, input_precision=PREC), input_precision=PREC)
    X3 = tl.dot(T3, R3 - tl.dot(A31, X1, input_precision=PREC) - tl.dot(A32, X2, input_precision=PREC),
                input_precision=PREC)
    X4 = tl.dot(T4, R4 - tl.dot(A41, X1, input_precision=PREC) - tl.dot(A42, X2, input_precision=PREC)
                - tl.dot(A43, X3, input_precision=PREC), input_precision=PREC)
    xp = uw_ptr + half * stride_half + h * D + cols[None, :]
    tl.store(xp + r1[:, None] * (HV * D), X1, mask=m1[:, None])
    tl.store(xp + r2[:, None] * (HV * D), X2, mask=m2[:, None])
    tl.store(xp + r3[:, None] * (HV * D), X3, mask=m3[:, None])
    tl.store(xp + r4[:, None] * (HV * D), X4, mask=m4[:, None])
    if tl.program_id(2) % (2 * D // BD) == 0:
        tl.store(gc_ptr + r1 * HV + h, G1, mask=m1)
        tl.store(gc_ptr + r2 * HV + h, G2, mask=m2)
        tl.store(gc_ptr + r3 * HV + h, G3, mask=m3)
        tl.store(gc_ptr + r4 * HV + h, G4, mask=m4)


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
    row0 = tl.load(qstart_ptr + s) + tl.program_id(1) * 64
    end = tl.load(qstart_ptr + s + 1)
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
    lengths = query_start[1:] - query_start[:-1]
    cstart = torch.cat([lengths.new_zeros(1), ((lengths + CHUNK - 1) // CHUNK).cumsum(0)]).to(torch.int32)
    states = torch.empty(T // CHUNK + S, HV, D, D, dtype=torch.float32, device=v.device)  # each chunk's S0
    chunks = triton.cdiv(max_query_len, CHUNK)
    bd = min(block_d, D)
    _chunk_solve_kernel[(S, chunks, HV * 2 * (D // bd))](
        k, v, g, beta, gc, uw, query_start, k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), uw.stride(0), HK=HK, HV=HV, TILED=tiled, D=D, BD=bd, PREC=DOT_PRECISION, num_warps=8)
    bv = min(block_v, D)
    _chunk_state_kernel[(S, HV, D // bv)](
        k, uw, g, states, state, slots, has_state, query_start, cstart, k.stride(0), k.stride(1), g.stride(0),
        uw.stride(0), state.stride(0), state.stride(1), HK=HK, HV=HV, TILED=tiled, D=D, BV=bv, PREC=DOT_PRECISION,
        num_warps=8)
    _chunk_output_kernel[(S, chunks, HV * (D // bv))](
        q, k, uw, gc, states, o, query_start, cstart, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        o.stride(0), o.stride(1), HK=HK, HV=HV, TILED=tiled, D=D, BV=bv, PREC=DOT_PRECISION, num_warps=8)
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
