"""Micro-batches of a step plan: contiguous, non-empty, about equal in tokens, nothing lost or reordered."""

from __future__ import annotations

import random

from vegaserve.engine.distributed.worker import logits_rows, micro_batches
from vegaserve.engine.forward_batch import StepPlan


def plan_of(sizes: list[int]) -> StepPlan:
    seqs = [(list(range(-(-n // 16))), 0, list(range(n))) for n in sizes]
    return StepPlan(seqs, [i % 3 == 0 for i in range(len(sizes))], 16)


def test_micro_batches_keep_every_sequence_in_order() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 1, 1, 7, 64, 300]) for _ in range(rng.randint(1, 20))]
        plan = plan_of(sizes)
        n = rng.randint(1, 5)
        groups = micro_batches(plan, n)
        assert len(groups) == min(n, len(sizes))
        assert all(g.seqs for g in groups)
        assert [s for g in groups for s in g.seqs] == plan.seqs
        assert [e for g in groups for e in g.all_logits] == plan.all_logits
        assert sum(logits_rows(g) for g in groups) == logits_rows(plan)


def test_equal_sequences_split_evenly() -> None:
    groups = micro_batches(plan_of([1] * 64), 4)
    assert [len(g.seqs) for g in groups] == [16, 16, 16, 16]
    groups = micro_batches(plan_of([100, 1, 1, 1, 100, 1, 1, 1]), 2)
    assert [len(g.seqs) for g in groups] == [4, 4]
