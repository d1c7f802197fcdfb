"""ForwardBatch: one step's work as the model sees it (flat tokens of several sequences).

Built by the model runner from a ScheduledBatch and passed down the model as an argument (never global).
Tokens of all sequences are concatenated: sequence s owns rows [offset, offset + n) of every [T, ...]
activation, its cache slot holds `start` earlier tokens, and the new ones go to positions start .. start+n-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSlice:
    slot: int  # KV cache slot of the sequence
    start: int  # tokens already in the cache
    n: int  # new tokens this step
    offset: int  # first row of the sequence in the flat batch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor  # rows of the flat batch whose logits are wanted

    @classmethod
    def build(cls, seqs: list[tuple[int, int, list[int]]], all_logits: list[bool], device: torch.device) -> ForwardBatch:
        """seqs: (slot, start, new token ids); all_logits[i]: logits for every new token of i, else the last."""
        ids: list[int] = []
        pos: list[int] = []
        slices: list[SeqSlice] = []
        rows: list[int] = []
        for (slot, start, tokens), every in zip(seqs, all_logits, strict=True):
            offset = len(ids)
            slices.append(SeqSlice(slot=slot, start=start, n=len(tokens), offset=offset))
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            rows.extend(range(offset, offset + len(tokens)) if every else [offset + len(tokens) - 1])
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(pos), slices, as_tensor(rows))
