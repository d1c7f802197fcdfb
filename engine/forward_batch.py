"""One step's work on its way down to the model, in two forms (the chain: engine/request.py):

    StepPlan       plain Python, what every rank receives: per sequence its KV block ids, start, new tokens
                   (and, for a hybrid model, its recurrent-state slot)
    ForwardBatch   the same as tensors on the rank's device: what the model sees (flat tokens of the seqs)

The model runner turns a ScheduledBatch into a StepPlan; the executor runs it in place (one device) or
broadcasts it to every rank, and each rank's StageWorker (engine/distributed/worker.py) builds its
ForwardBatch, which goes down the model as an argument (never global).

Tokens of all sequences are concatenated: sequence s owns rows [offset, offset + n) of every [T, ...]
activation; its earlier `start` tokens are already in the paged KV cache, and `slots` lists the physical
cache slot of each of its positions 0 .. start+n-1 (engine/kv_cache.py: block_id * block_size + offset).

`ForwardBatch.attention` holds what the Triton attention kernels read (triton_kernels/attention.py): block
tables, key counts and query offsets, built on the batch's device once per step, on first use. Block
tables come from the slot lists: with the builder's block_size, entry j of a sequence is slots[j *
block_size] // block_size; without it the page size is 1 and the table is the slot list itself.

On a GPU, `build` packs every int64 it needs (ids, positions, logits rows, slots and the per-sequence
figures the block tables derive from) into one pinned buffer and sends it in one copy (`HostStaging`,
kept by the worker); decode steps that replay a graph do not build a ForwardBatch at all
(engine/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class StepPlan:
    """Everything a rank needs for one step; plain Python, so it pickles small."""

    seqs: list[tuple[list[int], int, list[int]]]  # (KV blocks of positions 0 .. start + n - 1, start, new tokens)
    all_logits: list[bool]  # per sequence: logits for every new token, else only for its last
    block_size: int  # tokens per KV block: position p is in slot blocks[p // bs] * bs + p % bs
    state_slots: tuple[int, ...] = ()  # hybrid models: each sequence's recurrent-state slot; else empty
    # hybrid models, speculative decoding: the sequences (indices) whose state is backed up before this step
    # and whose rows' inputs to it are kept (verify steps), and the state slots to roll back first, each to
    # its backup advanced by its first m rows of the last verify step (slot, m)
    snapshot: tuple[int, ...] = ()
    rollback: tuple[tuple[int, int], ...] = ()
    # one distinct key per sequence, its block table's serial, where the plan goes to other ranks as changes
    # to the last keyed plan (distributed/plan_codec.py); empty: sent whole
    keys: tuple[object, ...] = ()
    # hybrid models' prefix caching (engine/state_pool.py): (snapshot, state slot) copied before the step,
    # (state slot, snapshot) after it
    restores: tuple[tuple[int, int], ...] = ()
    saves: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class MtpPlan:
    """A step of the model's MTP block (speculative decoding's draft-mtp) for every rank: the sequences as
    StepPlan has them (positions with their tokens), the block's KV in the target's blocks. The hidden
    states each row pairs with, [rows, hidden] f32, follow on the device from rank 0 (Communicator
    broadcast_rows)."""

    step: StepPlan
    rows: int


class HostStaging:
    """A step's int64 inputs to the device in one copy: packed into a pinned host buffer, copied into a
    device buffer, handed out as views. Both buffers grow in powers of two and are kept, so a steady state
    allocates nothing. On a CPU device the pieces are just tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.copied = None  # event: the last copy has read the host buffer

    def upload(self, parts: list[Sequence[int] | np.ndarray]) -> list[torch.Tensor]:
        if not self.pinned:
            return [torch.as_tensor(np.asarray(p, dtype=np.int64)).to(self.device) for p in parts]
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if self.host is None or self.host.numel() < total:
            n = 1 << max(10, (total - 1).bit_length())
            self.host = torch.empty(n, dtype=torch.int64, pin_memory=True)
            self.dev = torch.empty(n, dtype=torch.int64, device=self.device)
            self.copied = torch.cuda.Event()
        else:
            self.copied.synchronize()  # the previous step's copy is done with the host buffer
        host = self.host.numpy()
        at = 0
        for p, k in zip(parts, sizes, strict=True):
            host[at : at + k] = p
            at += k
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        self.copied.record()
        return list(self.dev[:total].split(sizes))


@dataclass(frozen=True)
class SeqSlice:
    start: int  # tokens already in the cache
    n: int  # new tokens this step
    offset: int  # first row of the sequence in the flat batch
    slots: torch.Tensor  # [start + n] int64: cache slot of every position of the sequence so far
    state_slot: int = -1  # its recurrent-state slot (hybrid models), else -1
    run: int = -1  # a CPU batch: slots[0] where the slots are one run of consecutive slots, else -1


@dataclass(frozen=True)
class AttentionInputs:
    """The paged-attention kernels' view of one step (int32 where the kernels index with them)."""

    block_tables: torch.Tensor  # [S, max_blocks] int32: page ids per sequence; the padding repeats the last
    seq_lens: torch.Tensor  # [S] int32: start + n, the keys of each sequence once this step's are written
    query_start: torch.Tensor  # [S + 1] int32: sequence s owns rows query_start[s] .. query_start[s + 1] - 1
    new_slots: torch.Tensor  # [T] int64: cache slot of every new token, in row order
    page_size: int  # the block size, or 1 where the builder did not give it
    max_seq_len: int
    max_query_len: int


@dataclass(frozen=True)
class RecurrentInputs:
    """The linear-attention kernels' view of one step (hybrid models; int32)."""

    slots: torch.Tensor  # [S] recurrent-state slot of each sequence
    has_state: torch.Tensor  # [S] 1: the sequence goes on from its slot's state; 0: it starts from zeros
    query_start: torch.Tensor  # [S + 1]: sequence s owns rows query_start[s] .. query_start[s + 1] - 1
    max_query_len: int


@dataclass(frozen=True)
class Snapshot:
    """The sequences of a step whose rows' inputs to the recurrent state are kept (engine/layers/delta_net.py
    SavedRows): (state slot, first kept row, rows) of each, and rows [kept] int64, their rows in the batch."""

    seqs: list[tuple[int, int, int]]
    rows: torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor  # rows of the flat batch whose logits are wanted
    block_size: int | None = None  # of the KV pool the slots come from; None: attention pages of 1 slot
    # per sequence, staged with the rest by build: first slot in the concatenation, last block, keys, and
    # query_start; `attention` computes them where a batch was made without build
    meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    state_meta: tuple[torch.Tensor, torch.Tensor] | None = None  # hybrid models: state slots, has_state, staged
    snapshot: Snapshot | None = None  # hybrid models' verify steps (StepPlan.snapshot)
    saved: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # what the layers kept of `snapshot`

    @classmethod
    def build(cls, seqs: list[tuple[Sequence[int], int, list[int]]], all_logits: list[bool], device: torch.device,
              block_size: int | None = None, staging: HostStaging | None = None,
              state_slots: Sequence[int] = (), snapshot: Sequence[int] = ()) -> ForwardBatch:
        """seqs: (slots of positions 0..start+n-1, start, new token ids); all_logits[i]: logits for every new
        token of sequence i, else for its last one. block_size: the KV pool's, for block tables. staging:
        where the host data goes to the device in one copy (else one tensor per piece). state_slots: each
        sequence's recurrent-state slot (hybrid models), or empty."""
        if state_slots and len(state_slots) != len(seqs):
            raise ValueError(f"{len(state_slots)} state slots for {len(seqs)} sequences")
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (start, n, offset)
        for (slots, start, tokens), every in zip(seqs, all_logits, strict=True):
            if len(slots) != start + len(tokens):
                raise ValueError(f"{len(slots)} slots for {start} cached + {len(tokens)} new positions")
            offset = len(ids)
            spans.append((start, len(tokens), offset))
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            rows.extend(range(offset, offset + len(tokens)) if every else [offset + len(tokens) - 1])
        page = block_size or 1
        lens = [a + n for a, n, _ in spans]
        firsts = np.cumsum([0, *lens[:-1]]).tolist()
        last_blocks = [-(-length // page) - 1 for length in lens]
        qstart = [*(o for _, _, o in spans), len(ids)]
        staging = staging or HostStaging(device)
        states = [list(state_slots), [int(a > 0) for a, _, _ in spans]] if state_slots else []
        ids_t, pos_t, rows_t, *rest = staging.upload(
            [ids, pos, rows, firsts, last_blocks, lens, qstart, *states, *(slots for slots, _, _ in seqs)]
        )
        meta, state_meta, slot_ts = tuple(rest[:4]), tuple(rest[4 : 4 + len(states)]), rest[4 + len(states) :]
        owners = list(state_slots) or [-1] * len(seqs)
        # the CPU's attention reads a sequence whose blocks follow each other as a view of the cache, without a
        # gather (layers/attention.py torch_attention); the kernels of other devices read the block tables
        runs = [_run(slots) if device.type == "cpu" else -1 for slots, _, _ in seqs]
        slices = [SeqSlice(start=a, n=n, offset=o, slots=t, state_slot=k, run=r)
                  for (a, n, o), t, k, r in zip(spans, slot_ts, owners, runs, strict=True)]
        snap = None
        if snapshot:
            if not state_slots:
                raise ValueError("a snapshot needs the sequences' state slots")
            kept, rows = [], []
            for i in snapshot:
                a, n, o = spans[i]
                kept.append((owners[i], len(rows), n))
                rows.extend(range(o, o + n))
            snap = Snapshot(kept, torch.tensor(rows, dtype=torch.int64, device=device))
        return cls(ids_t, pos_t, slices, rows_t, block_size, meta, state_meta or None, snap)

    @cached_property
    def recurrent(self) -> RecurrentInputs:
        if self.state_meta is None:
            raise ValueError("a hybrid model's step needs every sequence's state slot (StepPlan.state_slots)")
        slots, has_state = self.state_meta
        query_start = self.meta[3] if self.meta is not None else torch.tensor(
            [*(s.offset for s in self.seqs), self.input_ids.numel()], dtype=torch.int64, device=self.input_ids.device)
        return RecurrentInputs(slots.to(torch.int32), has_state.to(torch.int32), query_start.to(torch.int32),
                               max(s.n for s in self.seqs))

    @cached_property
    def attention(self) -> AttentionInputs:
        page = self.block_size or 1
        lens = [s.start + s.n for s in self.seqs]
        device = self.input_ids.device
        if self.meta is None:
            firsts = np.cumsum([0, *lens[:-1]]).tolist()
            qstart = [*(s.offset for s in self.seqs), self.input_ids.numel()]
            as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
            meta = (as_t(firsts), as_t([-(-n // page) - 1 for n in lens]), as_t(lens), as_t(qstart))
        else:
            meta = self.meta
        first, last_block, seq_lens, query_start = meta
        flat = torch.cat([s.slots for s in self.seqs])
        j = torch.arange(-(-max(lens) // page), device=device)
        # entry j of sequence s: the slot of its position j * page, divided by page (slot = block * page +
        # offset, so that is the block id); past the sequence's last block the last one repeats
        at = first[:, None] + torch.minimum(j[None, :], last_block[:, None]) * page
        tables = torch.div(flat[at], page, rounding_mode="floor").to(torch.int32)
        return AttentionInputs(
            block_tables=tables,
            seq_lens=seq_lens.to(torch.int32),
            query_start=query_start.to(torch.int32),
            new_slots=torch.cat([s.slots[s.start :] for s in self.seqs]),
            page_size=page,
            max_seq_len=max(lens),
            max_query_len=max(s.n for s in self.seqs),
        )


def _run(slots: Sequence[int]) -> int:
    """slots[0] where the slots are consecutive (slots[0], slots[0] + 1, ...), else -1."""
    a = np.asarray(slots, dtype=np.int64)
    if not len(a):
        return -1
    first = int(a[0])
    return first if np.array_equal(a, np.arange(first, first + len(a))) else -1
