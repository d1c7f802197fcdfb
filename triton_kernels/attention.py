"""Attention over the paged KV cache, the entry points: store a step's new k/v at their slots, then attend.

    write_kv   k/v [T, KV, D] of the new tokens into k_cache / v_cache [num_slots, KV, D] at slots [T]
               (index_copy_, cast to the cache dtype): the kernels then read every key from the cache.
    attend     decode_attention (attention_decode.py, flash-decoding) when every sequence brings one
               token, prefill_attention (attention_prefill.py, causal, variable lengths) otherwise; a mixed
               batch takes the prefill kernel, which handles one-token sequences too.
    reference_attend   the float64 torch references behind both.

Layout and the softmax state: attention_common.py. The engine builds the tensors once per step
(engine/forward_batch.py, ForwardBatch.attention) and calls these from engine/layers/attention.py.
"""

from __future__ import annotations

from typing import Any

import torch

from vegaserve.triton_kernels.attention_decode import decode_attention, reference_decode
from vegaserve.triton_kernels.attention_prefill import prefill_attention, reference_prefill


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k/v [T, KV, D] at cache slots [T] (int64)."""
    if slots.shape != (k.shape[0],) or k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"write_kv: {tuple(slots.shape)} slots for k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"into a cache of {tuple(k_cache.shape)}")
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, page_size: int, max_seq_len: int,
           max_query_len: int, out: torch.Tensor | None = None, **params: Any) -> torch.Tensor:
    """q [T, H, D] of the new tokens (their k/v written) -> [T, H, D]. Arguments as prefill_attention;
    max_seq_len and max_query_len are host ints so that choosing the kernel and its grid needs no sync."""
    if max_query_len == 1:
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, page_size, max_seq_len,
                                out=out, **params)
    return prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, page_size,
                             max_query_len, out=out, **params)


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, page_size: int) -> torch.Tensor:
    """Float64 [T, H, D]; the decode reference where every sequence has one row, else the prefill one."""
    if q.shape[0] == seq_lens.shape[0]:
        return reference_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, page_size)
    return reference_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, page_size)
