"""The engine's attention layer: ForwardBatch.attention derives block tables from the slot lists a real
block pool hands out, and paged_attention (the Triton kernels, under the interpreter on a CPU) gives what
torch_attention gives on a mixed prefill / chunk / decode batch, cache writes included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vegaserve.engine.forward_batch import ForwardBatch
from vegaserve.engine.kv_cache import BlockPool, BlockTable
from vegaserve.engine.layers.attention import KVCache, cached_attention, paged_attention, torch_attention

BLOCK = 4
KV, HEADS, HEAD_DIM = 2, 4, 32
SCALE = HEAD_DIM**-0.5


def scattered_tables(lengths: list[int]) -> list[BlockTable]:
    """Block tables grown a block at a time in turn, after a free that reorders the pool: no sequence
    holds consecutive blocks."""
    pool = BlockPool(40, BLOCK)
    pool.free(pool.allocate(7)[::-1])
    tables = [BlockTable(pool) for _ in lengths]
    while any(t.num_slots < n for t, n in zip(tables, lengths, strict=True)):
        for t, n in zip(tables, lengths, strict=True):
            if t.num_slots < n:
                t.append_slots(min(BLOCK, n - t.num_slots))
    return tables


def batch_of(plan: list[tuple[int, int]], block_size: int | None, device: str = "cpu") -> ForwardBatch:
    """(cached, new) per sequence -> a ForwardBatch over scattered blocks."""
    tables = scattered_tables([c + n for c, n in plan])
    seqs = [(t.slot_mapping(0, c + n), c, list(range(n))) for t, (c, n) in zip(tables, plan, strict=True)]
    return ForwardBatch.build(seqs, [False] * len(plan), torch.device(device), block_size=block_size)


# the kernels' device: the GPU where there is one, else the CPU under the interpreter (tests/conftest.py)
KERNELS = "cuda" if torch.cuda.is_available() else "cpu"


PLAN = [(0, 9), (6, 1), (13, 5), (0, 1), (3, 1)]  # prompt, decode, chunk after 13, first token, decode


@pytest.mark.parametrize("block_size", [BLOCK, None], ids=["blocks", "slot-pages"])
def test_block_tables_map_every_position_to_its_slot(block_size):
    fb = batch_of(PLAN, block_size)
    a = fb.attention
    page = block_size or 1
    assert a.page_size == page and a.block_tables.dtype == torch.int32
    for i, s in enumerate(fb.seqs):
        pos = torch.arange(s.start + s.n)
        assert torch.equal(a.block_tables[i].long()[pos // page] * page + pos % page, s.slots)
    assert a.seq_lens.tolist() == [c + n for c, n in PLAN]
    assert a.query_start.tolist() == [0, 9, 10, 15, 16, 17]
    assert torch.equal(a.new_slots, torch.cat([s.slots[s.start :] for s in fb.seqs]))
    assert (a.max_seq_len, a.max_query_len) == (18, 9)
    assert fb.attention is a  # built once per step


def fill_cache(cache: KVCache, fb: ForwardBatch, gen: torch.Generator) -> None:
    """Random keys at every cached position (what earlier steps wrote); NaN everywhere else."""
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    for s in fb.seqs:
        old = s.slots[: s.start]
        cache.k[:, old] = torch.randn(cache.k.shape[0], s.start, KV, HEAD_DIM, generator=gen)
        cache.v[:, old] = torch.randn(cache.v.shape[0], s.start, KV, HEAD_DIM, generator=gen)


@pytest.mark.parametrize("plan", [PLAN, [(6, 1), (0, 1), (17, 1)]], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size", [BLOCK, None], ids=["blocks", "slot-pages"])
def test_paged_attention_equals_torch_attention(plan, block_size):
    fb = batch_of(plan, block_size)
    gen = torch.Generator().manual_seed(0)
    torch_cache = KVCache(2, 160, KV, HEAD_DIM, torch.float32, torch.device("cpu"))
    fill_cache(torch_cache, fb, gen)
    kernel_cache = KVCache(2, 160, KV, HEAD_DIM, torch.float32, torch.device(KERNELS))
    kernel_cache.k.copy_(torch_cache.k)
    kernel_cache.v.copy_(torch_cache.v)
    T = fb.input_ids.numel()
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(T, KV, HEAD_DIM, generator=gen)
    v = torch.randn(T, KV, HEAD_DIM, generator=gen)
    got, none = paged_attention(q.to(KERNELS), k.to(KERNELS), v.to(KERNELS), 1, kernel_cache,
                                batch_of(plan, block_size, KERNELS), SCALE)
    assert none is None  # no q8_1 copy unless asked
    want = torch_attention(q, k, v, 1, torch_cache, fb, SCALE)
    got = got.cpu()
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert torch.equal(kernel_cache.k.cpu().nan_to_num(7.0), torch_cache.k.nan_to_num(7.0))
    assert torch.equal(kernel_cache.v.cpu().nan_to_num(7.0), torch_cache.v.nan_to_num(7.0))


def test_cached_attention_on_a_cpu_is_the_torch_path():
    fb = batch_of(PLAN, BLOCK)
    gen = torch.Generator().manual_seed(1)
    caches = [KVCache(1, 160, KV, HEAD_DIM, torch.float32, torch.device("cpu")) for _ in range(2)]
    T = fb.input_ids.numel()
    q, k, v = (torch.randn(T, h, HEAD_DIM, generator=gen) for h in (HEADS, KV, KV))
    got, none = cached_attention(q, k, v, 0, caches[0], fb, SCALE, want_q8_1=True)
    assert none is None  # the torch path writes no q8_1 copy: the o_proj quantizes for itself
    assert torch.equal(got, torch_attention(q, k, v, 0, caches[1], fb, SCALE))


def test_a_cpu_batch_marks_sequences_whose_slots_are_one_run():
    """SeqSlice.run: the first slot where a CPU batch's sequence holds consecutive slots, else -1 (blocks in
    another order whose first and last slots still span the length, a gap, a GPU batch's)."""
    runs = [list(range(8, 8 + 13)), [*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)],
            [*range(0, 4), *range(8, 10)], [5]]
    fb = ForwardBatch.build([(s, len(s) - 1, [1]) for s in runs], [False] * 4, torch.device("cpu"))
    assert [s.run for s in fb.seqs] == [8, -1, -1, 5]
    if torch.cuda.is_available():
        fb = ForwardBatch.build([(runs[0], 12, [1])], [False], torch.device("cuda"))
        assert fb.seqs[0].run == -1


def test_torch_attention_reads_a_run_of_slots_as_it_gathers_them():
    """Sequences on consecutive slots (read as a slice of the cache) and the same on scattered ones (gathered):
    the same outputs, bit for bit, and the same cache writes."""
    gen = torch.Generator().manual_seed(3)
    plan = [(6, 1), (0, 5), (11, 1)]
    contiguous, first = [], 2
    for c, n in plan:
        contiguous.append((list(range(first, first + c + n)), c, list(range(n))))
        first += c + n + 3
    runs = ForwardBatch.build(contiguous, [False] * 3, torch.device("cpu"))
    assert all(s.run >= 0 for s in runs.seqs)
    gathered = ForwardBatch.build(contiguous, [False] * 3, torch.device("cpu"))
    gathered.seqs[:] = [dataclasses.replace(s, run=-1) for s in gathered.seqs]
    T = sum(n for _, n in plan)
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(T, KV, HEAD_DIM, generator=gen)
    v = torch.randn(T, KV, HEAD_DIM, generator=gen)
    outs, caches = [], []
    for fb in (runs, gathered):
        cache = KVCache(1, 64, KV, HEAD_DIM, torch.float32, torch.device("cpu"))
        fill_cache(cache, fb, torch.Generator().manual_seed(5))
        outs.append(torch_attention(q, k, v, 0, cache, fb, SCALE))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    assert torch.equal(caches[0].k.nan_to_num(), caches[1].k.nan_to_num())
