"""Recurrent-state slots of the hybrid models: one per running sequence, beside its paged KV blocks, and
the snapshots of states that prefix caching resumes from.

A slot indexes every linear-attention layer's conv rows and delta-rule state on every rank (the tensors live
in the workers' caches, engine/layers/delta_net.py RecurrentState); these pools only hand out the indices.
Pure Python, like engine/kv_cache.py. A slot needs no clearing when it changes hands: a sequence's first
step (start 0) begins from a zero state whatever the slot holds, and one that resumes a cached prefix first
gets the snapshot copied in.

Prefix caching for these models: a cached KV block stands for its tokens, but a linear-attention layer's
state after them is one fixed-size summary of the whole prefix, overwritten token by token. So a prefix is
reused only up to a block boundary where the state was saved: the scheduler ends a prompt's chunk at the
last block boundary before its final token and saves the state there (a step's `saves`, copied after its
forward), keyed by the chain hash of the block it ends (engine/kv_cache.py). A later request whose prompt
starts with those blocks adopts their KV and gets the snapshot copied into its slot before its first step
(`restores`): a conversation's next turn resumes at the previous prompt's last full block. A request that
finds cached blocks but no saved state in them (a system prompt shared by requests that differ after it)
saves the state where those blocks end too, so the next such request resumes there; one that arrives while
a running request computes the prefix they share asks that request to save its state where they part, and
waits for it (engine/scheduler.py).
"""

from __future__ import annotations

from collections import OrderedDict, deque


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


class StateSnapshots:
    """`capacity` saved states, each keyed by the chain hash of the KV block it ends, evicted least recently
    used first. A key is registered when its save is scheduled: the save runs after that step's forward and
    any restore of it in a later step, so a request admitted in the same step cannot see it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a snapshot pool needs at least one snapshot, got {capacity}")
        self.capacity = capacity
        self._by_key: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free: deque[int] = deque(range(capacity))

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def take(self, key: bytes) -> int:
        """The snapshot saved under key (KeyError if none), now the most recently used."""
        self._by_key.move_to_end(key)
        return self._by_key[key]

    def reserve(self, key: bytes) -> int:
        """A snapshot number for a new save under key: a free one, else the least recently used one's (its
        key forgotten). Reserving a key already held is an error: there is nothing to save."""
        if key in self._by_key:
            raise ValueError("a snapshot is already saved under this key")
        number = self._free.popleft() if self._free else self._by_key.popitem(last=False)[1]
        self._by_key[key] = number
        return number

    def clear(self) -> int:
        """Forget every snapshot; returns how many were held."""
        n = len(self._by_key)
        self._free.extend(self._by_key.values())
        self._by_key.clear()
        return n
