"""Paged-attention kernels (decode split + combine, prefill / chunked prefill) against float64 references.

Caches are filled with NaN except at the positions sequences own, pages are shuffled across the pool and
block-table padding points at a NaN page, so a key read past a sequence's end shows up in the output;
outputs are NaN before each launch, so an unwritten row does too. Lengths are not multiples of the page,
tile or split sizes. Runs under TRITON_INTERPRET=1 on a CPU (tests/conftest.py) and natively on a GPU;
bf16 caches only on a GPU (the interpreter has no bf16).
"""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.attention import attend, reference_attend, write_kv
from vegaserve.triton_kernels.attention_decode import decode_attention, reference_decode
from vegaserve.triton_kernels.attention_prefill import prefill_attention, reference_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-3}
# (query heads per kv head, head_dim): GQA 1, 2, 4; 48 pads to a 64-wide tile
SHAPES = [(1, 64), (2, 48), (4, 64)]
SHAPE_IDS = [f"group{g}-d{d}" for g, d in SHAPES]
KV = 2
PAGE = 8
SCALE = 0.3


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has non-finite values (unwritten, or a key read past the end)"
    return float((y.double().cpu() - ref.cpu()).norm() / ref.norm())


def paged_cache(lens: list[int], head_dim: int, dtype: torch.dtype, seed: int, page: int = PAGE):
    """k/v caches [slots, KV, D] of NaN but for each sequence's positions, and block tables [S, blocks]
    int32 over shuffled pages; the padding and two spare pages hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page) for n in lens]
    num_pages = sum(blocks) + 2
    order = torch.randperm(num_pages, generator=gen)
    nan_page = int(order[-1])
    tables = torch.full((len(lens), max(blocks) + 1), nan_page, dtype=torch.int32)
    k = torch.full((num_pages * page, KV, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    used = 0
    for s, n in enumerate(lens):
        tables[s, : blocks[s]] = order[used : used + blocks[s]]
        used += blocks[s]
        pos = torch.arange(n)
        slots = tables[s].long()[pos // page] * page + pos % page
        k[slots] = torch.randn(n, KV, head_dim, generator=gen)
        v[slots] = torch.randn(n, KV, head_dim, generator=gen)
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), tables.to(DEVICE), gen


def query_layout(lens: list[int], news: list[int]):
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    bounds = [0]
    for n in news:
        bounds.append(bounds[-1] + n)
    return seq_lens, torch.tensor(bounds, dtype=torch.int32, device=DEVICE)


def nan_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


# ------------------------------------------------------------------------------------------------ decode

DECODE_LENS = [1, 13, 40, 77]  # one key; inside a page; across splits of 32 keys; a partial last page


@pytest.mark.parametrize("group,head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_decode_split_and_combine_match_reference(dtype, group, head_dim):
    k, v, tables, gen = paged_cache(DECODE_LENS, head_dim, dtype, seed=1)
    seq_lens, _ = query_layout(DECODE_LENS, [1] * len(DECODE_LENS))
    q = torch.randn(len(DECODE_LENS), group * KV, head_dim, generator=gen).to(DEVICE)
    out = decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, max(DECODE_LENS), out=nan_like(q),
                           block_n=16, split_keys=32)
    assert rel_err(out, reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE)) < TOL[dtype]


def test_decode_in_one_split_writes_the_output_directly(monkeypatch):
    from vegaserve.triton_kernels import attention_decode

    def no_partials(*args):
        raise AssertionError("one split needs no partial buffers")

    monkeypatch.setattr(attention_decode, "partial_buffers", no_partials)
    k, v, tables, gen = paged_cache(DECODE_LENS, 64, torch.float32, seed=2)
    seq_lens, _ = query_layout(DECODE_LENS, [1] * len(DECODE_LENS))
    q = torch.randn(len(DECODE_LENS), 4, 64, generator=gen).to(DEVICE)
    out = decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, max(DECODE_LENS), out=nan_like(q),
                           block_n=32, split_keys=128, min_programs=0)
    assert rel_err(out, reference_decode(q, k, v, tables, seq_lens, SCALE, PAGE)) < 1e-5


def test_decode_with_page_size_one_reads_a_plain_slot_list():
    lens = [5, 22]
    k, v, tables, gen = paged_cache(lens, 64, torch.float32, seed=3, page=1)
    seq_lens, _ = query_layout(lens, [1, 1])
    q = torch.randn(2, 2, 64, generator=gen).to(DEVICE)
    out = decode_attention(q, k, v, tables, seq_lens, SCALE, 1, max(lens), out=nan_like(q), block_n=16, split_keys=16)
    assert rel_err(out, reference_decode(q, k, v, tables, seq_lens, SCALE, 1)) < 1e-5


@pytest.mark.parametrize("head_dim,split_keys,dtype", [(64, 32, torch.float32), (64, 128, torch.float16),
                                                      (48, 32, torch.float32)],
                         ids=["combine-f32", "one-split-f16", "d48-quantize-launch"])
def test_decode_writes_the_q8_1_copy_that_quantize_q8_1_of_its_output_gives(monkeypatch, head_dim, split_keys,
                                                                            dtype):
    """q8_1=True: the output is the same bits as without it, and the q8_1 copy (buffers poisoned: q 77, d and
    s NaN) equals quantize_q8_1 of that output, code for code and scale for scale: written by the combine
    (splits of 32 keys), by the split kernel (one split), or, where a head is not whole q8_1 blocks of
    its tile (head_dim 48 in a 64-wide tile), by a quantize launch after it."""
    from vegaserve.triton_kernels import attention_decode
    from vegaserve.triton_kernels.q8_1 import q8_1_buffers, quantize_q8_1

    def poisoned(M, K, device):
        q, d, sums = q8_1_buffers(M, K, device)
        return q.fill_(77), d.fill_(float("nan")), sums.fill_(float("nan"))

    monkeypatch.setattr(attention_decode, "q8_1_buffers", poisoned)
    group = 4
    H, S = group * KV, len(DECODE_LENS)
    k, v, tables, gen = paged_cache(DECODE_LENS, head_dim, dtype, seed=21)
    seq_lens, _ = query_layout(DECODE_LENS, [1] * S)
    q = torch.randn(S, H, head_dim, generator=gen).to(dtype).to(DEVICE)
    args = (q, k, v, tables, seq_lens, SCALE, PAGE, max(DECODE_LENS))
    cfg = dict(block_n=16, split_keys=split_keys, min_programs=0)
    plain = decode_attention(*args, out=nan_like(q), **cfg)
    out, (codes, d, sums) = decode_attention(*args, out=nan_like(q), q8_1=True, **cfg)
    assert torch.equal(out, plain)
    want = quantize_q8_1(out.reshape(S, -1))
    assert torch.equal(codes, want[0])
    assert torch.equal(d, want[1]) and torch.equal(sums, want[2])
    assert bool((codes != 0).any())  # a real activation, not a copy of zeros


# ----------------------------------------------------------------------------------------------- prefill

# (cached, new): a whole prompt, a chunk after 21 cached, decode tokens at 12 and at 0, a chunk that ends
# mid-page after one that started mid-page
PREFILL = [(0, 19), (21, 6), (12, 1), (0, 1), (5, 11)]


@pytest.mark.parametrize("group,head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_prefill_chunked_and_mixed_batch_matches_reference(dtype, group, head_dim):
    lens = [c + n for c, n in PREFILL]
    news = [n for _, n in PREFILL]
    k, v, tables, gen = paged_cache(lens, head_dim, dtype, seed=4)
    seq_lens, qstart = query_layout(lens, news)
    q = torch.randn(sum(news), group * KV, head_dim, generator=gen).to(DEVICE)
    out = prefill_attention(q, k, v, tables, seq_lens, qstart, SCALE, PAGE, max(news), out=nan_like(q),
                            block_m=16, block_n=16)
    assert rel_err(out, reference_prefill(q, k, v, tables, seq_lens, qstart, SCALE, PAGE)) < TOL[dtype]


def test_prefill_kernel_on_one_token_sequences_equals_decode_kernel():
    k, v, tables, gen = paged_cache(DECODE_LENS, 64, torch.float32, seed=5)
    seq_lens, qstart = query_layout(DECODE_LENS, [1] * len(DECODE_LENS))
    q = torch.randn(len(DECODE_LENS), 4, 64, generator=gen).to(DEVICE)
    pre = prefill_attention(q, k, v, tables, seq_lens, qstart, SCALE, PAGE, 1, out=nan_like(q), block_m=16, block_n=16)
    dec = decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, max(DECODE_LENS), out=nan_like(q),
                           block_n=16, split_keys=32)
    assert rel_err(pre, dec.double()) < 1e-5


def test_prefill_of_a_whole_prompt_equals_causal_sdpa():
    """The reference itself, on one contiguous sequence, against torch's causal SDPA."""
    k, v, tables, gen = paged_cache([30], 64, torch.float32, seed=6)
    seq_lens, qstart = query_layout([30], [30])
    q = torch.randn(30, 4, 64, generator=gen).to(DEVICE)
    ref = reference_prefill(q, k, v, tables, seq_lens, qstart, SCALE, PAGE)
    pos = torch.arange(30, device=DEVICE)
    slots = tables[0].long()[pos // PAGE] * PAGE + pos % PAGE
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k[slots].transpose(0, 1).double(), v[slots].transpose(0, 1).double(),
        is_causal=True, scale=SCALE, enable_gqa=True).transpose(0, 1)
    assert rel_err(ref, sdpa) < 1e-12


# ----------------------------------------------------------------------------------- entry points, checks


def test_write_kv_stores_each_token_at_its_slot_in_the_cache_dtype():
    kc = torch.zeros(10, 2, 16, dtype=torch.float16, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([7, 2, 9], device=DEVICE)
    write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc[slots], k.half()) and torch.equal(vc[slots], v.half())
    assert kc[[0, 1, 3, 4, 5, 6, 8]].abs().sum() == 0


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="the Triton interpreter truncates f32 -> bf16 whatever the rounding asked")),
])
def test_write_kv_takes_k_and_v_as_views_of_the_qkv_output_at_odd_sizes(dtype):
    gen = torch.Generator().manual_seed(3)
    T, H, KV, D = 4, 6, 3, 24  # neither KV nor D a power of two
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen).to(DEVICE)
    _, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
    k, v = k.view(T, KV, D), v.view(T, KV, D)
    kc = torch.full((12, KV, D), float("nan"), dtype=dtype, device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    slots = torch.tensor([11, 0, 5, 6], device=DEVICE)
    write_kv(kc, vc, slots, k, v)
    ref_k = torch.full_like(kc, float("nan")).index_copy_(0, slots, k.to(dtype))  # torch rounds to nearest even
    ref_v = torch.full_like(vc, float("nan")).index_copy_(0, slots, v.to(dtype))
    assert torch.equal(kc[slots], ref_k[slots]) and torch.equal(vc[slots], ref_v[slots])
    untouched = [i for i in range(12) if i not in (11, 0, 5, 6)]
    assert kc[untouched].isnan().all() and vc[untouched].isnan().all()


def test_attend_takes_decode_for_one_token_batches_and_prefill_otherwise():
    lens, news = [9, 20], [1, 4]
    k, v, tables, gen = paged_cache(lens, 64, torch.float32, seed=7)
    for rows in ([1, 1], news):
        seq_lens, qstart = query_layout(lens, rows)
        q = torch.randn(sum(rows), 2, 64, generator=gen).to(DEVICE)
        out, q8 = attend(q, k, v, tables, seq_lens, qstart, SCALE, PAGE, max(lens), max(rows), out=nan_like(q),
                         block_n=16, split_keys=16, block_m=16, q8_1=True)
        assert rel_err(out, reference_attend(q, k, v, tables, seq_lens, qstart, SCALE, PAGE)) < 1e-5
        assert (q8 is None) == (max(rows) > 1)  # the decode kernel writes the q8_1 copy, the prefill one not


def test_unsupported_shapes_and_types_are_refused_before_launch():
    k, v, tables, _ = paged_cache([4], 64, torch.float32, seed=8)
    seq_lens, qstart = query_layout([4], [1])
    q = torch.randn(1, 3, 64, device=DEVICE)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q, k, v, tables, seq_lens, SCALE, PAGE, 4)
    big = torch.zeros(8, 2, 320, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 320"):
        decode_attention(torch.zeros(1, 2, 320, device=DEVICE), big, big, tables, seq_lens, SCALE, PAGE, 4)
    with pytest.raises(ValueError, match="int32"):
        prefill_attention(q[:, :2], k, v, tables.long(), seq_lens, qstart, SCALE, PAGE, 1)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(torch.zeros(1, 16, 64, device=DEVICE), k, v, tables, seq_lens, qstart, SCALE, PAGE, 1,
                          block_m=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 caches need a GPU (the interpreter has no bf16)")
def test_bf16_cache_decode_and_prefill_match_reference():
    lens = [c + n for c, n in PREFILL]
    news = [n for _, n in PREFILL]
    k, v, tables, gen = paged_cache(lens, 128, torch.bfloat16, seed=9)
    seq_lens, qstart = query_layout(lens, news)
    q = torch.randn(sum(news), 8, 128, generator=gen).to(DEVICE)
    out = prefill_attention(q, k, v, tables, seq_lens, qstart, SCALE, PAGE, max(news), out=nan_like(q))
    assert rel_err(out, reference_prefill(q, k, v, tables, seq_lens, qstart, SCALE, PAGE)) < 3e-3
    seq_lens, _ = query_layout(lens, [1] * len(lens))
    q1 = q[: len(lens)].contiguous()
    out = decode_attention(q1, k, v, tables, seq_lens, SCALE, PAGE, max(lens), out=nan_like(q1),
                           split_keys=16, block_n=16)
    assert rel_err(out, reference_decode(q1, k, v, tables, seq_lens, SCALE, PAGE)) < 3e-3
