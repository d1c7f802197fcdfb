"""Recurrent-state slots of the hybrid models: one per running sequence, beside its paged KV blocks.

A slot indexes every linear-attention layer's conv rows and delta-rule state on every rank (the tensors live
in the workers' caches, engine/layers/delta_net.py RecurrentState); this pool only hands out the indices.
Pure Python, like engine/kv_cache.py. A slot needs no clearing when it changes hands: a sequence's first
step (start 0) begins from a zero state whatever the slot holds.

Why no prefix caching for these models: a cached KV block stands for its tokens, but a linear-attention
layer's state after those tokens is one fixed-size summary of the whole prefix, overwritten token by token;
reusing a prefix would need a snapshot of every layer's state at every block boundary, which is not stored.
"""

from __future__ import annotations

from collections import deque


class NoFreeStateSlot(RuntimeError):
    """Every state slot is held by a running sequence."""


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeStateSlot(f"all {self.num_slots} recurrent-state slots are held")
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; freeing one that is not held is an error (a double free) and changes nothing."""
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)
