"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts and prefix caching, and one
BlockTable per request that maps its token positions to physical slots.

Pure Python, no torch: the pool hands out block ids; the model runner owns the KV tensors (per layer, rows
indexed by slot = block_id * block_size + offset) and writes a request's token at position p into
`table.slot_mapping(p, 1)[0]`.

Every block is in exactly one state, so `num_free + num_referenced == num_blocks`:

    free        ref_count 0, no reusable KV             on the free list, handed out first
    evictable   ref_count 0, cached (findable by hash)  in the LRU queue; match_prefix revives it, and
                                                        allocate evicts it once the free list is empty
    referenced  ref_count > 0                           in one block table, or several when shared by the cache

Prefix caching keys a full block by a chain hash, blake2b-128 over (parent block's digest, the block's token
ids), so one key names the whole prefix up to the end of that block. Why blake2b and not Python's tuple
hash: the prompt is client input, and a 64-bit non-cryptographic hash can be steered into a collision on
purpose, letting one client's prompt land on KV computed from another's text (vLLM replaced hash() by
sha256 for this reason); blake2b is in hashlib, costs about a microsecond per block, and gives the same key
in every process. Collisions: a block also stores its own token ids and a hit is taken only when they
compare equal, so two different blocks under one digest never share KV. What remains is two different
*earlier* prefixes whose 128-bit digests collide and then continue with identical block tokens: odds about
N^2 / 2^129 for N blocks ever cached, and not constructible without breaking blake2b.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence

ROOT_HASH = b""  # the parent digest of a sequence's first block


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Digest of a full block given its parent's digest: the key of the whole prefix it ends."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def extend_chain(chain: list[bytes], token_ids: Sequence[int], n_blocks: int, block_size: int) -> list[bytes]:
    """`chain`, the chain hashes of token_ids' leading full blocks, grown in place to n_blocks of them."""
    for i in range(len(chain), n_blocks):
        chain.append(chain_hash(chain[-1] if chain else ROOT_HASH, token_ids[i * block_size : (i + 1) * block_size]))
    return chain


class NoFreeBlocks(RuntimeError):
    """The pool cannot hand out the blocks asked for: every other block is referenced."""

    def __init__(self, asked: int, free: int) -> None:
        super().__init__(f"asked for {asked} KV blocks but only {free} are free")
        self.asked = asked
        self.free = free


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set while the block is cached
        self.token_ids: tuple[int, ...] | None = None  # its tokens, compared on every hit


class BlockPool:
    """num_blocks blocks of block_size token slots each, shared by every request's BlockTable."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._cached: dict[bytes, int] = {}  # chain hash -> block id
        # prefix-cache counters in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits
        self.queries = 0
        self.hits = 0

    # ------------------------------------------------------------------------------------------ state

    @property
    def num_free(self) -> int:
        """Blocks that allocate can hand out: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced (vllm:kv_cache_usage_perc)."""
        return self.num_referenced / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def hash_of(self, block_id: int) -> bytes | None:
        """The block's chain hash while it is cached, else None."""
        return self._blocks[block_id].hash

    # ------------------------------------------------------------------------------ allocate and free

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref count 1, all or none: free ones first, then evicting cached ones, LRU first."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocks(n, self.num_free)
        ids = []
        for _ in range(n):
            if self._free:
                block = self._blocks[self._free.popleft()]
            else:
                block = self._blocks[self._evictable.popitem(last=False)[0]]
                del self._cached[block.hash]
                block.hash = block.token_ids = None
            block.ref_count = 1
            ids.append(block.block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id, in order. A block reaching 0 goes back to the free list, or, if cached,
        to the tail of the LRU queue where it stays findable until evicted. Freeing an unreferenced block is
        an error (a double free) and changes nothing."""
        block_ids = list(block_ids)
        for block_id, n in Counter(block_ids).items():
            if self._blocks[block_id].ref_count < n:
                held = self._blocks[block_id].ref_count
                raise ValueError(f"block {block_id} freed {n} times but has {held} references")
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    # ---------------------------------------------------------------------------------- prefix cache

    def _cached_run(self, token_ids: Sequence[int]) -> Iterator[tuple[bytes, int]]:
        """(chain hash, block id) of each leading full block of token_ids that is cached, in order; never the
        block holding the last token."""
        bs = self.block_size
        parent = ROOT_HASH
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is None or self._blocks[block_id].token_ids != tokens:
                return
            yield parent, block_id

    def count_cached(self, chain: Sequence[bytes]) -> int:
        """How many leading hashes of a chain (extend_chain's) name cached blocks; a scheduling hint, so the
        blocks' tokens are not compared, and nothing is referenced or counted."""
        return next((i for i, digest in enumerate(chain) if digest not in self._cached), len(chain))

    def match_prefix(self, token_ids: Sequence[int], ends: Callable[[bytes], bool] | None = None) -> list[int]:
        """The longest run of cached full blocks that starts token_ids, each with one more reference.

        The block holding the last token is never matched: that token must be computed to produce the
        logits of the next one. `ends`: the run must end on a block whose chain hash it accepts (a hybrid
        model resumes only where its recurrent state was saved), shortened to the last such block. Counts
        len(token_ids) queried tokens and the matched ones as hits."""
        bs = self.block_size
        ids: list[int] = []
        usable = 0
        for digest, block_id in self._cached_run(token_ids):
            ids.append(block_id)
            if ends is None or ends(digest):
                usable = len(ids)
        del ids[usable:]
        for block_id in ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        self.queries += len(token_ids)
        self.hits += len(ids) * bs
        return ids

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (back to the free list; vLLM's name for it, though vLLM
        refuses while any block is in use): the next prompt computes all its tokens. Blocks a running request
        holds stay cached. Returns the blocks forgotten."""
        for block_id in self._evictable:
            block = self._blocks[block_id]
            del self._cached[block.hash]
            block.hash = block.token_ids = None
            self._free.append(block_id)
        n = len(self._evictable)
        self._evictable.clear()
        return n

    def cache_full_blocks(self, token_ids: Sequence[int], table: BlockTable, num_computed: int) -> None:
        """Register the table's blocks that became full and computed since the last call.

        token_ids are the request's tokens so far (prompt + output), num_computed how many of them have
        their KV written. A block whose prefix is already cached under another block (two requests computed
        the same prompt at once) stays uncached and returns to the free list when released."""
        bs = self.block_size
        if num_computed > table.num_slots:
            raise ValueError(f"{num_computed} tokens computed but the table has slots for {table.num_slots}")
        hashes = table.block_hashes
        for i in range(len(hashes), min(num_computed, len(token_ids)) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = chain_hash(hashes[-1] if hashes else ROOT_HASH, tokens)
            hashes.append(digest)
            block = self._blocks[table.block_ids[i]]
            if digest not in self._cached and block.hash is None:
                block.hash, block.token_ids = digest, tokens
                self._cached[digest] = block.block_id


_TABLE_SERIALS = itertools.count()


class BlockTable:
    """One request's blocks, in token order: position p lives in block_ids[p // block_size]."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.serial = next(_TABLE_SERIALS)  # names this table (its step plans' key: distributed/plan_codec.py)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chain hashes of the leading full, computed blocks (pool-filled)
        self.num_slots = 0  # token positions that have a slot

    def adopt(self, block_ids: Sequence[int]) -> int:
        """Take the blocks pool.match_prefix returned (their references are ours now) into an empty table;
        returns the number of tokens they hold, which need no computing."""
        if self.block_ids:
            raise ValueError("cached blocks can only start an empty block table")
        self.block_ids = list(block_ids)
        self.block_hashes = [self.pool.hash_of(b) for b in self.block_ids]
        self.num_slots = len(self.block_ids) * self.pool.block_size
        return self.num_slots

    def blocks_needed(self, n_tokens: int) -> int:
        """New blocks append_slots(n_tokens) would allocate."""
        bs = self.pool.block_size
        return -(-(self.num_slots + n_tokens) // bs) - len(self.block_ids)

    def append_slots(self, n_tokens: int) -> list[int]:
        """Give slots to n_tokens more positions, allocating blocks as they fill; all or nothing (raises
        NoFreeBlocks and leaves the table as it was). Returns the new block ids."""
        if n_tokens < 0:
            raise ValueError(f"cannot append {n_tokens} slots")
        new = self.pool.allocate(self.blocks_needed(n_tokens))
        self.block_ids.extend(new)
        self.num_slots += n_tokens
        return new

    def truncate(self, n_tokens: int) -> None:
        """Keep slots for positions 0 .. n_tokens - 1 only; the blocks wholly past them go back to the pool
        (speculative decoding's rejected guesses). Those blocks were never cached: a block is cached once
        every position in it is computed, and a rejected guess's position is not."""
        if n_tokens >= self.num_slots:
            return
        keep = -(-n_tokens // self.pool.block_size)
        tail = self.block_ids[keep:]
        del self.block_ids[keep:]
        del self.block_hashes[keep:]
        self.num_slots = n_tokens
        self.pool.free(reversed(tail))

    def blocks_of(self, n_tokens: int) -> list[int]:
        """The blocks holding positions 0 .. n_tokens - 1."""
        if n_tokens > self.num_slots:
            raise IndexError(f"{n_tokens} positions but only {self.num_slots} slots held")
        return self.block_ids[: -(-n_tokens // self.pool.block_size)]

    def slot_mapping(self, start: int, n: int) -> list[int]:
        """Physical slots of positions start .. start+n-1: block_id * block_size + offset in the block."""
        if start < 0 or n < 0 or start + n > self.num_slots:
            raise IndexError(f"positions {start}..{start + n - 1} are outside the {self.num_slots} slots held")
        bs = self.pool.block_size
        return [self.block_ids[p // bs] * bs + p % bs for p in range(start, start + n)]

    def release(self) -> None:
        """Free every block (finished, aborted or preempted); safe to call twice. The tail is freed first so
        that eviction, LRU over release order, takes a sequence's last blocks before its shared prefix."""
        ids = self.block_ids
        self.block_ids, self.block_hashes, self.num_slots = [], [], 0
        self.pool.free(reversed(ids))
