"""Causal self-attention over the paged KV cache, with GQA.

The cache is one pool of slots per layer: k/v of shape [layers, num_slots, kv_heads, head_dim], slot =
block_id * block_size + offset (engine/kv_cache.py). `cached_attention` writes the new tokens' k/v and
attends: on a GPU through the Triton kernels (`paged_attention`: block tables from ForwardBatch.attention,
triton_kernels/attention.py), on a CPU through torch (`torch_attention`: each sequence's keys gathered
through its slot list, then SDPA). Both give the same result; the kernels are checked against float64
references and against `torch_attention` in tests/triton_kernels/test_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vegaserve.engine.forward_batch import ForwardBatch


class KVCache:
    def __init__(self, n_layers: int, num_slots: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (n_layers, num_slots, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KV, D] for the new tokens. Writes k/v to the cache; returns [T, H, D]."""
    if q.device.type == "cuda":  # ROCm builds of torch name HIP devices "cuda" as well
        return paged_attention(q, k, v, layer, cache, batch, scale)
    return torch_attention(q, k, v, layer, cache, batch, scale)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """cached_attention through the Triton kernels: decode when every sequence brings one token, else the
    prefill kernel for the whole (possibly mixed) batch."""
    from vegaserve.triton_kernels.attention import attend, write_kv  # Triton only where the kernels run

    a = batch.attention
    kc, vc = cache.k[layer], cache.v[layer]
    write_kv(kc, vc, a.new_slots, k, v)
    return attend(q, kc, vc, a.block_tables, a.seq_lens, a.query_start, scale, a.page_size, a.max_seq_len,
                  a.max_query_len)


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """cached_attention in torch, one sequence at a time: the CPU path."""
    out = torch.empty_like(q)
    kc, vc = cache.k[layer], cache.v[layer]
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        end = s.start + s.n
        new = s.slots[s.start : end]
        kc[new] = k[rows]
        vc[new] = v[rows]
        qs = q[rows].transpose(0, 1)  # [H, n, D]
        ks = kc[s.slots].transpose(0, 1)  # [KV, L, D]
        vs = vc[s.slots].transpose(0, 1)
        mask = None
        if s.n > 1:
            # query i sits at position start + i and sees keys 0 .. start + i
            qpos = torch.arange(s.start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out
