"""Causal self-attention over the paged KV cache, with GQA (torch reference; the Triton kernels follow).

The cache is one pool of slots per layer: k/v of shape [layers, num_slots, kv_heads, head_dim], slot =
block_id * block_size + offset (engine/kv_cache.py). A sequence's keys are gathered through its slot list.
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
