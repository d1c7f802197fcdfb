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
lists: a key that skips a step is sent whole. A plan with the last one's keys in the same order (decode
after decode, nothing admitted or finished) goes as PlanSteady: no keys, and the block lists only of the
sequences whose length or last block changed. Plans without keys (a draft model's, the MTP block's) and every
other message travel as they are.

Every receiver must see every message, in order, as the ring (plan_ring.py) and gloo's broadcast deliver.
"""

from __future__ import annotations

from typing import NamedTuple

from vegaserve.engine.forward_batch import StepPlan


class PlanChanges(NamedTuple):
    """A keyed StepPlan on the wire: its fields flat, each block list cut to its new blocks, `kept[i]` the
    blocks before them, taken from key i's list in the last keyed plan. (A tuple of plain values: at 16
    sequences pickled in 6.2 us and unpickled in 4.6 where the dataclasses it replaces took 8.6 and 6.4.)"""

    kept: tuple[int, ...]
    seqs: list[tuple[list[int], int, list[int]]]
    all_logits: list[bool]
    block_size: int
    state_slots: tuple[int, ...]
    snapshot: tuple[int, ...]
    rollback: tuple[tuple[int, int], ...]
    keys: tuple[object, ...]
    restores: tuple[tuple[int, int], ...]
    saves: tuple[tuple[int, int], ...]


class PlanSteady(NamedTuple):
    """A keyed StepPlan whose keys are the last keyed plan's, in the same order (a decode step like the one
    before): no keys and no block lists but those whose length or last block changed, sequence `changed[j]`
    keeping `kept[j]` of its blocks and adding `tails[j]`; the starts and tokens as flat lists. Built and
    rebuilt by list comprehensions and zip, without a Python loop over the sequences: at 16 sequences
    19.8 us from encoding to decoded where PlanChanges took 37 (one process, the 2-core VM)."""

    changed: list[int]
    kept: list[int]
    tails: list[list[int]]
    starts: list[int]
    tokens: list[list[int]]
    all_logits: list[bool]
    block_size: int
    state_slots: tuple[int, ...]
    snapshot: tuple[int, ...]
    rollback: tuple[tuple[int, int], ...]
    restores: tuple[tuple[int, int], ...]
    saves: tuple[tuple[int, int], ...]


def _kept(old: list[int], blocks: list[int]) -> int:
    """How many of `blocks` a receiver holding `old` for the same key keeps: the shorter list's length, or 0
    where its last block differs (the list goes whole)."""
    n = min(len(old), len(blocks))
    return n if n and blocks[n - 1] == old[n - 1] else 0


class PlanEncoder:
    """Rank 0's end."""

    def __init__(self) -> None:
        self.keys: tuple[object, ...] = ()  # the last keyed plan's keys, its block lists, their lengths and
        self.blocks: list[list[int]] = []  # last blocks
        self.ends: list[tuple[int, int]] = []

    def encode(self, msg: object) -> object:
        if not isinstance(msg, StepPlan) or not msg.keys:
            return msg
        keys, mseqs = msg.keys, msg.seqs
        if len(keys) != len(mseqs) or len(set(keys)) != len(keys):
            raise ValueError(f"a plan of {len(mseqs)} sequences needs as many distinct keys, got {keys}")
        blocks = [b for b, _, _ in mseqs]
        ends = [(len(b), b[-1] if b else -1) for b in blocks]
        if keys == self.keys:
            old_ends, old = self.ends, self.blocks
            changed = [] if ends == old_ends else [i for i, (a, b) in enumerate(zip(ends, old_ends)) if a != b]
            kept = [_kept(old[i], blocks[i]) for i in changed]
            wire: object = PlanSteady(changed, kept, [blocks[i][n:] for i, n in zip(changed, kept)],
                                      [s for _, s, _ in mseqs], [t for _, _, t in mseqs], msg.all_logits,
                                      msg.block_size, msg.state_slots, msg.snapshot, msg.rollback, msg.restores,
                                      msg.saves)
        else:
            last = dict(zip(self.keys, self.blocks))
            kept, seqs = [], []
            for key, (b, start, tokens) in zip(keys, mseqs, strict=True):
                old_b = last.get(key)
                n = 0 if old_b is None else _kept(old_b, b)
                kept.append(n)
                seqs.append((b[n:], start, tokens))
            wire = PlanChanges(tuple(kept), seqs, msg.all_logits, msg.block_size, msg.state_slots, msg.snapshot,
                               msg.rollback, keys, msg.restores, msg.saves)
        self.keys, self.blocks, self.ends = keys, blocks, ends
        return wire


class PlanDecoder:
    """Every other rank's end."""

    def __init__(self) -> None:
        self.keys: tuple[object, ...] = ()
        self.blocks: list[list[int]] = []

    def decode(self, msg: object) -> object:
        if isinstance(msg, PlanSteady):
            blocks = list(self.blocks)
            for i, n, tail in zip(msg.changed, msg.kept, msg.tails, strict=True):
                old = blocks[i]
                blocks[i] = (old if n == len(old) else old[:n]) + tail
            self.blocks = blocks
            return StepPlan(list(zip(blocks, msg.starts, msg.tokens, strict=True)), msg.all_logits, msg.block_size,
                            msg.state_slots, msg.snapshot, msg.rollback, self.keys, msg.restores, msg.saves)
        if not isinstance(msg, PlanChanges):
            return msg
        last, seqs = dict(zip(self.keys, self.blocks)), []
        for key, n, (tail, start, tokens) in zip(msg.keys, msg.kept, msg.seqs, strict=True):
            if n:
                old = last[key]
                tail = (old if n == len(old) else old[:n]) + tail
            seqs.append((tail, start, tokens))
        self.keys, self.blocks = msg.keys, [b for b, _, _ in seqs]
        return StepPlan(seqs, msg.all_logits, msg.block_size, msg.state_slots, msg.snapshot, msg.rollback,
                        msg.keys, msg.restores, msg.saves)
