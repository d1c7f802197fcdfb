"""Prefill and chunked-prefill attention over the paged KV cache: a variable-length batch, causal.

Sequence s has start = seq_lens[s] - n cached tokens and n = query_start[s + 1] - query_start[s] new ones
(rows query_start[s] .. of q, their k/v already written to the cache); new token i sits at position
start + i and sees keys 0 .. start + i. n = 1 is a decode token, so a mixed batch takes this one kernel.

Grid (seqs, query blocks, kv_heads). A program's BLOCK_M rows are BLOCK_Q consecutive new tokens x the
BLOCK_G (group padded to a power of two) query heads of one kv head, row r = token r // BLOCK_G, head
r % BLOCK_G: GQA loads each K/V tile once for the group and feeds one [BLOCK_M, D] x [D, BLOCK_N] tl.dot.
Keys [0, first + 1) rounded down to BLOCK_N, first the block's first query position, are visible to every
row: those tiles skip the causal mask; the tiles after them up to the block's last position take it.
Query blocks past a sequence's n return at once. With a WINDOW a row sees the last WINDOW positions only,
so the keys start at the block's first row's window and every tile takes both masks; with SINKS each head's
sink logit joins its rows' denominators after the last tile.

Torch reference: `reference_prefill` (keys gathered through the block table, float64 causal softmax).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.attention_common import (
    LOG2E,
    attend_tile,
    check_inputs,
    gather_keys,
    head_tiles,
    launch_params,
    reference_attention,
)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, qstart_ptr, out_ptr,  # pointers
    sinks_ptr,  # SINKS: each query head's sink logit [H] f32
    qk_scale,  # scalars
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ts, stride_ot, stride_oh,  # strides
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,  # meta
    BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = 0,
):
    seq = tl.program_id(0)
    qblock = tl.program_id(1)
    kvh = tl.program_id(2)
    row0 = tl.load(qstart_ptr + seq)
    n = tl.load(qstart_ptr + seq + 1) - row0
    if qblock * BLOCK_Q >= n:
        return
    seq_len = tl.load(lens_ptr + seq)
    start = seq_len - n

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    t = qblock * BLOCK_Q + r // BLOCK_G  # new-token index in the sequence
    g = r % BLOCK_G
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    qmask = ((t < n) & (g < GROUP))[:, None] & (d < HEAD_DIM)[None, :]
    rows = (row0 + t).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    qpos = start + t  # rows past n get positions past the block's last: masked out at the store

    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    table = table_ptr + seq.to(tl.int64) * stride_ts
    first = start + qblock * BLOCK_Q
    hi = tl.minimum(first + BLOCK_Q, seq_len)  # one past the block's last query position
    if WINDOW:
        # from the tile of the block's first row's oldest visible key; each row masks its own window
        for kstart in range(tl.maximum(first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            acc, l, m = attend_tile(acc, l, m, q, k_head, v_head, table, kstart, hi, qpos, qk_scale,
                                    stride_ks, stride_vs, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D, True, DOT_F32, WINDOW)
    else:
        full_end = (first + 1) // BLOCK_N * BLOCK_N
        # key 0 is in the first tile either loop runs and every row sees it: m is finite from then on
        for kstart in range(0, full_end, BLOCK_N):
            acc, l, m = attend_tile(acc, l, m, q, k_head, v_head, table, kstart, hi, qpos, qk_scale,
                                    stride_ks, stride_vs, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D, False, DOT_F32)
        for kstart in range(full_end, hi, BLOCK_N):
            acc, l, m = attend_tile(acc, l, m, q, k_head, v_head, table, kstart, hi, qpos, qk_scale,
                                    stride_ks, stride_vs, HEAD_DIM, PAGE, BLOCK_N, BLOCK_D, True, DOT_F32)
    if SINKS:  # log2 units, as the scores: ln's logit times log2(e)
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    if WINDOW:  # rows past the sequence's new tokens may see no key at all (they are not stored)
        l = tl.where(l > 0, l, 1.0)

    o = acc / l[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=qmask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, page_size: int,
                      max_query_len: int, out: torch.Tensor | None = None, window: int = 0,
                      sinks: torch.Tensor | None = None, **params: Any) -> torch.Tensor:
    """q [T, H, D] with sequence s on rows query_start[s] .. query_start[s + 1] - 1 (query_start [S + 1]
    int32 from 0 to T, every sequence at least one row; max_query_len the most rows of one, given so the
    grid needs no device sync); block_tables [S, blocks] int32; seq_lens [S] int32 (cached + new keys).
    Returns [T, H, D] in q's dtype. params override launch_params. window > 0: a query sees its last
    `window` positions; sinks [H] f32: each head's sink logit."""
    H, KV, D = check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    S = seq_lens.shape[0]
    if query_start.dtype != torch.int32 or query_start.shape != (S + 1,):
        raise ValueError(f"query_start is [S + 1] int32, got {tuple(query_start.shape)} {query_start.dtype}")
    if q.stride(2) != 1:
        q = q.contiguous()
    meta, opts = launch_params("prefill", params)
    block_m, block_n = meta["block_m"], meta["block_n"]
    group = H // KV
    block_g = triton.next_power_of_2(group)
    if block_m & (block_m - 1) or block_m < max(16, block_g) or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"prefill: block_m {block_m} (a power of two >= 16 and >= the padded group {block_g}) "
                         f"and block_n {block_n} (a power of two >= 16)")
    block_q = block_m // block_g
    block_d, dot_f32 = head_tiles(D, k_cache.dtype)
    if out is None:
        out = torch.empty_like(q)
    grid = (S, triton.cdiv(max_query_len, block_q), KV)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, sinks if sinks is not None else seq_lens,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=D, PAGE=page_size, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_D=block_d,
        BLOCK_N=block_n, DOT_F32=dot_f32, WINDOW=window, SINKS=int(sinks is not None), **opts,
    )
    return out


def reference_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, page_size: int, window: int = 0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [T, H, D]: each sequence's new rows against its keys 0 .. start + i (the last `window`),
    gathered slot by slot."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    bounds = query_start.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        r0, r1 = bounds[s], bounds[s + 1]
        keys = gather_keys(k_cache, block_tables[s], length, page_size)
        values = gather_keys(v_cache, block_tables[s], length, page_size)
        out[r0:r1] = reference_attention(q[r0:r1], keys, values, length - (r1 - r0), scale, window, sinks)
    return out
