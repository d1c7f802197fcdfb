"""The tensor-parallel AllReduce as peer writes: every rank's buffer is mapped into every other rank (CUDA /
HIP IPC), and ranks write their partials straight into each other's memory. F32 on the wire, whatever the
activation's type.

    one-shot  every rank writes its partial into slot `rank` of every peer, raises a flag there, waits
              for the flags of all peers, and sums the W slots in rank order 0, 1, ..., W - 1
    two-shot  reduce-scatter then all-gather: chunk c of every partial goes to rank c, which sums its
              chunk in rank order and writes the result into every peer; each rank copies the W chunks
              out. Each element crosses the wire twice instead of W - 1 times.
Both add the same f32 values in the same order, so every rank gets the same bits, and one-shot and
two-shot give the same bits too (`reference_all_reduce`).

Buffer of one rank (`PeerLayout`; int32 / f32 words from the base):
    [0] epoch: AllReduces done   [1] programs of the current launch that finished
    flags [2][max_programs][W]   phase 1 / phase 2 flag of program p from rank s: the epoch s reached
    one-shot slots [2][W][max_elems]   two halves, alternate calls (a peer may already write call k + 1
                                       while this rank still sums call k; it cannot reach k + 2 before
                                       this rank raised its flag for k + 1, i.e. finished k)
    scatter [W][chunk_cap], gather [W][chunk_cap]   two-shot (its second phase orders calls by itself)

Flags carry the epoch, not a bit, so nothing is ever reset: a waiter waits until flag - e >= 0 in int32
arithmetic (`epoch_reached`), which also holds when the counter wraps, and a peer that already raised the
next call's epoch satisfies it too. The epoch lives on the device: program reads it at its start, the
last program of a launch to finish advances it, so the launch replays in a CUDA graph unchanged.

Memory model (written for gfx906 over PCIe with fine-grain memory as well as NVLink; nothing relies on
NVLink's ordering): a program's peer stores, then a CTA barrier (every wave waits for its stores to
complete: `s_waitcnt vmcnt(0); s_barrier` on AMD, `bar.sync` on NVIDIA), then one thread's flag exchange
with release semantics at system scope; the waiter polls with acquire at system scope, then a barrier
before the block reads the slots. The flag is an atomic exchange on the peer's memory (a remote atomic:
over PCIe it needs AtomicOps routed between the GPUs, which ROCm requires of gfx9 hosts); the poll is a
local atomic. Triton 3.6 (the device image's) has no fence or release store of its own, hence atomics.
Peers' memory must be fine-grain on AMD over PCIe (HSA_FORCE_FINE_GRAIN_PCIE=1 or a fine-grained
allocation, engine/distributed/custom_allreduce.py).

Grid: min(max_programs, blocks) programs, each a grid-stride loop over BLOCK-element blocks; program p
only waits on program p of its peers, so no program waits on another of its own launch. Every rank must
launch the same grid for the same call (same size, same launch parameters).

`phases` runs part of a call (push / reduce / gather): the interpreter runs one program at a time and
cannot run a rank that waits on another, so the CPU tests run each phase on every rank in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PUSH, REDUCE, GATHER = 1, 2, 4
ALL = PUSH | REDUCE | GATHER
HEADER_WORDS = 64  # epoch, arrivals, then padding to a 256-byte line


@dataclass(frozen=True)
class PeerLayout:
    """Where each region of a rank's buffer starts, in 4-byte words (int32 flags, f32 data)."""

    world: int
    max_elems: int  # the largest AllReduce the buffers take (elements; 4 bytes each on the wire)
    max_programs: int = 32

    @property
    def flags(self) -> int:
        return HEADER_WORDS

    @property
    def flags2(self) -> int:
        return self.flags + self.max_programs * self.world

    @property
    def slots(self) -> int:
        return _align(self.flags2 + self.max_programs * self.world)

    @property
    def chunk_cap(self) -> int:
        return _align(triton.cdiv(self.max_elems, self.world))

    @property
    def scatter(self) -> int:
        return self.slots + 2 * self.world * self.max_elems

    @property
    def gather(self) -> int:
        return self.scatter + self.world * self.chunk_cap

    @property
    def nbytes(self) -> int:
        return 4 * (self.gather + self.world * self.chunk_cap)


def _align(words: int) -> int:
    return -(-words // 64) * 64  # 256 bytes


def epoch_reached(flag: int, epoch: int) -> bool:
    """The waiters' test, on the host: flag - epoch >= 0 as int32 (the counter may wrap)."""
    return ((flag - epoch + 2**31) % 2**32) - 2**31 >= 0


@triton.jit
def _base(peers_ptr, r, DT: tl.constexpr):
    """Rank r's buffer, as a pointer to DT (peers_ptr: int64 addresses, mapped into this process)."""
    return tl.load(peers_ptr + r).to(tl.pointer_type(DT))


@triton.jit
def _raise_flags(peers_ptr, word, e, WORLD: tl.constexpr):
    """Set `word` of every rank's buffer to e, after this program's stores (all its threads': the barrier)."""
    tl.debug_barrier()
    for s in tl.static_range(WORLD):
        tl.atomic_xchg(_base(peers_ptr, s, tl.int32) + word, e, sem="release", scope="sys")


@triton.jit
def _behind(flag, e):
    """flag has not reached epoch e: flag - e < 0 in int32 arithmetic, which wraps (`epoch_reached`)."""
    return flag - e < 0


@triton.jit
def _wait_flags(flags_ptr, e, WORLD: tl.constexpr):
    """Until flags[0 .. WORLD) all reached e."""
    for s in tl.static_range(WORLD):
        v = tl.atomic_add(flags_ptr + s, 0, sem="acquire", scope="sys")
        while _behind(v, e):
            v = tl.atomic_add(flags_ptr + s, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _advance_epoch(me, e):
    """The last program of the launch to get here stores the epoch the next launch starts from."""
    tl.debug_barrier()
    done = tl.atomic_add(me + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(me + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(me, e, sem="release", scope="gpu")


@triton.jit
def _one_shot_kernel(x_ptr, peers_ptr,
                     n, rank, flags, slots, max_elems,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, PHASES: tl.constexpr):
    """x (n elements, any float type) becomes the sum over ranks, in place."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    me = _base(peers_ptr, rank, tl.int32)
    e = tl.load(me, volatile=True) + 1
    half = slots + (e & 1) * WORLD * max_elems
    offs = tl.arange(0, BLOCK)
    if PHASES & 1:  # PUSH: this partial into slot `rank` of every peer
        for i in range(0, tl.cdiv(n - pid * BLOCK, step)):
            idx = pid * BLOCK + i * step + offs
            m = idx < n
            v = tl.load(x_ptr + idx, mask=m).to(tl.float32)
            for s in tl.static_range(WORLD):
                tl.store(_base(peers_ptr, s, tl.float32) + half + rank * max_elems + idx, v, mask=m)
        _raise_flags(peers_ptr, flags + pid * WORLD + rank, e, WORLD)
    if PHASES & 2:  # REDUCE: once every peer's partial is here, the slots summed in rank order
        _wait_flags(me + flags + pid * WORLD, e, WORLD)
        mine = _base(peers_ptr, rank, tl.float32) + half
        for i in range(0, tl.cdiv(n - pid * BLOCK, step)):
            idx = pid * BLOCK + i * step + offs
            m = idx < n
            acc = tl.load(mine + idx, mask=m)
            for s in tl.static_range(1, WORLD):
                acc += tl.load(mine + s * max_elems + idx, mask=m)
            tl.store(x_ptr + idx, acc.to(x_ptr.dtype.element_ty), mask=m)
        _advance_epoch(me, e)


@triton.jit
def _two_shot_kernel(x_ptr, peers_ptr,
                     n, rank, flags, flags2, scatter, gather, chunk_cap,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, PHASES: tl.constexpr):
    """x (n elements) becomes the sum over ranks, in place; rank c owns elements [c * chunk, (c + 1) * chunk)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    me = _base(peers_ptr, rank, tl.int32)
    e = tl.load(me, volatile=True) + 1
    chunk = tl.cdiv(n, WORLD)
    steps = tl.cdiv(chunk - pid * BLOCK, step)
    offs = tl.arange(0, BLOCK)
    if PHASES & 1:  # PUSH: chunk c of this partial into slot `rank` of rank c's scatter region
        for c in tl.static_range(WORLD):
            dst = _base(peers_ptr, c, tl.float32) + scatter + rank * chunk_cap
            for i in range(0, steps):
                j = pid * BLOCK + i * step + offs
                m = (j < chunk) & (c * chunk + j < n)
                tl.store(dst + j, tl.load(x_ptr + c * chunk + j, mask=m).to(tl.float32), mask=m)
        _raise_flags(peers_ptr, flags + pid * WORLD + rank, e, WORLD)
    if PHASES & 2:  # REDUCE: this rank's chunk summed in rank order, written into every peer's gather slot
        _wait_flags(me + flags + pid * WORLD, e, WORLD)
        src = _base(peers_ptr, rank, tl.float32) + scatter
        for i in range(0, steps):
            j = pid * BLOCK + i * step + offs
            m = (j < chunk) & (rank * chunk + j < n)
            acc = tl.load(src + j, mask=m)
            for s in tl.static_range(1, WORLD):
                acc += tl.load(src + s * chunk_cap + j, mask=m)
            for c in tl.static_range(WORLD):
                tl.store(_base(peers_ptr, c, tl.float32) + gather + rank * chunk_cap + j, acc, mask=m)
        _raise_flags(peers_ptr, flags2 + pid * WORLD + rank, e, WORLD)
    if PHASES & 4:  # GATHER: every reduced chunk, out of this rank's gather slots
        _wait_flags(me + flags2 + pid * WORLD, e, WORLD)
        got = _base(peers_ptr, rank, tl.float32) + gather
        for c in tl.static_range(WORLD):
            for i in range(0, steps):
                j = pid * BLOCK + i * step + offs
                m = (j < chunk) & (c * chunk + j < n)
                v = tl.load(got + c * chunk_cap + j, mask=m)
                tl.store(x_ptr + c * chunk + j, v.to(x_ptr.dtype.element_ty), mask=m)
        _advance_epoch(me, e)


def all_reduce(x: torch.Tensor, peers: torch.Tensor, layout: PeerLayout, rank: int, two_shot: bool,
               block: int = 1024, num_warps: int = 4, phases: int = ALL) -> torch.Tensor:
    """x (contiguous, on this rank's device) becomes the sum of every rank's x, in place; returns x.
    peers: int64 [world] on the device, the address of each rank's buffer as mapped in this process.
    Every rank calls with the same size and launch parameters."""
    n = x.numel()
    if not x.is_contiguous() or not x.is_floating_point():
        raise ValueError(f"AllReduce of a {'non-contiguous ' if not x.is_contiguous() else ''}{x.dtype} tensor")
    if n > layout.max_elems:
        raise ValueError(f"AllReduce of {n} elements; the peer buffers take {layout.max_elems}")
    if peers.dtype != torch.int64 or peers.numel() != layout.world or not 0 <= rank < layout.world:
        raise ValueError(f"peers must be int64 [{layout.world}] and rank in 0..{layout.world - 1}")
    if n == 0:
        return x
    span = triton.cdiv(n, layout.world) if two_shot else n
    grid = (min(layout.max_programs, triton.cdiv(span, block)),)
    if two_shot:
        _two_shot_kernel[grid](x, peers, n, rank, layout.flags, layout.flags2, layout.scatter, layout.gather,
                               layout.chunk_cap, WORLD=layout.world, BLOCK=block, PHASES=phases,
                               num_warps=num_warps)
    else:
        _one_shot_kernel[grid](x, peers, n, rank, layout.flags, layout.slots, layout.max_elems,
                               WORLD=layout.world, BLOCK=block, PHASES=phases & (PUSH | REDUCE),
                               num_warps=num_warps)
    return x


def reference_all_reduce(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank gets: the partials in f32, added in rank order, in the partials' type."""
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(parts[0].dtype)
