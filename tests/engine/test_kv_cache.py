"""Paged KV block pool: allocation, prefix caching, LRU eviction and the absence of leaks, against
bookkeeping written here (which table holds which block)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vegaserve.engine import kv_cache
from vegaserve.engine.kv_cache import BlockPool, BlockTable, NoFreeBlocks

# ---------------------------------------------------------------------------------------------- helpers


def admit(pool: BlockPool, tokens: list[int], computed: int | None = None) -> BlockTable:
    """A request as the scheduler would run it: match its prefix, give the rest slots, compute, cache."""
    table = BlockTable(pool)
    table.adopt(pool.match_prefix(tokens))
    table.append_slots(len(tokens) - table.num_slots)
    pool.cache_full_blocks(tokens, table, len(tokens) if computed is None else computed)
    return table


def assert_consistent(pool: BlockPool, live: list[BlockTable]) -> None:
    """The pool agrees with the tables: ref counts are the number of live tables holding a block; free,
    evictable and referenced split the blocks with no overlap. Reads the pool's two queues directly."""
    held = Counter(b for table in live for b in table.block_ids)
    free, evictable = list(pool._free), list(pool._evictable)
    assert len(set(free)) == len(free) and not set(free) & set(evictable)
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == held[b] >= 0
        if b in free:
            assert held[b] == 0 and pool.hash_of(b) is None
        elif b in evictable:
            assert held[b] == 0 and pool.hash_of(b) is not None
        else:
            assert held[b] > 0, f"block {b} is neither free, evictable nor referenced: leaked"
    assert pool.num_free == len(free) + len(evictable)
    assert pool.num_free + sum(1 for b in held if held[b]) == pool.num_blocks
    assert pool.usage == pytest.approx(len(held) / pool.num_blocks)


# ------------------------------------------------------------------------------------ allocate and free


def test_allocate_then_free_round_trips_every_block():
    pool = BlockPool(8, 4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and all(pool.ref_count(b) == 1 for b in ids)
    assert pool.num_free == 5 and pool.usage == pytest.approx(3 / 8)
    pool.free(ids)
    assert pool.num_free == 8 and pool.usage == 0 and all(pool.ref_count(b) == 0 for b in ids)
    assert sorted(pool.allocate(8)) == list(range(8))


def test_double_free_is_refused_and_changes_nothing():
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match=f"block {a}"):
        pool.free([a, b, a])
    assert pool.ref_count(a) == pool.ref_count(b) == 1 and pool.num_free == 2


def test_no_free_blocks_when_everything_is_referenced_names_asked_and_free():
    pool = BlockPool(4, 4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks, match="asked for 2 KV blocks but only 1 are free") as err:
        pool.allocate(2)
    assert (err.value.asked, err.value.free) == (2, 1) and pool.num_free == 1  # all or nothing
    # cached blocks that are still referenced are not evictable either
    pool = BlockPool(2, 4)
    held = admit(pool, list(range(8)))
    assert all(pool.hash_of(b) is not None for b in held.block_ids)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_append_slots_allocates_a_block_only_when_one_fills_and_is_all_or_nothing():
    pool = BlockPool(3, 4)
    table = BlockTable(pool)
    assert len(table.append_slots(3)) == 1
    assert table.append_slots(1) == [] and len(table.block_ids) == 1
    assert len(table.append_slots(5)) == 2 and table.num_slots == 9
    before = (list(table.block_ids), table.num_slots)
    with pytest.raises(NoFreeBlocks):
        table.append_slots(4)
    assert (table.block_ids, table.num_slots) == before and pool.num_free == 0


def test_slot_mapping_is_block_id_times_block_size_plus_offset():
    pool = BlockPool(8, 4)
    a, b = BlockTable(pool), BlockTable(pool)
    a.append_slots(4)
    b.append_slots(4)
    a.append_slots(4)  # a's blocks are not contiguous: [0, 2]
    assert a.block_ids == [0, 2]
    assert a.slot_mapping(2, 4) == [2, 3, 8, 9]
    assert b.slot_mapping(0, 4) == [4, 5, 6, 7]
    with pytest.raises(IndexError):
        a.slot_mapping(6, 3)


def test_release_twice_frees_once():
    pool = BlockPool(4, 4)
    table = BlockTable(pool)
    table.append_slots(6)
    table.release()
    table.release()
    assert pool.num_free == 4 and table.block_ids == [] and table.num_slots == 0
    assert_consistent(pool, [])


# ------------------------------------------------------------------------------------------ prefix cache


def test_second_request_with_the_same_prefix_shares_its_cached_blocks():
    pool = BlockPool(8, 4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = admit(pool, prompt)
    assert (pool.queries, pool.hits) == (10, 0)
    second = BlockTable(pool)
    assert second.adopt(pool.match_prefix(prompt)) == 8
    assert second.block_ids == first.block_ids[:2]
    assert [pool.ref_count(b) for b in first.block_ids] == [2, 2, 1]
    assert (pool.queries, pool.hits) == (20, 8)  # in tokens
    second.append_slots(2)
    assert second.block_ids[2] != first.block_ids[2]  # the partial block is never shared
    assert_consistent(pool, [first, second])


def test_a_match_told_where_it_may_end_stops_at_the_last_block_it_accepts():
    """`ends` (a hybrid model's saved states): of three cached blocks only the second may end the run, so two
    are matched, referenced and counted; count_cached sees all three and takes nothing; extend_chain gives
    the chain hashes the table holds, from scratch or grown from the first one."""
    pool = BlockPool(8, 4)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    first = admit(pool, prompt)
    hashes = list(first.block_hashes)
    assert kv_cache.extend_chain([], prompt, 3, 4) == hashes and len(hashes) == 3
    assert kv_cache.extend_chain(hashes[:1], prompt, 3, 4) == hashes
    assert pool.count_cached(hashes) == 3 and pool.count_cached([hashes[0], b"other", hashes[2]]) == 1
    before = (pool.queries, pool.hits, [pool.ref_count(b) for b in first.block_ids])
    assert before[2] == [1, 1, 1, 1]
    second = BlockTable(pool)
    assert second.adopt(pool.match_prefix(prompt, ends=lambda h: h == hashes[1])) == 8
    assert second.block_ids == first.block_ids[:2]
    assert [pool.ref_count(b) for b in first.block_ids] == [2, 2, 1, 1]
    assert (pool.queries, pool.hits) == (before[0] + 13, before[1] + 8)
    assert pool.match_prefix(prompt, ends=lambda h: False) == [] and pool.hits == before[1] + 8
    assert_consistent(pool, [first, second])


def test_a_prefix_cache_reset_forgets_the_released_blocks_and_keeps_the_held_ones():
    pool = BlockPool(8, 4)
    held = admit(pool, list(range(10)))  # 2 full blocks cached, still referenced
    done = admit(pool, list(range(50, 60)))
    released = done.block_ids
    done.release()  # its 2 full blocks evictable, its partial one free
    assert [pool.hash_of(b) is not None for b in released] == [True, True, False]
    assert pool.reset_prefix_cache() == 2
    assert pool.match_prefix(list(range(50, 60))) == []
    assert all(pool.hash_of(b) is None for b in released) and pool.num_free == 8 - 3
    assert pool.match_prefix(list(range(10))) == held.block_ids[:2]  # a running request's blocks stay cached
    pool.free(held.block_ids[:2])
    assert_consistent(pool, [held])
    assert pool.reset_prefix_cache() == 0


def test_match_never_includes_the_block_holding_the_last_prompt_token():
    pool = BlockPool(8, 4)
    prompt = list(range(8))  # exactly two full blocks, both cached once computed
    first = admit(pool, prompt)
    assert all(pool.hash_of(b) is not None for b in first.block_ids)
    assert pool.match_prefix(prompt) == first.block_ids[:1]  # the 8th token must be recomputed for logits
    assert pool.match_prefix(prompt + [8]) == first.block_ids
    assert pool.match_prefix(prompt[:4]) == []


def test_match_stops_at_the_first_differing_block_and_hashes_chain():
    pool = BlockPool(8, 4)
    prompt = list(range(13))
    first = admit(pool, prompt)
    changed_middle = prompt[:4] + [99] + prompt[5:]
    assert pool.match_prefix(changed_middle) == first.block_ids[:1]
    changed_first = [99] + prompt[1:]  # blocks 1 and 2 equal, but their prefix is not
    assert pool.match_prefix(changed_first) == []


def test_a_digest_collision_never_shares_kv_of_different_tokens(monkeypatch):
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: b"one digest for all")
    pool = BlockPool(8, 4)
    admit(pool, [1, 2, 3, 4, 5])
    assert pool.match_prefix([5, 6, 7, 8, 9]) == []
    assert len(pool.match_prefix([1, 2, 3, 4, 5])) == 1  # equal tokens still hit


def test_chain_hash_is_128_bits_and_depends_on_the_parent():
    a = kv_cache.chain_hash(kv_cache.ROOT_HASH, [1, 2, 3, 4])
    assert len(a) == 16
    assert kv_cache.chain_hash(a, [5, 6]) != kv_cache.chain_hash(kv_cache.ROOT_HASH, [5, 6])
    assert kv_cache.chain_hash(kv_cache.ROOT_HASH, [1, 2, 3, 4]) == a


def test_only_computed_full_blocks_are_cached():
    pool = BlockPool(8, 4)
    prompt = list(range(13))
    table = admit(pool, prompt, computed=6)  # a first prompt chunk of 6 tokens
    assert [pool.hash_of(b) is not None for b in table.block_ids] == [True, False, False, False]
    assert len(pool.match_prefix(prompt)) == 1
    pool.cache_full_blocks(prompt, table, 13)
    assert [pool.hash_of(b) is not None for b in table.block_ids] == [True, True, True, False]
    with pytest.raises(ValueError):
        pool.cache_full_blocks(prompt + [0] * 4, table, 17)  # more computed than slots held


# -------------------------------------------------------------------------------------------- eviction


def test_eviction_takes_the_least_recently_released_cached_block_first():
    pool = BlockPool(4, 4)
    prompts = [[10 * r + i for i in range(4)] for r in range(3)]
    tables = [admit(pool, p) for p in prompts]  # one cached block each, one block left free
    blocks = [t.block_ids[0] for t in tables]
    for r in (1, 0, 2):
        tables[r].release()
    assert pool.allocate(1) not in ([b] for b in blocks)  # the free list first: nothing evicted
    assert all(pool.hash_of(b) is not None for b in blocks)
    assert pool.allocate(1) == [blocks[1]] and pool.hash_of(blocks[1]) is None
    assert pool.match_prefix(prompts[1] + [0]) == []
    # a hit makes block 0 the most recently used once released again, so block 2 goes next
    pool.free(pool.match_prefix(prompts[0] + [0]))
    assert pool.allocate(1) == [blocks[2]]
    assert pool.match_prefix(prompts[0] + [0]) == [blocks[0]]


def test_eviction_never_takes_a_referenced_block():
    pool = BlockPool(4, 4)
    held = admit(pool, [1, 2, 3, 4])
    admit(pool, [5, 6, 7, 8]).release()  # cached and unreferenced: evictable
    taken = pool.allocate(3)
    assert held.block_ids[0] not in taken
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert pool.ref_count(held.block_ids[0]) == 1 and pool.match_prefix([1, 2, 3, 4, 0]) == held.block_ids


def test_preempted_request_gets_its_blocks_back_and_loses_its_tail_first():
    pool = BlockPool(5, 4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    table = admit(pool, prompt)
    blocks = list(table.block_ids)
    table.release()  # preemption
    assert table.adopt(pool.match_prefix(prompt)) == 12 and table.block_ids == blocks[:3]
    assert pool.hits == 12
    table.release()
    pool.allocate(pool.num_free - 3)  # the free list: the cached blocks survive
    pool.allocate(1)  # evicts one: the sequence's last full block, so its prefix stays usable
    assert pool.match_prefix(prompt) == blocks[:2]


# -------------------------------------------------------------------------------------------- no leaks


def test_a_thousand_aborted_requests_leave_every_block_free_or_evictable():
    rng = random.Random(0)
    pool = BlockPool(48, 4)
    system_prompts = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: list[tuple[BlockTable, list[int], int]] = []  # table, tokens, computed
    for _ in range(1000):
        tokens = rng.choice(system_prompts) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        table = BlockTable(pool)
        computed = table.adopt(pool.match_prefix(tokens))
        stop = rng.randrange(computed, len(tokens) + 1)  # aborted after this many tokens
        try:
            while computed < stop:
                chunk = min(rng.randrange(1, 9), stop - computed)
                table.append_slots(chunk)
                computed += chunk
                pool.cache_full_blocks(tokens, table, computed)
        except NoFreeBlocks:
            pass
        live.append((table, tokens, computed))
        while len(live) > rng.randrange(1, 6):
            live.pop(rng.randrange(len(live)))[0].release()
        assert_consistent(pool, [t for t, _, _ in live])
    for table, _, _ in live:
        table.release()
    assert_consistent(pool, [])
    assert pool.num_free == pool.num_blocks and pool.usage == 0
    assert pool.hits > 0 and pool._evictable  # the shared-prefix path was exercised


class PoolMachine(RuleBasedStateMachine):
    """Random interleavings of admit (match + allocate + cache), grow, raw allocate/free, release and prefix
    cache resets."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, 2)
        self.tables: list[tuple[BlockTable, list[int]]] = []
        self.raw: list[int] = []  # blocks allocated directly from the pool

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12), frac=st.floats(0, 1))
    def admit(self, tokens, frac):
        table = BlockTable(self.pool)
        table.adopt(self.pool.match_prefix(tokens))
        try:
            table.append_slots(len(tokens) - table.num_slots)
        except NoFreeBlocks:
            table.release()
            return
        self.pool.cache_full_blocks(tokens, table, table.num_slots - int(frac * (len(tokens) - table.num_slots)))
        self.tables.append((table, tokens))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def grow(self, i, more):
        table, tokens = self.tables[i % len(self.tables)]
        try:
            table.append_slots(len(more))
        except NoFreeBlocks:
            return
        tokens.extend(more)
        self.pool.cache_full_blocks(tokens, table, table.num_slots)

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        try:
            self.raw.extend(self.pool.allocate(n))
        except NoFreeBlocks:
            assert n > self.pool.num_free

    @precondition(lambda self: self.raw)
    @rule()
    def free_raw(self):
        self.pool.free([self.raw.pop()])

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), twice=st.booleans())
    def release(self, i, twice):
        table, _ = self.tables.pop(i % len(self.tables))
        table.release()
        if twice:
            table.release()

    @rule()
    def reset_prefix_cache(self):
        evictable = self.pool.num_free - len(self.pool._free)
        free = self.pool.num_free
        assert self.pool.reset_prefix_cache() == evictable
        assert self.pool.num_free == free and not self.pool._evictable

    @invariant()
    def pool_matches_the_tables(self):
        raw = BlockTable(self.pool)
        raw.block_ids = self.raw  # a stand-in holder for the directly allocated blocks
        assert_consistent(self.pool, [t for t, _ in self.tables] + [raw])


TestPoolInvariantsUnderRandomInterleavings = PoolMachine.TestCase
TestPoolInvariantsUnderRandomInterleavings.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
