"""The short causal convolution of a gated DeltaNet layer, over a flat batch of sequences, with its rolling
state (the last K - 1 inputs of each sequence, kept in a state slot between steps).

Layout: x [T, C] (the new rows of every sequence, concatenated; sequence s owns rows query_start[s] ..
query_start[s + 1] - 1), w [C, K] (one filter per channel, f32), state [slots, K - 1, C] f32 (rows in time
order, oldest first). For a sequence whose earlier rows are ext = [state rows; x rows]:

    y[t, c] = silu(sum_j w[c, j] ext[t + j, c])          t = 0 .. n - 1, j = 0 .. K - 1
    state  <- the last K - 1 rows of ext

A sequence with has_state 0 starts from zero rows (its first step) whatever its slot holds.

Two kernels: `conv1d_prefill` (one program per (sequence, channel block), walking its rows in blocks, so the
slot is read before it is written) and `conv1d_update` (decode: one new row per sequence). The torch
reference `causal_conv1d_ref` is the CPU path (engine/layers/delta_net.py) and the kernels' test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _conv1d_prefill_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, slots_ptr, has_state_ptr, qstart_ptr,
    C,
    stride_x, stride_y, stride_slot,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    s = tl.program_id(0)
    cb = tl.program_id(1)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = tl.load(qstart_ptr + s)
    n = tl.load(qstart_ptr + s + 1) - start
    slot = tl.load(slots_ptr + s).to(tl.int64)
    keep = tl.load(has_state_ptr + s) != 0
    st = state_ptr + slot * stride_slot
    rows = tl.arange(0, BLOCK_T)
    # the last K - 1 rows before a block: from the state for the first block, then from x
    for t0 in range(0, n, BLOCK_T):
        t = t0 + rows
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            src = t + j - (K - 1)  # row of the sequence this tap reads; < 0: the state's row K - 1 + src
            from_x = (src >= 0) & (t < n)
            xv = tl.load(x_ptr + (start + src)[:, None] * stride_x + cols[None, :],
                         mask=from_x[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            from_state = (src < 0) & (t < n)
            sv = tl.load(st + (K - 1 + src)[:, None] * C + cols[None, :], mask=from_state[:, None] & cmask[None, :],
                         other=0.0)
            sv = tl.where(keep, sv, 0.0)
            wj = tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0)
            acc += (xv + sv) * wj[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + (start + t)[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=(t < n)[:, None] & cmask[None, :])
    # the block's reads of the old state are done (this program made them all, in other threads' lanes
    # too): the last K - 1 rows of [state; x]. Row r reads old row r + n > r, not yet written.
    tl.debug_barrier()
    for r in tl.static_range(K - 1):
        src = n - (K - 1) + r + 0 * cols  # per lane, so that the masks are vectors
        xv = tl.load(x_ptr + (start + src) * stride_x + cols, mask=cmask & (src >= 0), other=0.0).to(tl.float32)
        sv = tl.load(st + (K - 1 + src) * C + cols, mask=cmask & (src < 0), other=0.0)
        tl.store(st + r * C + cols, xv + tl.where(keep, sv, 0.0), mask=cmask)


@triton.jit
def _conv1d_update_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, slots_ptr, has_state_ptr,
    C,
    stride_x, stride_y, stride_slot,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    slot = tl.load(slots_ptr + s).to(tl.int64)
    keep = tl.load(has_state_ptr + s) != 0
    st = state_ptr + slot * stride_slot
    x = tl.load(x_ptr + s * stride_x + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + cols * K + (K - 1), mask=cmask, other=0.0)
    for j in tl.static_range(K - 1):
        row = tl.where(keep, tl.load(st + j * C + cols, mask=cmask, other=0.0), 0.0)
        acc += row * tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0)
        if j > 0:  # shift: row j moves to j - 1
            tl.store(st + (j - 1) * C + cols, row, mask=cmask)
    tl.store(st + (K - 2) * C + cols, x, mask=cmask)
    tl.store(y_ptr + s * stride_y + cols, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=cmask)


def _check(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[int, int]:
    C, K = w.shape
    if x.dim() != 2 or x.shape[1] != C or x.stride(1) != 1:
        raise ValueError(f"x must be [T, {C}] with contiguous rows, got {tuple(x.shape)}")
    if state.dim() != 3 or tuple(state.shape[1:]) != (K - 1, C) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be contiguous f32 [slots, {K - 1}, {C}], got {tuple(state.shape)} {state.dtype}")
    if w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError("the filters must be contiguous f32 [C, K]")
    return C, K


def conv1d_prefill(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                   query_start: torch.Tensor, block_t: int = 32, block_c: int = 128) -> torch.Tensor:
    """silu(causal conv) of every sequence's rows [T, C] (x's type); updates each sequence's state slot.
    slots, has_state [S] int32; query_start [S + 1] int32."""
    C, K = _check(x, w, state)
    y = torch.empty_like(x)
    S = slots.numel()
    if S:
        _conv1d_prefill_kernel[(S, triton.cdiv(C, block_c))](
            x, w, state, y, slots, has_state, query_start, C, x.stride(0), y.stride(0), state.stride(0),
            K=K, BLOCK_T=block_t, BLOCK_C=block_c)
    return y


def conv1d_update(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                  block_c: int = 256) -> torch.Tensor:
    """One new row per sequence (x [S, C]): silu(causal conv) [S, C]; shifts each state slot by that row."""
    C, K = _check(x, w, state)
    y = torch.empty_like(x)
    S = x.shape[0]
    if S:
        _conv1d_update_kernel[(S, triton.cdiv(C, block_c))](
            x, w, state, y, slots, has_state, C, x.stride(0), y.stride(0), state.stride(0), K=K, BLOCK_C=block_c)
    return y


def causal_conv1d_ref(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [n, C], w [C, K], state [K - 1, C] or None (zero rows) -> (silu(conv) [n, C] in x's
    type, the new state [K - 1, C] f32)."""
    K = w.shape[1]
    prev = state.float() if state is not None else x.new_zeros(K - 1, x.shape[1], dtype=torch.float32)
    ext = torch.cat([prev, x.float()])
    n = x.shape[0]
    y = sum(ext[j : j + n] * w[:, j].float() for j in range(K))
    return F.silu(y).to(x.dtype), ext[ext.shape[0] - (K - 1) :].contiguous()
