"""The small per-token operations of a mixture-of-experts layer, one launch each (engine/layers/moe.py's
torch code is their reference and the CPU path):

  route    router logits [T, E] -> the top k experts' weights [T, k] f32 and ids [T, k] int64. SOFTMAX
           gating: softmax over all E, the k largest probabilities (renormalized to sum 1 where NORM);
           else the k largest logits, softmax over them (gpt-oss). The k are taken largest first, ties to
           the lower id; a NaN logit counts as -inf, so every id is an expert and the k are distinct.
  router   the same from the normed input x [T, H] and the router's weight [E, H] (+ bias): for a decode
           step's few rows the logits and the choice are one launch (programs a block of experts each; the
           last of a token's to finish chooses), else the logits through torch's matmul, then route. The
           shared expert's gate rides along as one more row: its logit handed back beside the choice
           (GATE_LOGIT), or the shared expert made every token's choice k + 1 with the logit's sigmoid as
           its weight (GATE_EXPERT: the shared expert is expert E of the stacks, with_shared_expert).
  act      each assignment's gate/up [A, 2F] (+ its expert's biases) -> silu(g) * u, or gpt-oss's clamped
           SwiGLU min(g, L) sigmoid(alpha min(g, L)) (clamp(u, -L, L) + 1), with its q8_1 copy for the
           down projection's int8 kernels where asked.
  combine  out[t] = sum_j w[t, j] (y[t k + j] + b[ids[t k + j]]) (+ sigmoid(s[t]) shared[t]): the token's k
           experts' outputs with their weights and the down biases, and the shared expert's gated output.
           On one lane the layer hands these parts on as an ExpertSum instead, and the next residual add's
           norm launch sums them (fused.add_rms_norm): the same bits, one launch fewer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.q8_1 import Q8_1, q8_1_buffers, store_q8_1


@triton.jit
def _top_k(x, e, w_ptr, ids_ptr, t, E, K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
           SOFTMAX: tl.constexpr, NORM: tl.constexpr, WIDTH: tl.constexpr):
    """One token's logits x [E_P2] (-inf past E) -> its k weights and ids, stored at row t (rows of WIDTH)."""
    x = tl.where(x == x, x, float("-inf"))  # NaN -> -inf
    if SOFTMAX:
        x = tl.exp(x - tl.max(x, 0))
        x = x / tl.sum(x, 0)
    taken = e >= E
    kk = tl.arange(0, K_P2)
    top = tl.zeros([K_P2], tl.float32)
    idx = tl.zeros([K_P2], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), x), 0)
        pick = tl.min(tl.where((x == best) & ~taken, e, E_P2), 0)
        # no match: the row's values are NaN (a softmax of all -inf), so the first expert not yet taken
        pick = tl.where(pick < E_P2, pick, tl.min(tl.where(~taken, e, E_P2), 0))
        taken = taken | (e == pick)
        top = tl.where(kk == j, best, top)
        idx = tl.where(kk == j, pick, idx)
    chosen = kk < K
    if SOFTMAX:
        if NORM:
            top = top / tl.sum(tl.where(chosen, top, 0.0), 0)
    else:
        top = tl.exp(top - tl.max(tl.where(chosen, top, float("-inf")), 0))
        top = top / tl.sum(tl.where(chosen, top, 0.0), 0)
    tl.store(w_ptr + t * WIDTH + kk, top, mask=chosen)
    tl.store(ids_ptr + t * WIDTH + kk, idx.to(tl.int64), mask=chosen)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, K: tl.constexpr, K_P2: tl.constexpr,
                  E_P2: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    _top_k(x, e, w_ptr, ids_ptr, t, E, K, K_P2, E_P2, SOFTMAX, NORM, K)


@triton.jit
def _router_kernel(x_ptr, r_ptr, b_ptr, logits_ptr, count_ptr, w_ptr, ids_ptr, s_ptr, E, H, stride_x,
                   K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, SOFTMAX: tl.constexpr,
                   NORM: tl.constexpr, BIAS: tl.constexpr, GATE: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Token program_id(0), rows program_id(1) * BLOCK_E onwards of r (E experts, and with GATE the shared
    expert's gate as row E): their logits x . r_e (+ b_e) in f32 into the token's row of `logits`; then a
    ticket on the token's counter, and the program that draws the last one chooses the token's k of the E
    experts from the whole row (_top_k), sets the counter back to 0 for the next launch, and hands on the
    gate's logit: GATE_LOGIT into s[t], GATE_EXPERT as the token's choice k + 1 (expert E, weighted by the
    logit's sigmoid). The ticket is an acquire-release atomic: every program's logits are visible to the
    last."""
    pdl.let_next_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rows = E + (GATE > 0)
    live = e < rows
    hh = tl.arange(0, BLOCK_H)
    pdl.wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hh
        xv = tl.load(x_ptr + t * stride_x + h, mask=h < H, other=0.0).to(tl.float32)
        rv = tl.load(r_ptr + e[:, None] * H + h[None, :], mask=live[:, None] & (h < H)[None, :], other=0.0)
        acc += rv * xv[None, :]
    logit = tl.sum(acc, 1)
    if BIAS:
        logit += tl.load(b_ptr + e, mask=live, other=0.0)
    tl.store(logits_ptr + t * rows + e, logit, mask=live)
    ticket = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if ticket == tl.num_programs(1) - 1:
        tl.store(count_ptr + t, 0)
        ee = tl.arange(0, E_P2)
        row = tl.load(logits_ptr + t * rows + ee, mask=ee < E, other=float("-inf"), volatile=True)
        width = K + (GATE == 2)
        _top_k(row, ee, w_ptr, ids_ptr, t, E, K, K_P2, E_P2, SOFTMAX, NORM, width)
        if GATE > 0:
            s = tl.load(logits_ptr + t * rows + E, volatile=True)
            if GATE == 1:
                tl.store(s_ptr + t, s)
            else:
                tl.store(w_ptr + t * width + K, 1.0 / (1.0 + tl.exp(-s)))
                tl.store(ids_ptr + t * width + K, t * 0 + E)


def route(logits: torch.Tensor, k: int, softmax: bool, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] f32, ids [T, k] int64), 1 <= k <= E."""
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"route: top {k} of {E} experts")
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, w, ids, E, logits.stride(0), K=k, K_P2=triton.next_power_of_2(k),
                            E_P2=triton.next_power_of_2(E), SOFTMAX=softmax, NORM=norm,
                            **pdl.launch_args(logits.device))
    return w, ids


ROUTER_ROWS = 8  # rows (tokens) up to which the router's logits and choice are one launch: a decode step's
ROUTER_TILE = 4096  # weights a program multiplies at a time (BLOCK_E x BLOCK_H)


def router_counters(device: torch.device) -> torch.Tensor:
    """The tickets of `router`'s fused launch, one a row, zero between launches: a layer keeps its own (a
    decode graph captures their address)."""
    return torch.zeros(ROUTER_ROWS, dtype=torch.int32, device=device)


ROUTER_BLOCK = 2  # router rows (experts, and a shared gate) a program of the fused launch takes
ROUTER_WARPS = 1  # and its warps: the last program's k rounds of arg-max reduce within one warp
# A launch for one token over hidden 2048, replayed in a graph on an H100 (2026-12-07, a sweep of 2-32 rows a
# program x 1, 2, 4 warps, the loop of benchmarks/bench_hybrid_ops.py's router): 257 rows 6.8 us at 2 and one
# warp against 15.4 at the 32 and four warps this took before; 128 rows 6.1 against 14.2 (at 16 and four). The decode step of the synthetic
# Qwen3.6-35B-A3B went from 2.840 to 2.597 ms with it, Qwen3-30B-A3B's from 3.241 to 3.037 ms.


GATE_LOGIT = 1  # router(shared_gate=...): the shared expert's gate logit handed back beside the choice
GATE_EXPERT = 2  # or the shared expert (expert E of the stacks) made every token's choice k + 1


def with_shared_expert(weights: torch.Tensor, ids: torch.Tensor, gate_logit: torch.Tensor,
                       expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's choice (weights and ids [T, k]) with the shared expert, id `expert`, as its k + 1st,
    weighted by the sigmoid of its gate's logit [T, 1]: GATE_EXPERT in torch (the CPU path's too)."""
    return (torch.cat([weights, torch.sigmoid(gate_logit)], dim=1),
            torch.cat([ids, torch.full_like(ids[:, :1], expert)], dim=1))


def router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, softmax: bool, norm: bool,
           counters: torch.Tensor, shared_gate: int = 0) -> tuple[torch.Tensor, ...]:
    """x [T, H] (unit stride over H), weight [E, H] f32 contiguous, bias [E] f32 or None -> route of the
    logits x weight^T (+ bias) in f32: (weights [T, k] f32, ids [T, k] int64). With shared_gate, weight's
    last row is the shared expert's gate (and bias, if any, has a row for it; E is one less): GATE_LOGIT
    hands its logits back third, [T] f32; GATE_EXPERT adds expert E to every token's choice, weighted by
    the logit's sigmoid ([T, k + 1]). Up to ROUTER_ROWS rows one launch; more, torch's matmul then route.
    counters: router_counters of this layer."""
    T, H = x.shape
    rows = weight.shape[0]
    E = rows - (shared_gate > 0)
    if weight.shape != (rows, H) or E < 1 or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"router: x {tuple(x.shape)} {x.stride()}, weight {tuple(weight.shape)}")
    if shared_gate not in (0, GATE_LOGIT, GATE_EXPERT):
        raise ValueError(f"router: shared_gate {shared_gate}")
    if T > ROUTER_ROWS:
        logits = torch.nn.functional.linear(x.float(), weight, bias)
        w, ids = route(logits[:, :E], k, softmax, norm)
        if shared_gate == GATE_LOGIT:
            return w, ids, logits[:, E].contiguous()
        if shared_gate == GATE_EXPERT:
            return with_shared_expert(w, ids, logits[:, E:], E)
        return w, ids
    if not 1 <= k <= E:
        raise ValueError(f"route: top {k} of {E} experts")
    width = k + (shared_gate == GATE_EXPERT)
    w = torch.empty(T, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, width, dtype=torch.int64, device=x.device)
    gate = torch.empty(T, dtype=torch.float32, device=x.device) if shared_gate == GATE_LOGIT else w
    if T:
        logits = torch.empty(T, rows, dtype=torch.float32, device=x.device)
        block_e = ROUTER_BLOCK
        block_h = min(ROUTER_TILE // block_e, triton.next_power_of_2(H))
        _router_kernel[(T, triton.cdiv(rows, block_e))](
            x, weight, bias if bias is not None else weight, logits, counters, w, ids, gate, E, H, x.stride(0),
            K=k, K_P2=triton.next_power_of_2(k), E_P2=triton.next_power_of_2(E), SOFTMAX=softmax, NORM=norm,
            BIAS=bias is not None, GATE=shared_gate, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=ROUTER_WARPS,
            **pdl.launch_args(x.device))
    return (w, ids, gate) if shared_gate == GATE_LOGIT else (w, ids)


@triton.jit
def _act_kernel(x_ptr, b_ptr, ids_ptr, y_ptr, q_ptr, qd_ptr, qs_ptr, stride_x, F, alpha, limit,
                BLOCK: tl.constexpr, SWIGLU_OAI: tl.constexpr, BIAS: tl.constexpr, Q8: tl.constexpr,
                PDL: tl.constexpr):
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=live, other=0.0).to(tl.float32)
    if BIAS:  # [E, 2F]: gate's then up's
        b = b_ptr + tl.load(ids_ptr + row) * (2 * F)
        g += tl.load(b + cols, mask=live, other=0.0)
        u += tl.load(b + F + cols, mask=live, other=0.0)
    if SWIGLU_OAI:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    else:
        y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * F + cols, y, mask=live)
    if Q8:  # this program's BLOCK // 32 blocks of the row's q8_1
        store_q8_1(y, tl.program_id(1) * (BLOCK // 32), q_ptr + row * F, qd_ptr + row * (F // 32),
                   qs_ptr + row * (F // 32), F // 32, BLOCK // 32)


def expert_act(gate_up: torch.Tensor, swiglu_oai: bool, alpha: float = 1.702, limit: float = 7.0,
               bias: torch.Tensor | None = None, ids: torch.Tensor | None = None,
               q8_1: bool = False) -> torch.Tensor | tuple[torch.Tensor, Q8_1]:
    """gate_up [A, 2F] f32 (gate then up) -> [A, F] f32; bias [E, 2F] by ids [A]; with q8_1 (F a multiple of
    32), (that, its q8_1)."""
    A, F2 = gate_up.shape
    if F2 % 2 or gate_up.stride(1) != 1 or (bias is not None and (ids is None or bias.shape[1] != F2)):
        raise ValueError(f"expert_act takes [A, 2F] with unit stride (and [E, 2F] biases with ids); got "
                         f"{tuple(gate_up.shape)}")
    F = F2 // 2
    y = torch.empty(A, F, dtype=torch.float32, device=gate_up.device)
    q8 = q8_1_buffers(A, F, gate_up.device) if q8_1 else None
    block = max(32, min(1024, triton.next_power_of_2(F)))
    if A:
        _act_kernel[(A, triton.cdiv(F, block))](
            gate_up, bias if bias is not None else gate_up, ids if ids is not None else gate_up, y,
            *(q8 or (y, y, y)), gate_up.stride(0), F, alpha, limit, BLOCK=block, SWIGLU_OAI=swiglu_oai,
            BIAS=bias is not None, Q8=q8 is not None, **pdl.launch_args(gate_up.device))
    return (y, q8) if q8_1 else y


@triton.jit
def expert_sum(y_ptr, w_ptr, ids_ptr, b_ptr, shared_ptr, gate_ptr, t, cols, live, H, K: tl.constexpr,
               BLOCK: tl.constexpr, BIAS: tl.constexpr, SHARED: tl.constexpr):
    """Token t's combine at `cols` (BLOCK of them, `live` within H) in f32: its k experts' rows of y (+ their
    down biases) with their weights, + the gated shared expert. combine's kernel and the residual add's
    norm (fused.add_rms_norm of an ExpertSum) both sum through here, so the two give the same bits."""
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        a = t * K + j
        v = tl.load(y_ptr + a * H + cols, mask=live, other=0.0)
        if BIAS:
            v += tl.load(b_ptr + tl.load(ids_ptr + a) * H + cols, mask=live, other=0.0)
        acc += tl.load(w_ptr + a) * v
    if SHARED:
        s = tl.load(gate_ptr + t)
        acc += tl.load(shared_ptr + t * H + cols, mask=live, other=0.0) / (1.0 + tl.exp(-s))
    return acc


@triton.jit
def _combine_kernel(y_ptr, w_ptr, ids_ptr, b_ptr, shared_ptr, gate_ptr, out_ptr, H, K: tl.constexpr,
                    BLOCK: tl.constexpr, BIAS: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < H
    acc = expert_sum(y_ptr, w_ptr, ids_ptr, b_ptr, shared_ptr, gate_ptr, t, cols, live, H, K, BLOCK, BIAS, SHARED)
    tl.store(out_ptr + t * H + cols, acc, mask=live)


class ExpertSum(NamedTuple):
    """A mixture-of-experts layer's output before its weighted sum, as `combine` takes it: y [T k, H] f32
    (each assignment's down projection), weights and ids [T, k], the down biases [E, H] and the shared
    expert's output [T, H] with its gate's logits [T], or None. On one lane the sum is left to the next
    residual add's norm (fused.add_rms_norm), one launch fewer a layer; engine/layers/norm.py's add_delta
    sums it wherever a plain add takes the output."""

    y: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    bias: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    shared_logit: torch.Tensor | None = None

    def check(self) -> tuple[int, int, int]:
        """(T, k, H), or ValueError where the parts do not fit together."""
        T, k = self.weights.shape
        H = self.y.shape[1]
        if self.y.shape[0] != T * k or (self.shared is None) != (self.shared_logit is None):
            raise ValueError(f"combine: {tuple(self.y.shape)} rows for {T} tokens of {k} experts")
        return T, k, H

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """The six pointer arguments of expert_sum (y where a part is absent)."""
        y = self.y
        return (y, self.weights, self.ids, y if self.bias is None else self.bias,
                y if self.shared is None else self.shared, y if self.shared_logit is None else self.shared_logit)


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor | None = None,
            shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """y [T k, H] f32, weights and ids [T, k] -> [T, H] f32: each token's experts' outputs (+ their down
    biases [E, H]) weighted and summed, + sigmoid(shared_logit [T]) shared [T, H] where given."""
    parts = ExpertSum(y, weights, ids, bias, shared, shared_logit)
    T, k, H = parts.check()
    out = torch.empty(T, H, dtype=torch.float32, device=y.device)
    block = max(32, min(1024, triton.next_power_of_2(H)))
    if T:
        _combine_kernel[(T, triton.cdiv(H, block))](
            *parts.pointers(), out, H, K=k, BLOCK=block, BIAS=bias is not None, SHARED=shared is not None,
            **pdl.launch_args(y.device))
    return out
