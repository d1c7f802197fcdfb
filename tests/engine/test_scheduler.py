"""The scheduler's step rule on plain requests (pure logic, no model): what one step holds after a preemption."""

from __future__ import annotations

from vegaserve.engine.kv_cache import BlockPool
from vegaserve.engine.request import SamplingParams
from vegaserve.engine.scheduler import Request, Scheduler, Status


def _req(rid: str, n: int, max_tokens: int = 30) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def _run(sched: Scheduler, steps: int) -> list[list[tuple[str, int, int]]]:
    """Each step's (request, start, tokens), the step computed as scheduled (a token sampled at its end, the
    blocks it filled registered for prefix caching)."""
    seen = []
    for _ in range(steps):
        batch = sched.schedule()
        seen.append([(s.request.request_id, s.start, len(s.tokens)) for s in batch.seqs])
        for s in batch.seqs:
            assert s.request.status is Status.RUNNING and s.request.table is not None
            s.request.num_computed += len(s.tokens)
            if s.samples:
                s.request.output_ids.append(7)
            sched.computed(s.request)
    return seen


def test_a_request_preempted_after_its_decode_was_scheduled_is_left_out_of_the_step():
    """`new` decodes (scheduled first: decodes lead) but was admitted after `old`, so when `old`'s prompt
    chunk needs blocks it is the one preempted; its decode must not stay in the step, where it would
    write k/v into a block it no longer holds and sample a token for a request that is waiting again."""
    pool = BlockPool(5, 16)
    sched = Scheduler(pool, max_num_seqs=2, token_budget=32)
    new = _req("new", 14)  # created (arrived) first, queued second
    old = _req("old", 75)
    sched.add(old)
    sched.add(new)
    steps = _run(sched, 3)
    assert steps[:2] == [[("new", 0, 14), ("old", 0, 18)], [("new", 14, 1), ("old", 18, 31)]]
    assert steps[2] == [("old", 49, 26)]
    assert new.status is Status.WAITING and new.num_computed == 0 and sched.num_preemptions == 1


def test_a_prompt_whose_blocks_another_is_computing_waits_for_them_and_adopts_them():
    """`b` repeats `a`'s 100-token prompt (as OpenAI's n makes them): admitted beside it, it would compute the
    same tokens in the same steps; held while `a` computes them, it then adopts the six full blocks. `c`, an
    unrelated prompt queued behind `b`, is not held."""
    pool = BlockPool(64, 16)
    sched = Scheduler(pool, max_num_seqs=4, token_budget=32)
    a, b, c = _req("a", 100), _req("b", 100), Request("c", [7] * 20, SamplingParams(max_tokens=4), 4)
    for r in (a, b, c):
        sched.add(r)
    assert _run(sched, 3) == [[("a", 0, 32)], [("a", 32, 32)], [("a", 64, 32)]]
    assert c.status is Status.RUNNING and b.status is Status.WAITING  # `c` admitted at once (`a` took the budget)
    # once `a` has filled its last full block, `b` adopts all six and computes the 4 tokens after them beside it
    assert _run(sched, 2) == [[("a", 96, 4), ("b", 96, 4), ("c", 0, 20)], [("a", 100, 1), ("b", 100, 1), ("c", 20, 1)]]
    assert pool.hits == 96


def test_a_held_prompt_is_admitted_once_the_request_it_waits_on_ends():
    pool = BlockPool(64, 16)
    sched = Scheduler(pool, max_num_seqs=4, token_budget=32)
    a, b = _req("a", 100), _req("b", 100)
    sched.add(a)
    sched.add(b)
    assert _run(sched, 1) == [[("a", 0, 32)]] and b.status is Status.WAITING
    sched.finish(a)  # aborted mid-prompt: nothing more of it will be cached
    assert _run(sched, 1) == [[("b", 32, 32)]]  # its computed blocks were, and are adopted


def test_a_prompt_asking_prompt_logprobs_is_not_held():
    """It computes every prompt position anyway (no prefix cache for it)."""
    sched = Scheduler(BlockPool(64, 16), max_num_seqs=4, token_budget=32)
    a = _req("a", 100)
    b = Request("b", list(range(1, 101)), SamplingParams(max_tokens=4, prompt_logprobs=1), 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert b.status is Status.RUNNING
