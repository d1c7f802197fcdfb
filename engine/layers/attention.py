"""Causal self-attention over a per-sequence KV cache, with GQA.

The cache is slot based: k/v of shape [layers, slots, max_len, kv_heads, head_dim]; a sequence's keys
live in its slot, positions 0 .. start+n-1. (The paged cache and its kernels replace this with block
tables; the layer interface stays: q, k, v of the new tokens plus the ForwardBatch.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vegaserve.engine.forward_batch import ForwardBatch


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (n_layers, n_slots, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.n_slots = n_slots

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KV, D] for the new tokens. Writes k/v to the cache; returns [T, H, D]."""
    out = torch.empty_like(q)
    kc, vc = cache.k[layer], cache.v[layer]
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        end = s.start + s.n
        kc[s.slot, s.start : end] = k[rows]
        vc[s.slot, s.start : end] = v[rows]
        qs = q[rows].transpose(0, 1)  # [H, n, D]
        ks = kc[s.slot, :end].transpose(0, 1)  # [KV, L, D]
        vs = vc[s.slot, :end].transpose(0, 1)
        mask = None
        if s.n > 1:
            # query i sits at position start + i and sees keys 0 .. start + i
            qpos = torch.arange(s.start, end, device=q.device)[:, None]
            mask = torch.arange(end, device=q.device)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out
