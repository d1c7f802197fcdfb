"""The small per-layer operations of a decoder as one launch each: RMSNorm (alone or after the residual
add), rotary embedding, SiLU-mul, and gated attention's output gate.

In torch each is a chain of 3-12 elementwise, reduce and index kernels of 1-3 us; on an 8B decode step
they were ~600 launches and a third of the kernel time. Each kernel here reads
its inputs once and writes its output once, in f32 arithmetic.

Torch references (the CPU path, and what these are tested against): engine/layers/norm.py RMSNorm
(and h + delta before it), engine/layers/rotary.py RotaryEmbedding, and F.silu(gate) * up.

The residual add's RMSNorm also takes a mixture-of-experts layer's output unsummed (moe_ops.ExpertSum) and
sums it in the same launch. RMSNorm and SiLU-mul also write the q8_1 copy of their output when asked
(`q8_1=True`: the input of the int8-dot mat-vecs after them in a decode step), the same bytes quantize_q8_1
of the output would give, without its launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.attention_common import rotate_pair, to_cache
from vegaserve.triton_kernels.moe_ops import ExpertSum, expert_sum
from vegaserve.triton_kernels.q8_1 import Q8_1, q8_1_buffers, store_q8_1


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, h_ptr, w_ptr, y_ptr, q_ptr, qd_ptr, qs_ptr, stride_x, stride_d, stride_y, N,
                     eps, ey_ptr, ew_ptr, eid_ptr, eb_ptr, es_ptr, eg_ptr,
                     BLOCK: tl.constexpr, SLICE: tl.constexpr, ADD: tl.constexpr, Q8: tl.constexpr,
                     EXPERTS: tl.constexpr, K: tl.constexpr, EBIAS: tl.constexpr, ESHARED: tl.constexpr,
                     PDL: tl.constexpr):
    """Row program_id(0), its columns [program_id(1) * SLICE, + SLICE): y = norm(x) * w; with ADD, h = x +
    delta is written and normed (the residual stream); with Q8, y's q8_1 too (of y as stored, in y's type).
    With EXPERTS the delta is a mixture-of-experts layer's ExpertSum (the e* pointers, K experts a token),
    summed here by moe_ops.expert_sum as its combine launch would. Each program sums the squares of the
    whole row (the same sum in every program of the row) and writes only its slice, so a decode token's
    norm and quantization spread over N / SLICE programs (one program quantizing a 4096-wide row alone took
    as long as a launch of its own)."""
    pdl.let_next_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    sc = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
    mine = sc < N
    w = tl.load(w_ptr + sc, mask=mine, other=0.0).to(tl.float32)
    pdl.wait_for_inputs(PDL)
    cols = tl.arange(0, BLOCK)
    whole = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0)
    if EXPERTS:
        whole = whole + expert_sum(ey_ptr, ew_ptr, eid_ptr, eb_ptr, es_ptr, eg_ptr, row, cols, cols < N, N, K,
                                   BLOCK, EBIAS, ESHARED)
    elif ADD:
        whole = whole + tl.load(d_ptr + row * stride_d + cols, mask=cols < N, other=0.0)
    wf = whole.to(tl.float32)
    ss = tl.sum(wf * wf, axis=0)
    if SLICE == BLOCK:  # one program a row: its slice is the row
        x = whole
    else:
        x = tl.load(x_ptr + row * stride_x + sc, mask=mine, other=0.0)
        if EXPERTS:
            x = x + expert_sum(ey_ptr, ew_ptr, eid_ptr, eb_ptr, es_ptr, eg_ptr, row, sc, mine, N, K, SLICE, EBIAS,
                               ESHARED)
        elif ADD:
            x = x + tl.load(d_ptr + row * stride_d + sc, mask=mine, other=0.0)
    if ADD:
        tl.store(h_ptr + row * N + sc, x, mask=mine)
    r = 1.0 / tl.sqrt(ss / N + eps)
    y = (x.to(tl.float32) * r * w).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + sc, y, mask=mine)
    if Q8:
        store_q8_1(y.to(tl.float32), tl.program_id(1) * (SLICE // 32), q_ptr + row * N, qd_ptr + row * (N // 32),
                   qs_ptr + row * (N // 32), N // 32, SLICE // 32)


_NORM_SLICE = 512  # columns a program writes when the norm also quantizes (decode): 8 programs for 4096


def _launch_norm(x, delta, h, weight, y, q8, eps, add: bool, experts: ExpertSum | None = None) -> None:
    T, N = x.shape
    block = triton.next_power_of_2(N)
    # with the q8_1 copy (a decode step) the row spreads over programs; else one program a row (prefill
    # rows are many)
    sl = min(block, _NORM_SLICE) if q8 is not None else block
    _rms_norm_kernel[(T, triton.cdiv(N, sl))](
        x, delta, h, weight, y, *(q8 or (y, y, y)), x.stride(0), delta.stride(0) if add else 0, y.stride(0), N,
        eps, *(experts.pointers() if experts is not None else (x,) * 6), BLOCK=block, SLICE=sl, ADD=add,
        Q8=q8 is not None, EXPERTS=experts is not None, K=experts.weights.shape[1] if experts is not None else 1,
        EBIAS=experts is not None and experts.bias is not None,
        ESHARED=experts is not None and experts.shared is not None, **pdl.launch_args(x.device))


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} takes [T, N] rows with unit stride; got {tuple(x.shape)} {x.stride()}")


def _q8_1_out(want: bool, T: int, N: int, like: torch.Tensor) -> Q8_1 | None:
    return q8_1_buffers(T, N, like.device) if want else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, q8_1: bool = False) -> torch.Tensor | tuple[torch.Tensor, Q8_1]:
    """x [T, N] with unit stride along N (rows may be strided) -> x / sqrt(mean(x^2) + eps) * w, x's type;
    with q8_1 (N a multiple of 32), (that, its q8_1)."""
    _check_rows("rms_norm", x)
    T, N = x.shape
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    q8 = _q8_1_out(q8_1, T, N, x)
    if T:
        _launch_norm(x, x, x, weight, y, q8, eps, add=False)
    return (y, q8) if q8_1 else y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | ExpertSum, weight: torch.Tensor, eps: float,
                 q8_1: bool = False) -> tuple[torch.Tensor, ...]:
    """h = x + delta and rms_norm(h), in one launch: (h [T, N] contiguous, norm [T, N]), both in x's type,
    which delta must share (so that h is exactly torch's x + delta); with q8_1, (h, norm, norm's q8_1).
    delta may be a mixture-of-experts layer's ExpertSum (x f32): its sum is taken in this launch, the same
    bits as x + moe_ops.combine(*delta)."""
    _check_rows("add_rms_norm", x)
    if isinstance(delta, ExpertSum):
        T, _, H = delta.check()
        if (T, H) != tuple(x.shape) or x.dtype != torch.float32:
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and the experts' sum [{T}, {H}] f32 "
                             "differ")
        experts, delta = delta, x  # (the kernel reads the experts' parts, not delta)
    else:
        experts = None
        _check_rows("add_rms_norm", delta)
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and delta {tuple(delta.shape)} "
                             f"{delta.dtype} differ")
    T, N = x.shape
    h = torch.empty(T, N, dtype=x.dtype, device=x.device)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    q8 = _q8_1_out(q8_1, T, N, x)
    if T:
        _launch_norm(x, delta, h, weight, y, q8, eps, add=True, experts=experts)
    return (h, y, q8) if q8_1 else (h, y)


_ROPE_HEADS = 4  # heads per program


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, H,
                 kc_ptr, vc_ptr, slot_ptr, v_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_vt,
                 stride_vh, FIRST_K, nw_ptr, NORM_K, eps,
                 D: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr,
                 HALF: tl.constexpr, REST: tl.constexpr, STORE: tl.constexpr, BLOCK_D: tl.constexpr,
                 NORM: tl.constexpr, PDL: tl.constexpr):
    """Token program_id(0), heads program_id(1) * BLOCK_H onwards: pairs (i, i + ROT/2) (NEOX) or
    (2i, 2i + 1) rotate by the angle of pair i at the token's position; features ROT.. D are copied.
    NORM: each head is first RMS-normed over its D features (q/k norm), by weight row 0 of nw [2, D] below
    head NORM_K and row 1 from it, and rounded to x's type, as the norm kernel would have stored it.
    STORE: heads FIRST_K.. are keys: each rotated key row (as stored in y) also goes to the token's cache
    slot, and the value row of the same kv head with it, both in the caches' type (write_kv's store)."""
    pdl.let_next_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    # the step's positions and slots (written before its first kernel, pdl.py) and the angle tables:
    # read before the wait, so that after it only x and v are waited for
    p = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, HALF)[None, :]
    live = (h < H) & (i < ROT // 2)
    cos = tl.load(cos_ptr + p * (ROT // 2) + i, mask=i < ROT // 2, other=0.0)
    sin = tl.load(sin_ptr + p * (ROT // 2) + i, mask=i < ROT // 2, other=0.0)
    if STORE:
        s = tl.load(slot_ptr + t).to(tl.int64)
    if NEOX:
        ia = i
        ib = i + ROT // 2
    else:
        ia = 2 * i
        ib = 2 * i + 1
    if REST > 0:
        j = ROT + tl.arange(0, REST)[None, :]
        keep = (h < H) & (j < D)
    if NORM:  # the norm's weights, the layer's own: before the wait too
        wrow = nw_ptr + (h >= NORM_K).to(tl.int32) * D
        wa = tl.load(wrow + ia, mask=live, other=0.0)
        wb = tl.load(wrow + ib, mask=live, other=0.0)
        if REST > 0:
            wr = tl.load(wrow + j, mask=keep, other=0.0)
    pdl.wait_for_inputs(PDL)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = y_ptr + (t * H + h) * D
    a = tl.load(src + ia, mask=live, other=0.0).to(tl.float32)
    b = tl.load(src + ib, mask=live, other=0.0).to(tl.float32)
    if REST > 0:
        rest = tl.load(src + j, mask=keep, other=0.0)
    if NORM:
        ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        if REST > 0:
            rf = rest.to(tl.float32)
            ss += tl.sum(rf * rf, axis=1)
        r = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        a = (a * r * wa).to(x_ptr.dtype.element_ty).to(tl.float32)
        b = (b * r * wb).to(x_ptr.dtype.element_ty).to(tl.float32)
        if REST > 0:
            rest = (rf * r * wr).to(x_ptr.dtype.element_ty)
    ra, rb = rotate_pair(a, b, cos, sin)
    ra = ra.to(y_ptr.dtype.element_ty)
    rb = rb.to(y_ptr.dtype.element_ty)
    tl.store(dst + ia, ra, mask=live)
    tl.store(dst + ib, rb, mask=live)
    if STORE:
        kv = h - FIRST_K  # the kv head of a key row (negative: a query row, nothing stored)
        key = (kv >= 0) & (h < H)
        kdst = kc_ptr + s * stride_kcs + kv * stride_kch
        tl.store(kdst + ia, to_cache(ra, kc_ptr), mask=live & key)
        tl.store(kdst + ib, to_cache(rb, kc_ptr), mask=live & key)
        d = tl.arange(0, BLOCK_D)[None, :]
        vm = key & (d < D)
        vrow = tl.load(v_ptr + t * stride_vt + kv * stride_vh + d, mask=vm)
        tl.store(vc_ptr + s * stride_vcs + kv * stride_vch + d, to_cache(vrow, vc_ptr), mask=vm)
    if REST > 0:
        tl.store(dst + j, rest, mask=keep)
        if STORE:
            tl.store(kdst + j, to_cache(rest, kc_ptr), mask=keep & key)


class HeadNorm(NamedTuple):
    """The per-head RMS norm rope applies before it rotates (q/k norm): weight [2, D] f32 (row 0 for the heads
    below first_k, row 1 for the others; one row serves where all heads are q's or k's), and eps."""

    weight: torch.Tensor
    first_k: int
    eps: float


class KVStore(NamedTuple):
    """Where rope also writes the keys it rotates: the layer's caches [slots, KV, D], the tokens' slots [T]
    (int64), the values [T, KV, D] (unit stride over D) and the first key head of the rotated heads."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    v: torch.Tensor
    first_k: int


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
         neox: bool, store: KVStore | None = None, norm: HeadNorm | None = None) -> torch.Tensor:
    """x [T, H, D] (any strides over T and H, unit stride over D), positions [T], cos/sin [max_pos,
    rope_dim / 2] f32 (the angles times the magnitude scale) -> rotated copy [T, H, D], x's type. `store`:
    the heads from store.first_k on are keys; they and the values go to the cache in the same launch (the
    store attention.write_kv would make; the caller then skips it). `norm`: each head RMS-normed first (the
    q/k norms of Qwen3 and its kin, in this launch rather than one each)."""
    T, H, D = x.shape
    if x.stride(2) != 1 or rope_dim % 2 or rope_dim > D:
        raise ValueError(f"rope takes [T, H, D] with unit stride over D and an even rope_dim <= D; got "
                         f"{tuple(x.shape)} {x.stride()} rope_dim {rope_dim}")
    if norm is not None and (norm.weight.shape != (2, D) or norm.weight.dtype != torch.float32
                             or not norm.weight.is_contiguous()):
        raise ValueError(f"rope's head norm takes a contiguous f32 weight [2, {D}], got "
                         f"{tuple(norm.weight.shape)} {norm.weight.dtype}")
    norm_args = (norm.weight, norm.first_k, norm.eps) if norm is not None else (cos, H, 0.0)
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if store is not None:
        kc, vc, slots, v, first = store
        if (slots.shape != (T,) or v.shape != (T, H - first, D) or kc.shape[1:] != v.shape[1:]
                or vc.shape != kc.shape or v.stride(2) != 1 or kc.stride(2) != 1 or vc.stride(2) != 1):
            raise ValueError(f"rope's cache store: {H - first} key heads of {tuple(x.shape)}, values "
                             f"{tuple(v.shape)}, slots {tuple(slots.shape)}, caches {tuple(kc.shape)}")
        cache_args = (kc, vc, slots, v, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), v.stride(0),
                      v.stride(1), first)
    else:
        cache_args = (y, y, positions, y, 0, 0, 0, 0, 0, 0, H)
    if T:
        rest = D - rope_dim
        # a few heads per program: one program for a decode token's 40 heads took 8.8 us on an H200 (one
        # SM), a tenth of the launch's data per program spreads it over ten
        block_h = min(triton.next_power_of_2(H), _ROPE_HEADS)
        _rope_kernel[(T, triton.cdiv(H, block_h))](
            x, y, positions, cos.contiguous(), sin.contiguous(), x.stride(0), x.stride(1), H, *cache_args,
            *norm_args, D=D, ROT=rope_dim, NEOX=neox, BLOCK_H=block_h,
            HALF=triton.next_power_of_2(max(rope_dim // 2, 1)), REST=triton.next_power_of_2(rest) if rest else 0,
            STORE=store is not None, BLOCK_D=triton.next_power_of_2(D), NORM=norm is not None,
            **pdl.launch_args(x.device),
        )
    return y


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, q_ptr, qd_ptr, qs_ptr, stride_x, F, BLOCK: tl.constexpr, Q8: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=live, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * F + cols, y, mask=live)
    if Q8:  # this program's BLOCK // 32 blocks of the row's q8_1
        store_q8_1(y.to(tl.float32), tl.program_id(1) * (BLOCK // 32), q_ptr + row * F, qd_ptr + row * (F // 32),
                   qs_ptr + row * (F // 32), F // 32, BLOCK // 32)


def silu_mul(gate_up: torch.Tensor, q8_1: bool = False) -> torch.Tensor | tuple[torch.Tensor, Q8_1]:
    """gate_up [T, 2F] (gate then up, unit stride along features) -> silu(gate) * up [T, F]; with q8_1
    (F a multiple of 32), (that, its q8_1)."""
    T, F2 = gate_up.shape
    if F2 % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul takes [T, 2F] with unit feature stride; got {tuple(gate_up.shape)}")
    F = F2 // 2
    y = torch.empty(T, F, dtype=gate_up.dtype, device=gate_up.device)
    q8 = _q8_1_out(q8_1, T, F, gate_up)
    block = max(32, min(1024, triton.next_power_of_2(F)))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(F, block))](gate_up, y, *(q8 or (y, y, y)), gate_up.stride(0), F,
                                                      BLOCK=block, Q8=q8 is not None,
                                                      **pdl.launch_args(gate_up.device))
    return (y, q8) if q8_1 else y


@triton.jit
def _gate_heads_kernel(a_ptr, g_ptr, y_ptr, q_ptr, qd_ptr, qs_ptr, stride_at, stride_ah, stride_gt, stride_gh,
                       H: tl.constexpr, D: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0), head program_id(1): y = a sigmoid(gate) over the head's D features."""
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    a = tl.load(a_ptr + t * stride_at + h * stride_ah + d).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + d).to(tl.float32)
    y = (a * (1.0 / (1.0 + tl.exp(-g)))).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * (H * D) + h * D + d, y)
    if Q8:
        n = H * D
        store_q8_1(y.to(tl.float32), h * (D // 32), q_ptr + t * n, qd_ptr + t * (n // 32), qs_ptr + t * (n // 32),
                   n // 32, D // 32)


def gate_heads(a: torch.Tensor, gate: torch.Tensor, q8_1: bool = False) -> tuple[torch.Tensor, Q8_1 | None]:
    """a, gate [T, H, D] (unit stride along D, D a power of two) -> (a sigmoid(gate) [T, H D] in a's type, its
    q8_1 where asked (D a multiple of 32), else None): gated attention's output gate, one launch."""
    T, H, D = a.shape
    if gate.shape != a.shape or a.stride(2) != 1 or gate.stride(2) != 1 or D & (D - 1) or (q8_1 and D % 32):
        raise ValueError(f"gate_heads: a {tuple(a.shape)} {a.stride()}, gate {tuple(gate.shape)} {gate.stride()}")
    y = torch.empty(T, H * D, dtype=a.dtype, device=a.device)
    q8 = _q8_1_out(q8_1, T, H * D, a)
    if T:
        _gate_heads_kernel[(T, H)](a, gate, y, *(q8 or (y, y, y)), a.stride(0), a.stride(1), gate.stride(0),
                                   gate.stride(1), H=H, D=D, Q8=q8 is not None, **pdl.launch_args(a.device))
    return y, q8
