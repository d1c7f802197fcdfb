"""Keyed step plans sent as changes (engine/distributed/plan_codec.py): through pickling, as on the ring or
gloo, every receiver rebuilds exactly the plan rank 0 sent, over steps where sequences grow, join, skip a
step, come back with a new block table, give blocks back and change order, and over runs of steps with the
same sequences in the same order (the steady form); a growing sequence sends only its new blocks; other
messages pass as they are."""

from __future__ import annotations

import pickle
import random

import pytest

from vegaserve.engine.distributed.plan_codec import PlanChanges, PlanDecoder, PlanEncoder, PlanSteady
from vegaserve.engine.forward_batch import MtpPlan, StepPlan


def _plan(seqs: dict[str, tuple[list[int], int]], order: list[str] | None = None) -> StepPlan:
    keys = order or list(seqs)
    return StepPlan([(list(seqs[k][0]), seqs[k][1], [7]) for k in keys], [False] * len(keys), 16,
                    keys=tuple(keys), restores=((len(keys), 0),), saves=((0, len(keys)),))


def _send(enc: PlanEncoder, decs: list[PlanDecoder], msg: object) -> list[object]:
    wire = pickle.dumps(enc.encode(msg), protocol=pickle.HIGHEST_PROTOCOL)
    return [d.decode(pickle.loads(wire)) for d in decs]


def test_every_receiver_rebuilds_every_plan() -> None:
    rng = random.Random(0)
    enc, decs = PlanEncoder(), [PlanDecoder(), PlanDecoder()]
    live: dict[str, tuple[list[int], int]] = {}
    next_block, next_key = 0, 0
    for step in range(400):
        if len(live) < 6 and rng.random() < 0.3:  # a new sequence (prefix-cached blocks may repeat another's)
            shared = list(next(iter(live.values()))[0][:2]) if live and rng.random() < 0.5 else []
            live[f"r{next_key}"] = (shared + [next_block], 0)
            next_key += 1
            next_block += 1
        for key in list(live):
            blocks, start = live[key]
            r = rng.random()
            if r < 0.05:
                del live[key]  # finished
            elif r < 0.10:  # preempted and admitted again: a new table (key), the same length, other blocks
                del live[key]
                live[f"r{next_key}"] = (list(range(next_block, next_block + len(blocks))), 0)
                next_key += 1
                next_block += len(blocks)
            elif r < 0.15 and len(blocks) > 1:  # speculation gave its last block back
                live[key] = (blocks[:-1], start)
            elif r < 0.5:  # grew into a new block
                live[key] = (blocks + [next_block], start + 16)
                next_block += 1
        keys = list(live)
        scheduled = [k for k in keys if rng.random() < 0.8]  # some skip this step
        rng.shuffle(scheduled)
        plan = _plan(live, scheduled)
        for got in _send(enc, decs, plan):
            assert got == plan, f"step {step}"


def test_a_growing_sequence_sends_only_its_new_blocks() -> None:
    enc, dec = PlanEncoder(), PlanDecoder()
    blocks = list(range(100))
    dec.decode(pickle.loads(pickle.dumps(enc.encode(_plan({"a": (blocks, 0)})))))
    wire = enc.encode(_plan({"a": (blocks + [100], 16)}))
    assert isinstance(wire, PlanSteady)  # the same key as the last plan's
    assert wire.changed == [0] and wire.kept == [100] and wire.tails == [[100]]
    assert dec.decode(pickle.loads(pickle.dumps(wire))).seqs[0][0] == blocks + [100]
    same = enc.encode(_plan({"a": (blocks + [100], 17)}))
    assert same.changed == [] and same.tails == [] and same.starts == [17]
    assert dec.decode(pickle.loads(pickle.dumps(same))).seqs == [(blocks + [100], 17, [7])]
    joined = enc.encode(_plan({"a": (blocks + [100], 18), "b": ([5], 0)}))  # another key: the keyed form
    assert isinstance(joined, PlanChanges) and joined.kept == (101, 0)


def test_a_list_whose_last_kept_block_differs_is_sent_whole() -> None:
    enc, dec = PlanEncoder(), PlanDecoder()
    dec.decode(enc.encode(_plan({"a": ([1, 2, 3], 0)})))
    other = _plan({"a": ([1, 2, 9, 10], 16)})
    wire = enc.encode(other)
    assert wire.kept == [0] and wire.tails == [[1, 2, 9, 10]]
    assert dec.decode(pickle.loads(pickle.dumps(wire))) == other
    swapped = _plan({"a": ([1, 2, 9, 11], 17)})  # the same length, another last block (a tail given back and
    wire = enc.encode(swapped)  # taken again between two plans): sent whole too
    assert wire.changed == [0] and wire.kept == [0]
    assert dec.decode(pickle.loads(pickle.dumps(wire))) == swapped


def test_other_messages_pass_as_they_are_and_leave_the_state() -> None:
    enc, dec = PlanEncoder(), PlanDecoder()
    keyed = _plan({"a": ([1, 2], 0)})
    dec.decode(enc.encode(keyed))
    unkeyed = StepPlan([([9, 9, 9], 0, [1])], [False], 16)
    mtp = MtpPlan(unkeyed, 3)
    for msg in (None, unkeyed, mtp, ("x", 1)):
        assert enc.encode(msg) is msg
        assert dec.decode(msg) is msg
    nxt = _plan({"a": ([1, 2, 3], 16)})
    wire = enc.encode(nxt)
    assert wire.kept == [2]
    assert dec.decode(wire) == nxt


def test_keys_must_be_distinct_and_one_a_sequence() -> None:
    enc = PlanEncoder()
    plan = StepPlan([([1], 0, [1]), ([2], 0, [1])], [False, False], 16, keys=("a", "a"))
    with pytest.raises(ValueError, match="distinct keys"):
        enc.encode(plan)
    with pytest.raises(ValueError, match="distinct keys"):
        enc.encode(StepPlan([([1], 0, [1])], [False], 16, keys=("a", "b")))


def test_the_wire_form_carries_every_field_of_a_step_plan() -> None:
    """PlanChanges is StepPlan's fields flat, kept first: a field added to StepPlan must be added there too."""
    from dataclasses import fields

    from vegaserve.engine.forward_batch import StepPlan

    names = [f.name for f in fields(StepPlan)]
    assert PlanChanges._fields == ("kept", *names)
    assert PlanSteady._fields == ("changed", "kept", "tails", "starts", "tokens",
                                  *(n for n in names if n not in ("seqs", "keys")))


def test_a_run_of_steady_steps_is_rebuilt_exactly() -> None:
    """The same keys in the same order for steps on end, each sequence now and then growing into a block,
    giving its last back, or both between two plans (the same length, another last block), a step or two
    with a sequence joining or leaving between runs: every receiver rebuilds every plan, and the runs go in
    the steady form."""
    rng = random.Random(5)
    enc, decs = PlanEncoder(), [PlanDecoder(), PlanDecoder()]
    live = {f"r{i}": (list(range(10 * i, 10 * i + 3)), 40) for i in range(8)}
    next_block, steady = 1000, 0
    for step in range(300):
        if step % 50 == 49:  # one leaves, another joins: a keyed plan, then steady again
            live.pop(next(iter(live)))
            live[f"n{step}"] = ([next_block], 0)
            next_block += 1
        for key, (blocks, start) in list(live.items()):
            r = rng.random()
            if r < 0.1:
                blocks = blocks + [next_block]
                next_block += 1
            elif r < 0.15 and len(blocks) > 1:
                blocks = blocks[:-1]
            elif r < 0.2:
                blocks = blocks[:-1] + [next_block]
                next_block += 1
            live[key] = (blocks, start + 1)
        plan = _plan(live)
        wire = pickle.dumps(enc.encode(plan), protocol=pickle.HIGHEST_PROTOCOL)
        steady += isinstance(pickle.loads(wire), PlanSteady)
        for d in decs:
            assert d.decode(pickle.loads(wire)) == plan, f"step {step}"
    assert steady >= 290
