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

from dataclasses import dataclass, replace

from vegaserve.engine.forward_batch import StepPlan


@dataclass(frozen=True)
class PlanChanges:
    """A keyed StepPlan on the wire: `plan` with each block list cut to its new blocks, `kept[i]` the blocks
    before them, taken from key i's list in the last keyed plan."""

    kept: tuple[int, ...]
    plan: StepPlan


class PlanEncoder:
    """Rank 0's end."""

    def __init__(self) -> None:
        self.last: dict[object, list[int]] = {}

    def encode(self, msg: object) -> object:
        if not isinstance(msg, StepPlan) or not msg.keys:
            return msg
        if len(msg.keys) != len(msg.seqs) or len(set(msg.keys)) != len(msg.keys):
            raise ValueError(f"a plan of {len(msg.seqs)} sequences needs as many distinct keys, got {msg.keys}")
        kept, seqs = [], []
        for key, (blocks, start, tokens) in zip(msg.keys, msg.seqs, strict=True):
            old = self.last.get(key)
            n = 0 if old is None else min(len(old), len(blocks))
            if n and blocks[n - 1] != old[n - 1]:
                n = 0
            kept.append(n)
            seqs.append((blocks[n:], start, tokens))
        self.last = {key: blocks for key, (blocks, _, _) in zip(msg.keys, msg.seqs, strict=True)}
        return PlanChanges(tuple(kept), replace(msg, seqs=seqs))


class PlanDecoder:
    """Every other rank's end."""

    def __init__(self) -> None:
        self.last: dict[object, list[int]] = {}

    def decode(self, msg: object) -> object:
        if not isinstance(msg, PlanChanges):
            return msg
        plan, last = msg.plan, self.last
        seqs = []
        for key, n, (tail, start, tokens) in zip(plan.keys, msg.kept, plan.seqs, strict=True):
            if n:
                old = last[key]
                tail = (old if n == len(old) else old[:n]) + tail
            seqs.append((tail, start, tokens))
        self.last = {key: blocks for key, (blocks, _, _) in zip(plan.keys, seqs, strict=True)}
        return replace(plan, seqs=seqs)
