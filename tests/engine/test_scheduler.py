"""The scheduler's step rule on plain requests (pure logic, no model): what one step holds after a preemption."""

from __future__ import annotations

from vegaserve.engine.kv_cache import BlockPool
from vegaserve.engine.request import SamplingParams
from vegaserve.engine.scheduler import Request, Scheduler, Status


def _req(rid: str, n: int, max_tokens: int = 30) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def _run(sched: Scheduler, steps: int) -> list[list[tuple[str, int, int]]]:
    """Each step's (request, start, tokens), the step computed as scheduled (a token sampled at its end)."""
    seen = []
    for _ in range(steps):
        batch = sched.schedule()
        seen.append([(s.request.request_id, s.start, len(s.tokens)) for s in batch.seqs])
        for s in batch.seqs:
            assert s.request.status is Status.RUNNING and s.request.table is not None
            s.request.num_computed += len(s.tokens)
            if s.samples:
                s.request.output_ids.append(7)
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
