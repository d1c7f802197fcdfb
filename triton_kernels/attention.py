"""Attention over the paged KV cache, the entry points: store a step's new k/v at their slots, then attend.

    write_kv   k/v [T, KV, D] of the new tokens into k_cache / v_cache [num_slots, KV, D] at slots [T]
               (one launch for both, cast to the cache dtype): the kernels then read every key from the cache.
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
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.attention_common import to_cache
from vegaserve.triton_kernels.attention_decode import decode_attention, reference_decode
from vegaserve.triton_kernels.attention_prefill import prefill_attention, reference_prefill
from vegaserve.triton_kernels.q8_1 import Q8_1


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch, KV, D,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Token program_id(0): its k and v rows [KV, D] to their cache slot, in the caches' type."""
    pdl.let_next_start(PDL)
    pdl.wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    live = (h < KV) & (d < D)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=live)
    tl.store(kc_ptr + s * stride_kcs + h * stride_kch + d, to_cache(k, kc_ptr), mask=live)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=live)
    tl.store(vc_ptr + s * stride_vcs + h * stride_vch + d, to_cache(v, vc_ptr), mask=live)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k/v [T, KV, D] (any strides over T and KV, unit stride over D) at cache slots [T] (int64), in
    one launch for both, converted to the caches' type. Torch reference: index_copy_ of k.to(cache type)."""
    if slots.shape != (k.shape[0],) or k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"write_kv: {tuple(slots.shape)} slots for k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"into a cache of {tuple(k_cache.shape)}")
    T, KV, D = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("write_kv takes unit stride over the head dimension")
    if T:
        _write_kv_kernel[(T,)](
            k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), KV, D,
            BLOCK_H=triton.next_power_of_2(KV), BLOCK_D=triton.next_power_of_2(D), **pdl.launch_args(k.device),
        )


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, page_size: int, max_seq_len: int,
           max_query_len: int, out: torch.Tensor | None = None, q8_1: bool = False, window: int = 0,
           sinks: torch.Tensor | None = None, **params: Any) -> torch.Tensor | tuple[torch.Tensor, Q8_1 | None]:
    """q [T, H, D] of the new tokens (their k/v written) -> [T, H, D]. Arguments as prefill_attention;
    max_seq_len and max_query_len are host ints so that choosing the kernel and its grid needs no sync.
    `q8_1`: (that, its q8_1 copy [T, H * D]) from the decode kernel, which writes both; (that, None) from
    the prefill kernel, whose outputs the dense GEMMs read. window > 0: a query sees its last `window`
    positions; sinks [H] f32: each head's sink logit in its softmax's denominator."""
    if max_query_len == 1:
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, page_size, max_seq_len,
                                out=out, q8_1=q8_1, window=window, sinks=sinks, **params)
    o = prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, page_size,
                          max_query_len, out=out, window=window, sinks=sinks, **params)
    return (o, None) if q8_1 else o


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, page_size: int, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 [T, H, D]; the decode reference where every sequence has one row, else the prefill one."""
    if q.shape[0] == seq_lens.shape[0]:
        return reference_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, page_size, window, sinks)
    return reference_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, page_size, window,
                             sinks)
