"""Causal self-attention over the paged KV cache, with GQA.

The cache is one pool of slots per layer: k/v of shape [layers, num_slots, kv_heads, head_dim], slot =
block_id * block_size + offset (engine/kv_cache.py). `cached_attention` writes the new tokens' k/v and
attends: on a GPU through the Triton kernels (`paged_attention`: block tables from ForwardBatch.attention,
triton_kernels/attention.py), on a CPU through torch (`torch_attention`: each sequence's keys gathered
through its slot list, then each query row over its own keys). Both give the same result; the kernels are
checked against float64 references and against `torch_attention` in tests/triton_kernels/test_attention.py.
"""

from __future__ import annotations

import torch

from vegaserve.engine.forward_batch import ForwardBatch
from vegaserve.engine.layers.norm import Q8_1


# GPU architectures (ROCm names) that compute in bf16 natively; the others (gfx906, gfx908, RDNA1/2) get f16
_ROCM_BF16 = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


def kv_cache_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The cache type for config `cache.kv_dtype` (-ctk): auto is f32 on a CPU (the torch path attends
    in f32), bf16 on GPUs with native bf16 (CUDA sm_80 and later, CDNA2+, RDNA3+), f16 on the rest."""
    if setting != "auto":
        return getattr(torch, setting)
    if device.type != "cuda":
        return torch.float32
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return torch.bfloat16 if arch.startswith(_ROCM_BF16) else torch.float16
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


class KVCache:
    """k/v [layers, num_slots + spare, kv_heads, head_dim]. `spare` slots past num_slots belong to no
    block of the pool: padded rows of a replayed decode graph write there (engine/cuda_graphs.py).
    A hybrid model's cache covers its attention layers only; `state` holds its linear-attention layers'
    recurrent state per sequence slot (engine/layers/delta_net.py RecurrentState), else None."""

    def __init__(self, n_layers: int, num_slots: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, spare: int = 0) -> None:
        shape = (n_layers, num_slots + spare, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.state = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + (self.state.nbytes if self.state is not None else 0)


def kv_store(v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, first_k: int):
    """On a GPU, where the rotation of the keys (RotaryEmbedding's `store`) writes the new keys and values
    to the cache in its own launch: the caches of `layer`, the new tokens' slots, v [T, KV, D] and the
    first key head among the rotated heads. None elsewhere (the torch path writes in cached_attention)."""
    if v.device.type != "cuda":
        return None
    from vegaserve.triton_kernels.fused import KVStore

    return KVStore(cache.k[layer], cache.v[layer], batch.attention.new_slots, v, first_k)


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float,
    stored: bool = False, want_q8_1: bool = False, window: int = 0, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Q8_1 | None]:
    """q: [T, H, D], k/v: [T, KV, D] for the new tokens. Writes k/v to the cache unless `stored` (the
    rotation wrote them, kv_store); returns ([T, H, D], its q8_1 copy [T, H * D] or None). The copy comes
    where `want_q8_1` (the o_proj's QuantLinear.wants_q8_1) and the GPU's decode kernel wrote it with the
    output, in place of the o_proj's own quantize launch; elsewhere None, and the o_proj quantizes.
    window > 0: a query attends to the last `window` positions only (itself included); sinks [H]: one
    logit per head added to every softmax's denominator (a key that is never attended)."""
    # ROCm builds of torch name HIP devices "cuda" as well; a batch without slot lists (a decode graph's
    # static batch, engine/cuda_graphs.py) has only the kernels' inputs
    if q.device.type == "cuda" or not batch.seqs:
        return paged_attention(q, k, v, layer, cache, batch, scale, stored, want_q8_1, window, sinks)
    return torch_attention(q, k, v, layer, cache, batch, scale, window, sinks), None


def _with_q8_1(out, want_q8_1: bool) -> tuple[torch.Tensor, Q8_1 | None]:
    """A kernel entry's return (out, or (out, q8_1) where asked) as (out, q8_1 or None)."""
    return out if want_q8_1 else (out, None)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float,
    stored: bool = False, want_q8_1: bool = False, window: int = 0, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Q8_1 | None]:
    """cached_attention through the Triton kernels: decode when every sequence brings one token, else the
    prefill kernel for the whole (possibly mixed) batch."""
    from vegaserve.triton_kernels.attention import attend, write_kv  # Triton only where the kernels run

    a = batch.attention
    kc, vc = cache.k[layer], cache.v[layer]
    if not stored:
        write_kv(kc, vc, a.new_slots, k, v)
    out = attend(q, kc, vc, a.block_tables, a.seq_lens, a.query_start, scale, a.page_size, a.max_seq_len,
                 a.max_query_len, q8_1=want_q8_1, window=window, sinks=sinks)
    return _with_q8_1(out, want_q8_1)


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVCache, batch: ForwardBatch, scale: float,
    window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """cached_attention in torch, one sequence at a time: the CPU path. Where a sequence's slots are one run
    (SeqSlice.run) the cache is written and read as slices of it (a gather less a layer, and no slot index);
    elsewhere written through index_copy_ and read through index_select (on a decode step's few rows half the
    time of the same through indexing)."""
    kc, vc = cache.k[layer], cache.v[layer]
    cast = kc.dtype != q.dtype
    rows_out = []
    for s in batch.seqs:
        rows = slice(s.offset, s.offset + s.n)
        end = s.start + s.n
        if s.run >= 0:  # slots run .. run + end - 1: this step's are the last n (a copy casts to the cache's type)
            kc[s.run + s.start : s.run + end] = k[rows]
            vc[s.run + s.start : s.run + end] = v[rows]
            ks, vs = kc[s.run : s.run + end], vc[s.run : s.run + end]
        else:
            new = s.slots[s.start : end]
            kc.index_copy_(0, new, k[rows].to(kc.dtype) if cast else k[rows])
            vc.index_copy_(0, new, v[rows].to(vc.dtype) if cast else v[rows])
            ks, vs = kc.index_select(0, s.slots), vc.index_select(0, s.slots)
        if cast:  # attended in q's type, whatever the cache's
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [KV, L, D]
        # every row as a decode step computes it, over its own keys (the last `window` of them): a row's attention
        # does not depend on how its prompt was chunked or what shared its step (with the int4 products, which
        # measured batch-invariant too, speculation stays token for token exact; docs/ARCHITECTURE.md)
        for i in range(s.n):
            end_i = s.start + i + 1
            lo = max(0, end_i - window) if window else 0
            kr, vr = (ks, vs) if lo == 0 and end_i == end else (ks[:, lo:end_i], vs[:, lo:end_i])
            rows_out.append(_attend_row(q[s.offset + i], kr, vr, scale, sinks))
    if len(rows_out) == 1:
        return rows_out[0].unsqueeze(0)
    return torch.stack(rows_out) if rows_out else torch.empty_like(q)


def _attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query row q [H, D] over its keys k/v [KV, L, D] -> [H, D], the heads grouped onto their key head: three
    ops. torch's CPU SDPA took its math path where the key heads were expanded (131 us against 46 at 40 keys);
    its fused kernel with enable_gqa was faster (23 against 33 us at 130 keys) but not as exact: SmolLM2's
    argmax agreement with llama.cpp fell from 93 to 90 of 95 positions (benchmarks/compare_llamacpp.py), the
    int4 products' bf16 rounding turning its differences into visible ones. sinks [H]: one logit per head in
    the softmax's denominator (gpt-oss), a key that is never attended."""
    kv, d = k.shape[0], k.shape[2]
    g = q.reshape(kv, -1, d)  # [KV, H / KV, D]
    scores = (g @ k.transpose(1, 2)) * scale
    if sinks is None:
        p = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype).reshape(kv, -1, 1)
        p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (p @ v).reshape(-1, d)
