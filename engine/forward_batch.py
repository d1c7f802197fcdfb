"""ForwardBatch: one step's work as the model sees it (flat tokens of several sequences).

Built by the model runner from a ScheduledBatch and passed down the model as an argument (never global).
Tokens of all sequences are concatenated: sequence s owns rows [offset, offset + n) of every [T, ...]
activation; its earlier `start` tokens are already in the paged KV cache, and `slots` lists the physical
cache slot of each of its positions 0 .. start+n-1 (engine/kv_cache.py: block_id * block_size + offset).

`ForwardBatch.attention` holds what the Triton attention kernels read (triton_kernels/attention.py): block
tables, key counts and query offsets, built on the batch's device once per step, on first use. Block
tables come from the slot lists: with the builder's block_size, entry j of a sequence is slots[j *
block_size] // block_size; without it the page size is 1 and the table is the slot list itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SeqSlice:
    start: int  # tokens already in the cache
    n: int  # new tokens this step
    offset: int  # first row of the sequence in the flat batch
    slots: torch.Tensor  # [start + n] int64: cache slot of every position of the sequence so far


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


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor  # rows of the flat batch whose logits are wanted
    block_size: int | None = None  # of the KV pool the slots come from; None: attention pages of 1 slot

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, list[int]]], all_logits: list[bool], device: torch.device,
              block_size: int | None = None) -> ForwardBatch:
        """seqs: (slots of positions 0..start+n-1, start, new token ids); all_logits[i]: logits for every new
        token of sequence i, else for its last one. block_size: the KV pool's, for block tables."""
        ids: list[int] = []
        pos: list[int] = []
        slices: list[SeqSlice] = []
        rows: list[int] = []
        for (slots, start, tokens), every in zip(seqs, all_logits, strict=True):
            if len(slots) != start + len(tokens):
                raise ValueError(f"{len(slots)} slots for {start} cached + {len(tokens)} new positions")
            offset = len(ids)
            slot_t = (slots.to(device) if isinstance(slots, torch.Tensor)
                      else torch.tensor(slots, dtype=torch.int64, device=device))
            slices.append(SeqSlice(start=start, n=len(tokens), offset=offset, slots=slot_t))
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            rows.extend(range(offset, offset + len(tokens)) if every else [offset + len(tokens) - 1])
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(pos), slices, as_tensor(rows), block_size)

    @cached_property
    def attention(self) -> AttentionInputs:
        page = self.block_size or 1
        lens = [s.start + s.n for s in self.seqs]
        blocks = [-(-length // page) for length in lens]
        firsts = [0]  # where each sequence's slots begin in the concatenation
        qstart = [0]
        for s, length in zip(self.seqs, lens, strict=True):
            firsts.append(firsts[-1] + length)
            qstart.append(qstart[-1] + s.n)
        device = self.input_ids.device
        flat = torch.cat([s.slots for s in self.seqs])
        first, last_block = torch.tensor([firsts[:-1], [b - 1 for b in blocks]], device=device)
        j = torch.arange(max(blocks), device=device)
        # entry j of sequence s: the slot of its position j * page, divided by page (slot = block * page +
        # offset, so that is the block id); past the sequence's last block the last one repeats
        at = first[:, None] + torch.minimum(j[None, :], last_block[:, None]) * page
        tables = torch.div(flat[at], page, rounding_mode="floor").to(torch.int32)
        return AttentionInputs(
            block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            query_start=torch.tensor(qstart, dtype=torch.int32, device=device),
            new_slots=torch.cat([s.slots[s.start :] for s in self.seqs]),
            page_size=page,
            max_seq_len=max(lens),
            max_query_len=max(s.n for s in self.seqs),
        )
