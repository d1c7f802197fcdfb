"""Prefix caching for hybrid models (engine/state_pool.py): a prompt's chunk ends at the last block boundary
before its final token and the state there is saved; a later request starting with those blocks adopts their
KV and resumes from the saved state, and generates what it would have from token 0. Pure logic first (the
snapshot pool, the scheduler's cuts, saves and restores), then the tiny converted models of tests/data/hybrid
end to end: one process, speculation on, two tensor-parallel processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.kv_cache import BlockPool, extend_chain
from vegaserve.engine.request import GenerateRequest, SamplingParams
from vegaserve.engine.scheduler import Request, Scheduler, Status
from vegaserve.engine.state_pool import StatePool, StateSnapshots

DATA = Path(__file__).resolve().parents[1] / "data" / "hybrid"


# -- the snapshot pool ----------------------------------------------------------------------------------

def test_the_snapshot_pool_hands_out_free_numbers_then_evicts_the_least_recently_used():
    snaps = StateSnapshots(2)
    a, b = snaps.reserve(b"a"), snaps.reserve(b"b")
    assert {a, b} == {0, 1} and b"a" in snaps and len(snaps) == 2
    assert snaps.take(b"a") == a  # now the most recently used: b goes first
    c = snaps.reserve(b"c")
    assert c == b and b"b" not in snaps and b"a" in snaps and b"c" in snaps
    with pytest.raises(ValueError, match="already saved"):
        snaps.reserve(b"a")
    with pytest.raises(KeyError):
        snaps.take(b"b")
    assert snaps.clear() == 2 and len(snaps) == 0 and sorted([snaps.reserve(b"x"), snaps.reserve(b"y")]) == [0, 1]


# -- the scheduler --------------------------------------------------------------------------------------

def _req(rid: str, ids: list[int], max_tokens: int = 4, prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    return Request(rid, list(ids), params, max_tokens)


def _sched(saved: int = 4, blocks: int = 64, budget: int = 512) -> Scheduler:
    return Scheduler(BlockPool(blocks, 16), max_num_seqs=4, token_budget=budget, states=StatePool(4),
                     snapshots=StateSnapshots(saved))


def _step(sched: Scheduler):
    """One step as the engine takes it: schedule, compute (a token drawn where a sequence samples), register."""
    batch = sched.schedule()
    for s in batch.seqs:
        s.request.num_computed += len(s.tokens)
        if s.samples:
            s.request.output_ids.append(300)
        sched.computed(s.request)
    return batch


PROMPT = list(range(1, 51))  # 50 tokens: the last boundary before the final token is 48


def _served(sched: Scheduler) -> None:
    """PROMPT run through its prompt (its state saved at 48, snapshot 0) and finished."""
    first = _req("a", PROMPT)
    sched.add(first)
    _step(sched)
    _step(sched)
    sched.finish(first)


def test_a_prompt_chunk_ends_at_its_last_block_boundary_and_the_state_there_is_saved():
    sched = _sched()
    r = _req("a", PROMPT)
    sched.add(r)
    first = _step(sched)
    assert [(s.start, len(s.tokens)) for s in first.seqs] == [(0, 48)]
    assert first.saves == ((r.state_slot, 0),) and first.restores == ()
    second = _step(sched)
    assert [(s.start, len(s.tokens), s.samples) for s in second.seqs] == [(48, 2, True)] and second.saves == ()
    assert extend_chain([], PROMPT, 3, 16)[-1] in sched.snapshots


def test_a_chunk_the_budget_ends_past_the_boundary_is_cut_there_and_one_that_ends_before_is_not():
    sched = _sched(budget=32)
    r = _req("a", PROMPT)
    sched.add(r)
    steps = [_step(sched) for _ in range(3)]
    assert [(s.seqs[0].start, len(s.seqs[0].tokens)) for s in steps] == [(0, 32), (32, 16), (48, 2)]
    assert [len(s.saves) for s in steps] == [0, 1, 0]


def test_a_request_starting_with_a_saved_prefix_adopts_its_blocks_and_restores_the_state():
    sched = _sched()
    _served(sched)
    second = _req("b", PROMPT[:48] + [7, 8, 9])
    sched.add(second)
    batch = _step(sched)
    assert batch.restores == ((0, second.state_slot),)
    assert [(s.start, len(s.tokens)) for s in batch.seqs] == [(48, 3)]
    assert sched.pool.hits == 48


def test_kv_cached_past_the_saved_state_is_not_adopted():
    """The first request's decoded tokens fill a fourth block (its KV cached, no state saved there): a prompt
    that shares all four resumes at the third, where the state was saved, and holds no reference to the fourth."""
    sched = _sched()
    first = _req("a", PROMPT, max_tokens=20)
    sched.add(first)
    while len(first.output_ids) < 20:
        _step(sched)
    assert first.num_computed >= 64
    sched.finish(first)
    second = _req("b", first.all_ids[:66])
    sched.add(second)
    batch = _step(sched)
    assert batch.restores == ((0, second.state_slot),) and batch.seqs[0].start == 48
    assert sched.pool.num_referenced == len(second.table.block_ids) == 4  # 3 adopted, and the one its tail fills
    assert batch.saves == ((second.state_slot, 1),)  # and its own last boundary, 64, is saved anew


def test_a_copy_of_a_prompt_being_computed_waits_for_its_saved_state_and_resumes_there():
    """`b` repeats `a`'s prompt (as OpenAI's n makes them): held while `a` computes up to its save point, it
    then resumes from the state saved there, beside `a`'s last tokens. With prompt logprobs (no prefix
    cache) it is not held and computes everything."""
    sched = _sched()
    a, b = _req("a", PROMPT), _req("b", PROMPT)
    sched.add(a)
    sched.add(b)
    first = _step(sched)
    assert [s.request.request_id for s in first.seqs] == ["a"] and b.status is Status.WAITING
    second = _step(sched)
    assert [(s.request.request_id, s.start, len(s.tokens)) for s in second.seqs] == [("a", 48, 2), ("b", 48, 2)]
    assert second.restores == ((0, b.state_slot),) and second.saves == ()
    logged = _req("c", PROMPT, prompt_logprobs=1)
    sched.add(logged)
    assert [(s.request.request_id, s.start) for s in _step(sched).seqs if s.request is logged] == [("c", 0)]


def test_a_prompt_sharing_a_head_with_one_being_computed_waits_for_a_state_saved_where_they_part():
    """`a` and `b` share a 40-token head (two full blocks of it) and differ after it, and arrive together:
    `b` is held and asks `a` to save its state where they part (32), so `a`'s chunk is cut there, and `b`
    then resumes from that state, beside `a`'s remaining chunks."""
    sched = _sched(budget=64)
    head = list(range(1, 41))
    a, b = _req("a", head + [100] * 20), _req("b", head + [200] * 20)
    sched.add(a)
    sched.add(b)
    first = _step(sched)
    assert [(s.request.request_id, s.start, len(s.tokens)) for s in first.seqs] == [("a", 0, 32)]
    assert first.saves == ((a.state_slot, 0),) and b.status is Status.WAITING
    second = _step(sched)
    assert [(s.request.request_id, s.start, len(s.tokens)) for s in second.seqs] == [("a", 32, 16), ("b", 32, 16)]
    assert second.restores == ((0, b.state_slot),)
    assert sched.pool.hits == 32


def test_the_oldest_snapshot_goes_first():
    sched = _sched(saved=1)
    a = _req("a", PROMPT)
    sched.add(a)
    assert len(_step(sched).saves) == 1
    sched.finish(a)
    other = _req("c", [5] * 50)
    sched.add(other)
    assert len(_step(sched).saves) == 1  # the only snapshot now holds c's prefix
    sched.finish(other)
    again = _req("d", PROMPT)
    sched.add(again)
    batch = _step(sched)
    assert batch.restores == () and batch.seqs[0].start == 0  # its KV blocks are cached, its state is not


def test_where_a_prompt_shares_cached_blocks_but_no_saved_state_its_state_is_saved_there_for_the_next():
    """Three prompts with one 40-token head (a system prompt) and different tails: the first saves at its own
    last boundary (48) only; the second finds the head's two full blocks cached but no state there, so it
    saves at 32 as well (three chunks); the third resumes at 32."""
    sched = _sched()
    head = list(range(1, 41))
    reqs = [_req(c, head + [100 + i] * 20) for i, c in enumerate("abc")]
    sched.add(reqs[0])
    assert [len(_step(sched).saves) for _ in range(2)] == [1, 0]
    sched.finish(reqs[0])
    sched.add(reqs[1])
    steps = [_step(sched) for _ in range(3)]
    assert [(b.seqs[0].start, len(b.seqs[0].tokens), len(b.saves)) for b in steps] == [(0, 32, 1), (32, 16, 1), (48, 12, 0)]
    sched.finish(reqs[1])
    sched.add(reqs[2])
    batch = _step(sched)
    assert batch.restores == ((1, reqs[2].state_slot),) and batch.seqs[0].start == 32
    assert sched.pool.hits == 32


def test_a_request_asking_prompt_logprobs_neither_resumes_nor_saves():
    sched = _sched()
    _served(sched)
    logged = _req("b", PROMPT, prompt_logprobs=1)
    sched.add(logged)
    batch = _step(sched)
    assert batch.restores == batch.saves == () and [(s.start, len(s.tokens)) for s in batch.seqs] == [(0, 50)]


def test_without_snapshots_a_hybrid_model_recomputes_a_shared_prefix():
    sched = Scheduler(BlockPool(64, 16), max_num_seqs=4, token_budget=512, states=StatePool(4))
    first = _req("a", PROMPT)
    sched.add(first)
    batch = _step(sched)
    assert [len(s.tokens) for s in batch.seqs] == [50] and batch.saves == ()
    sched.finish(first)
    again = _req("b", PROMPT)
    sched.add(again)
    assert _step(sched).seqs[0].start == 0 and again.status is Status.RUNNING and sched.pool.queries == 0


# -- the configuration ----------------------------------------------------------------------------------

def test_prefix_states_default_to_one_a_sequence_and_at_least_four():
    assert EngineConfig.from_dict({"scheduler": {"max_num_seqs": 6}}).state_snapshots == 6
    assert EngineConfig.from_dict({"scheduler": {"max_num_seqs": 1}}).state_snapshots == 4
    assert EngineConfig.from_dict({"cache": {"prefix_states": 2}}).state_snapshots == 2
    with pytest.raises(ConfigError, match="--prefix-states must be >= 0, got -1"):
        EngineConfig.from_dict({"cache": {"prefix_states": -1}})


# -- end to end -----------------------------------------------------------------------------------------

def _turns(core: EngineCore) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    """Requests one after another: a 50-token prompt; the conversation's next turn (that prompt, its reply and
    21 more tokens); another prompt sharing the first's 48 tokens; two sharing its first 40. Each one's greedy
    tokens and top-3 logprobs."""
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, 320, (50,), generator=gen).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    out = []

    def run(prompt):
        outs = core.generate_sync(GenerateRequest(list(prompt), params))
        out.append(([t for o in outs for t in o.token_ids], [lp.top for o in outs for lp in o.logprobs]))
        return out[-1][0]

    reply = run(first)
    run(first + reply + torch.randint(0, 320, (21,), generator=gen).tolist())
    run(first[:48] + torch.randint(0, 320, (9,), generator=gen).tolist())
    # two prompts sharing the first's 40-token head: the first of them saves the state at 32, the second resumes
    for _ in range(2):
        run(first[:40] + torch.randint(0, 320, (13,), generator=gen).tolist())
    return out


def _same(got, want) -> None:
    for (tokens, tops), (want_tokens, want_tops) in zip(got, want, strict=True):
        assert tokens == want_tokens and len(tokens) == len(want_tokens) > 0
        for a, b in zip(tops, want_tops, strict=True):
            assert [i for i, _ in a] == [i for i, _ in b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4


def _run(core: EngineCore) -> tuple[list, int]:
    try:
        return _turns(core), core.pool.hits
    finally:
        core.close()


@pytest.fixture(scope="module")
def recomputed() -> dict:
    """Each model's turns with prefix caching off: every prompt computed from token 0."""
    return {}


def _recomputed(converted, recomputed: dict, name: str):
    if name not in recomputed:
        recomputed[name] = _run(converted.core(DATA, name, cache={"prefix_states": 0}))
    return recomputed[name]


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe", "qwen3next"])
def test_resuming_a_saved_prefix_gives_the_tokens_and_logprobs_of_computing_it(converted, recomputed, name):
    want, hits = _recomputed(converted, recomputed, name)
    assert hits == 0
    got, hits = _run(converted.core(DATA, name))
    _same(got, want)
    assert hits == 48 + 48 + 32  # the next turn and the third prompt resumed at 48, the last one at 32


def test_resuming_under_speculation_changes_no_output(converted, recomputed):
    want, _ = _recomputed(converted, recomputed, "qwen35")
    got, hits = _run(converted.core(DATA, "qwen35", speculative={"type": "ngram", "draft_max": 3}))
    _same(got, want)
    assert hits == 128


def test_resuming_under_draft_mtp_changes_no_output(converted, recomputed):
    want, _ = _recomputed(converted, recomputed, "qwen35")
    got, hits = _run(converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"}))
    _same(got, want)
    assert hits == 128


def test_a_resumed_request_leaves_the_mtp_blocks_kv_of_the_shared_blocks_as_written(converted):
    """draft-mtp's block keeps k/v in a cache layer of its own, in the request's blocks: a request resuming a
    cached prefix starts the block after it, not at position 0 with no hidden states to pair (which would
    write other k/v into blocks the earlier request's cache entries share)."""
    core = converted.core(DATA, "qwen35", speculative={"type": "draft-mtp"})
    try:
        gen = torch.Generator().manual_seed(9)
        first = torch.randint(0, 320, (50,), generator=gen).tolist()
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        core.generate_sync(GenerateRequest(list(first), params))
        blocks = core.pool.match_prefix(first)  # the first prompt's cached blocks (held only while read)
        core.pool.free(blocks)
        cache, bs = core.runner.executor.worker.cache, core.pool.block_size
        slots = torch.tensor([b * bs + i for b in blocks for i in range(bs)])
        layer = cache.k.shape[0] - 1  # the MTP block's
        before = cache.k[layer, slots].clone(), cache.v[layer, slots].clone()
        assert len(blocks) == 3 and before[0].abs().sum() > 0
        core.generate_sync(GenerateRequest(first[:48] + [5, 6, 7, 8], params))
        assert core.pool.hits == 48 + 48  # (the read above, then the resumed request)
        assert torch.equal(cache.k[layer, slots], before[0]) and torch.equal(cache.v[layer, slots], before[1])
    finally:
        core.close()


@pytest.mark.parametrize("split", ["tensor", "layer"])
def test_every_rank_saves_and_restores_its_share_of_the_state(converted, recomputed, split):
    """Two CPU processes: the saves and restores travel in the plan; each tensor-parallel lane copies its share
    of the heads' states, each pipeline stage its layers'."""
    want, _ = _recomputed(converted, recomputed, "qwen35")
    got, hits = _run(converted.core(DATA, "qwen35", parallel={"split_mode": split, "n_devices": 2}))
    _same(got, want)
    assert hits == 128


@pytest.mark.parametrize("name", ["qwen35", "qwen3next"])
def test_a_busy_mix_of_shared_prefixes_preemptions_and_chunks_changes_no_output(converted, name):
    """Twelve requests in three waves, from three 40-60-token heads and their continuations (as conversations
    and shared system prompts make them), on four sequences with a 24-token budget and 14 KV blocks, so
    prompts are chunked, requests resume saved states, save new ones, evict old ones (4 snapshots), and
    are preempted and recomputed. Each request's greedy tokens and top-3 logprobs equal those of the same
    waves with every prefix recomputed."""
    gen = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, 320, (n,), generator=gen).tolist()  # noqa: E731
    heads = [rand(n) for n in (40, 52, 60)]
    prompts = []
    for i in range(12):
        head = heads[i % 3]
        prompts.append(head[: 33 + 7 * (i % 4)] + rand(3 + 5 * (i % 5)) if i % 2 else head + rand(2 + i))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    sections = {"scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 24}, "cache": {"num_blocks": 14}}

    def run(saved: int | None) -> tuple[list, EngineCore]:
        core = converted.core(DATA, name, **{**sections, "cache": {**sections["cache"], "prefix_states": saved}})
        reqs = [GenerateRequest(list(p), params) for p in prompts]
        got: dict[str, tuple[list, list]] = {r.request_id: ([], []) for r in reqs}
        for k, wave in enumerate((reqs[:5], reqs[5:9], reqs[9:])):
            for r in wave:
                core.add_request(r)
            for _ in range(8 if k < 2 else 400):
                for out in core.step():
                    got[out.request_id][0].extend(out.token_ids)
                    got[out.request_id][1].extend(lp.top for lp in out.logprobs)
        assert not core.has_work
        return [got[r.request_id] for r in reqs], core

    want, plain = run(0)
    plain.close()
    got, core = run(None)
    try:
        _same(got, want)
        st = core.stats()
        assert st.prefix_cache_hits > 0 and st.num_preemptions > 0
        assert core.states.num_free == 4 and core.pool.num_referenced == 0
    finally:
        core.close()
