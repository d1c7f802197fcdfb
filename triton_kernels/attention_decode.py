"""Decode attention over the paged KV cache: one query token per sequence, flash-decoding.

    split    grid (seqs, kv_heads, splits). A program takes the `group` query heads of one kv head
             (GQA: each K/V tile is loaded once for the whole group; the head rows are padded to 16, the
             smallest tl.dot tile) and its share of its sequence's keys (below), walks them in BLOCK_N
             tiles with the online softmax of attention_common.py and writes o_p = acc / l and
             lse_p = m + log2(l) (f32, base 2).
    combine  grid (seqs, heads): out = sum_p 2^(lse_p - M) o_p / sum_p 2^(lse_p - M), M = max_p lse_p, over
             the sequence's live splits.
The launch fixes the split count (split_count): FILL splits a sequence bring the grid to min_programs
programs, and there are at least that many and at least enough for split_keys keys a split over max_seq_len.
Each sequence shares its own n keys (_share): share = min(round_up(cdiv(n, FILL), BLOCK_N), SPLIT_KEYS) keys
a split, so cdiv(n, share) splits are live and split p takes [p * share, (p + 1) * share). The others read
the length, exit and write nothing; the combine reads only the live ones. So the decode graphs' grid, sized
for max_model_len, moves only the partials a sequence's own length needs.
With one split the split kernel writes the output itself and the combine is skipped.
With `q8_1` the kernel that writes the output (the combine, or the split kernel with one split) also
writes its q8_1 copy, the o_proj's int8 mat-vec input (q8_1.store_q8_1_blocks), in place of a quantize launch.
A WINDOW keeps the keys from seq_len - WINDOW on (the splits share those); SINKS adds each head's sink
logit to its denominator once, in the kernel that writes the output.

Torch reference: `reference_decode` (keys gathered through the block table, float64 softmax).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.attention_common import (
    LOG2E,
    attend_slots,
    check_inputs,
    gather_keys,
    head_tiles,
    launch_params,
    reference_attention,
    tile_slots,
)
from vegaserve.triton_kernels.q8_1 import Q8_1, q8_1_buffers, quantize_q8_1, store_q8_1_blocks


@triton.jit
def _share(seq_len, fill, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """(lo, share, live) of a sequence of seq_len keys: its first visible key, the keys each split takes (a
    multiple of BLOCK_N, at most SPLIT_KEYS) and the splits that take any (at most split_count's)."""
    lo = 0
    if WINDOW:
        lo = tl.maximum(seq_len - WINDOW, 0)
    n = seq_len - lo
    share = tl.minimum(tl.cdiv(tl.cdiv(n, fill), BLOCK_N) * BLOCK_N, SPLIT_KEYS)
    return lo, share, tl.cdiv(n, share)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,  # pointers
    q8_ptr, q8d_ptr, q8s_ptr,  # Q8: the output's q8_1 copy, rows [S, H * D]
    sinks_ptr,  # SINKS: each query head's sink logit [H] f32
    qk_scale, fill, num_splits,  # scalars
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ts, stride_os, stride_oh,  # strides
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,  # meta
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    DOT_F32: tl.constexpr, SINGLE: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr = 0,
    SINKS: tl.constexpr = 0,
):
    pdl.let_next_start(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    # the step's lengths, block tables, positions and slots are written before its first kernel (pdl.py):
    # read before the wait, with the first tile's cache slots
    seq_len = tl.load(lens_ptr + seq)
    lo, share, live_splits = _share(seq_len, fill, WINDOW, BLOCK_N, SPLIT_KEYS)
    if part >= live_splits:  # a dead split: no key of this sequence, and the combine reads nothing of it
        return
    lo += part * share
    hi = tl.minimum(lo + share, seq_len)
    table = table_ptr + seq.to(tl.int64) * stride_ts
    slot = tile_slots(table, lo, hi, PAGE, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    qmask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    pdl.wait_for_inputs(PDL)  # q, and the cache with this step's key and value
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=qmask,
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    qpos = tl.zeros([BLOCK_G], tl.int32)  # unused: the one query sees every key
    for kstart in range(lo, hi, BLOCK_N):
        if kstart != lo:  # the first tile's slots were read before the wait
            slot = tile_slots(table, kstart, hi, PAGE, BLOCK_N)
        acc, l, m = attend_slots(acc, l, m, q, k_head, v_head, slot, kstart, hi, qpos, qk_scale,
                                 stride_ks, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, False, DOT_F32)

    if SINKS and SINGLE:  # log2 units, as the scores: ln's logit times log2(e)
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / l[:, None]  # l > 0: a live split has a key (the group's padding rows too: their q is 0)
    if SINGLE:
        dst = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + d[None, :]
        o = o.to(out_ptr.dtype.element_ty)
        tl.store(dst, o, mask=qmask)
        if Q8:  # the group's heads, HEAD_DIM / 32 blocks each (BLOCK_D == HEAD_DIM); padding rows not stored
            per: tl.constexpr = HEAD_DIM // 32
            xb = tl.reshape(o.to(tl.float32), [BLOCK_G * per, 32])
            hb = tl.reshape(heads[:, None] * per + tl.arange(0, per)[None, :], [BLOCK_G * per])
            live = tl.reshape(tl.broadcast_to((g < GROUP)[:, None], [BLOCK_G, per]), [BLOCK_G * per])
            _store_q8_1_row(xb, hb, live, q8_ptr, q8d_ptr, q8s_ptr, seq, tl.num_programs(1) * GROUP * HEAD_DIM)
    else:
        row = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_splits + part  # [S, H, P]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=qmask)
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=g < GROUP)


@triton.jit
def _decode_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lens_ptr,  # partials [S, H, P, D] f32, lse [S, H, P] f32, out [S, H, D]
    q8_ptr, q8d_ptr, q8s_ptr,  # Q8: the output's q8_1 copy, rows [S, H * D]
    sinks_ptr,  # SINKS: each head's sink logit [H] f32
    fill, num_splits,  # scalars, as the split kernel's
    stride_os, stride_oh,  # strides
    HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr = 0,
    SINKS: tl.constexpr = 0,  # meta
):
    pdl.let_next_start(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _, _, live_splits = _share(tl.load(lens_ptr + seq), fill, WINDOW, BLOCK_N, SPLIT_KEYS)  # step input: pdl.py
    pdl.wait_for_inputs(PDL)
    row = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    # two passes over the live splits in BLOCK_P chunks: the maximum, then the weighted sums
    mx = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, live_splits, BLOCK_P):
        lse = tl.load(part_lse_ptr + row + p0 + p, mask=p0 + p < live_splits, other=float("-inf"))
        mx = tl.maximum(mx, lse)
    big = tl.max(mx, 0)  # finite: every live split has a key
    if SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 units, as the lse
        big = tl.maximum(big, sink)
    acc = tl.zeros([BLOCK_D], tl.float32)
    wsum = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, live_splits, BLOCK_P):
        pmask = p0 + p < live_splits
        w = tl.exp2(tl.load(part_lse_ptr + row + p0 + p, mask=pmask, other=float("-inf")) - big)
        o = tl.load(part_o_ptr + (row + p0 + p)[:, None] * HEAD_DIM + d[None, :],
                    mask=pmask[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        wsum += w
    total = tl.sum(wsum, 0)
    if SINKS:
        total += tl.exp2(sink - big)
    out = (acc / total).to(out_ptr.dtype.element_ty)
    dst = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + d
    tl.store(dst, out, mask=dmask)
    if Q8:  # the head's HEAD_DIM / 32 blocks (BLOCK_D == HEAD_DIM)
        per: tl.constexpr = HEAD_DIM // 32
        hb = head * per + tl.arange(0, per)
        _store_q8_1_row(tl.reshape(out.to(tl.float32), [per, 32]), hb, hb >= 0, q8_ptr, q8d_ptr, q8s_ptr, seq,
                        tl.num_programs(1) * HEAD_DIM)


@triton.jit
def _store_q8_1_row(xb, blk, live, q8_ptr, q8d_ptr, q8s_ptr, seq, width):
    """Blocks blk of sequence seq's output row (width elements) into its q8_1 copy."""
    row = seq.to(tl.int64) * width
    store_q8_1_blocks(xb, blk, live, q8_ptr + row, q8d_ptr + row // 32, q8s_ptr + row // 32)


@lru_cache(maxsize=8)
def _compute_units(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the interpreter: nothing to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fill(seqs: int, kv_heads: int, min_programs: int) -> int:
    """Splits of a sequence that bring the grid's seqs * kv_heads rows to min_programs: a power of two, >= 1."""
    return triton.next_power_of_2(max(1, triton.cdiv(min_programs, seqs * kv_heads)))


def split_count(seqs: int, kv_heads: int, max_seq_len: int, window: int, block_n: int, split_keys: int,
                min_programs: int) -> int:
    """Splits a sequence, fixed by the launch: the larger of fill (the grid at min_programs programs) and
    the splits of split_keys keys the longest live range needs (max_seq_len, or the window), at most that
    range's block_n tiles. Every sequence's live splits (_share) fit: a share of split_keys makes at most
    cdiv(live, split_keys) of them, a smaller share at most fill and at most cdiv(live, block_n)."""
    live = min(max_seq_len, window) if window > 0 else max_seq_len
    splits = max(_fill(seqs, kv_heads, min_programs), triton.cdiv(live, split_keys))
    return max(1, min(splits, triton.cdiv(live, block_n)))


def partial_buffers(S: int, H: int, splits: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's o_p [S, H, splits, D] and lse_p [S, H, splits], f32; a dead split's rows stay as
    allocated (no kernel reads them)."""
    return (torch.empty(S, H, splits, D, dtype=torch.float32, device=device),
            torch.empty(S, H, splits, dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, page_size: int, max_seq_len: int,
                     out: torch.Tensor | None = None, q8_1: bool = False, window: int = 0,
                     sinks: torch.Tensor | None = None, **params: Any) -> torch.Tensor | tuple[torch.Tensor, Q8_1]:
    """q [S, H, D]: the one new token of each sequence (its k/v already in the cache); block_tables
    [S, blocks] int32, seq_lens [S] int32 (keys per sequence, at least 1; max_seq_len their maximum or more,
    given so the grid needs no device sync). Returns [S, H, D] in q's dtype. params override launch_params.
    `q8_1`: (out, its q8_1 copy as rows [S, H * D]), the bytes quantize_q8_1 of out gives, written by the
    kernel that writes out (the o_proj's int8 mat-vec then needs no quantize launch of its own).
    window > 0: the query sees the last `window` positions; sinks [H] f32: each head's sink logit."""
    H, KV, D = check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    S = q.shape[0]
    if seq_lens.shape[0] != S:
        raise ValueError(f"decode takes one query per sequence: {S} rows for {seq_lens.shape[0]} sequences")
    if q.stride(2) != 1:
        q = q.contiguous()
    meta, opts = launch_params("decode", params)
    block_n, split_keys = meta["block_n"], meta["split_keys"]
    if split_keys % block_n or split_keys < block_n or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"decode: block_n {block_n} (a power of two >= 16) must divide split_keys {split_keys}")
    min_programs = meta.get("min_programs", 2 * _compute_units(q.device))
    fill = _fill(S, KV, min_programs)
    splits = split_count(S, KV, max_seq_len, window, block_n, split_keys, min_programs)
    group = H // KV
    block_d, dot_f32 = head_tiles(D, k_cache.dtype)
    if out is None:
        out = torch.empty_like(q)
    single = splits == 1
    fused_q8 = q8_1 and block_d == D and D % 32 == 0  # each program's heads are whole q8_1 blocks
    q8 = q8_1_buffers(S, H * D, q.device) if fused_q8 else (out,) * 3
    part_o, part_lse = (out, out) if single else partial_buffers(S, H, splits, D, q.device)
    sinks_arg = sinks if sinks is not None else seq_lens
    _decode_split_kernel[(S, KV, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse, *q8, sinks_arg, scale * LOG2E, fill,
        splits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=D, PAGE=page_size, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT_KEYS=split_keys, DOT_F32=dot_f32, SINGLE=single, Q8=fused_q8, WINDOW=window,
        SINKS=int(sinks is not None), **opts, **pdl.launch_args(q.device),
    )
    if not single:
        _decode_combine_kernel[(S, H)](
            part_o, part_lse, out, seq_lens, *q8, sinks_arg, fill, splits, out.stride(0), out.stride(1),
            HEAD_DIM=D, BLOCK_P=min(32, triton.next_power_of_2(splits)), BLOCK_D=block_d, BLOCK_N=block_n,
            SPLIT_KEYS=split_keys, Q8=fused_q8, WINDOW=window, SINKS=int(sinks is not None),
            **pdl.launch_args(q.device),
        )
    if not q8_1:
        return out
    return out, q8 if fused_q8 else quantize_q8_1(out.reshape(S, H * D))


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, page_size: int, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [S, H, D]: each sequence's one query against all its keys (the last `window`), gathered slot
    by slot."""
    out = []
    for s, length in enumerate(seq_lens.tolist()):
        keys = gather_keys(k_cache, block_tables[s], length, page_size)
        values = gather_keys(v_cache, block_tables[s], length, page_size)
        out.append(reference_attention(q[s : s + 1], keys, values, length - 1, scale, window, sinks)[0])
    return torch.stack(out)
