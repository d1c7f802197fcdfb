"""ForwardBatch: one step's work as the model sees it (flat tokens of several sequences).

Built by the model runner from a ScheduledBatch and passed down the model as an argument (never global).
Tokens of all sequences are concatenated: sequence s owns rows [offset, offset + n) of every [T, ...]
activation; its earlier `start` tokens are already in the paged KV cache, and `slots` lists the physical
cache slot of each of its positions 0 .. start+n-1 (engine/kv_cache.py: block_id * block_size + offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSlice:
    start: int  # tokens already in the cache
    n: int  # new tokens this step
    offset: int  # first row of the sequence in the flat batch
    slots: torch.Tensor  # [start + n] int64: cache slot of every position of the sequence so far


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor  # rows of the flat batch whose logits are wanted

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, list[int]]], all_logits: list[bool], device: torch.device) -> ForwardBatch:
        """seqs: (slots of positions 0..start+n-1, start, new token ids); all_logits[i]: logits for every new
        token of sequence i, else for its last one."""
        ids: list[int] = []
        pos: list[int] = []
        slices: list[SeqSlice] = []
        rows: list[int] = []
        for (slots, start, tokens), every in zip(seqs, all_logits, strict=True):
            if len(slots) != start + len(tokens):
                raise ValueError(f"{len(slots)} slots for {start} cached + {len(tokens)} new positions")
            offset = len(ids)
            slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
            slices.append(SeqSlice(start=start, n=len(tokens), offset=offset, slots=slot_t))
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            rows.extend(range(offset, offset + len(tokens)) if every else [offset + len(tokens) - 1])
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(pos), slices, as_tensor(rows))
