"""Step plans on the wire as changes: rank 0 sends each sequence's KV blocks that the other ranks have not
seen, not its whole list again.

A decode step's plan names every running sequence's blocks: 64 sequences at 2k tokens are 8,192 block ids
every step, whose pickling and unpickling took 90 and 155 us on a 2-core VM, for lists that grow by one
block every 16 tokens. Where a StepPlan carries `keys`, one per sequence and naming its block table
(kv_cache.BlockTable.serial: a new one at every admission), the sender replaces each block list by (how many
blocks of that key's list in the last keyed plan stay, the blocks after them); every receiver rebuilds the
lists from its copy of the last keyed plan. A block table only grows or gives back its tail (speculative
decoding's rejected guesses), so the blocks that stay are the shorter list's length, found without reading
the lists (a last kept block that differs sends the list whole). Both ends keep exactly the last keyed plan's
lists: a key that skips a step is sent whole. Plans without keys (a draft model's, the MTP block's) and every
other message travel as they are.

Every receiver must see every message, in order, as the ring (plan_ring.py) and gloo's broadcast deliver.
"""

from __future__ import annotations

from typing import NamedTuple

from vegaserve.engine.forward_batch import StepPlan


class PlanChanges(NamedTuple):
    """A keyed StepPlan on the wire: its fields flat, each block list cut to its new blocks, `kept[i]` the
    blocks before them, taken from key i's list in the last keyed plan. (A tuple of plain values pickles in
    about half the time of the dataclasses it replaces, and unpickles in a third.)"""

    kept: tuple[int, ...]
    seqs: list[tuple[list[int], int, list[int]]]
    all_logits: list[bool]
    block_size: int
    state_slots: tuple[int, ...]
    snapshot: tuple[int, ...]
    rollback: tuple[tuple[int, int], ...]
    keys: tuple[object, ...]


class PlanEncoder:
    """Rank 0's end."""

    def __init__(self) -> None:
        self.last: dict[object, list[int]] = {}

    def encode(self, msg: object) -> object:
        if not isinstance(msg, StepPlan) or not msg.keys:
            return msg
        keys = msg.keys
        if len(keys) != len(msg.seqs) or len(set(keys)) != len(keys):
            raise ValueError(f"a plan of {len(msg.seqs)} sequences needs as many distinct keys, got {keys}")
        last, kept, seqs = self.last, [], []
        for key, (blocks, start, tokens) in zip(keys, msg.seqs, strict=True):
            old = last.get(key)
            n = 0 if old is None else min(len(old), len(blocks))
            if n and blocks[n - 1] != old[n - 1]:
                n = 0
            kept.append(n)
            seqs.append((blocks[n:], start, tokens))
        self.last = dict(zip(keys, [blocks for blocks, _, _ in msg.seqs], strict=True))
        return PlanChanges(tuple(kept), seqs, msg.all_logits, msg.block_size, msg.state_slots, msg.snapshot,
                           msg.rollback, keys)


class PlanDecoder:
    """Every other rank's end."""

    def __init__(self) -> None:
        self.last: dict[object, list[int]] = {}

    def decode(self, msg: object) -> object:
        if not isinstance(msg, PlanChanges):
            return msg
        last, seqs = self.last, []
        for key, n, (tail, start, tokens) in zip(msg.keys, msg.kept, msg.seqs, strict=True):
            if n:
                old = last[key]
                tail = (old if n == len(old) else old[:n]) + tail
            seqs.append((tail, start, tokens))
        self.last = dict(zip(msg.keys, [blocks for blocks, _, _ in seqs], strict=True))
        return StepPlan(seqs, msg.all_logits, msg.block_size, msg.state_slots, msg.snapshot, msg.rollback,
                        msg.keys)
