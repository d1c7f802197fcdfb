"""Token embedding read straight from the GGUF table: only the rows a step needs are dequantized.

The table stays in its GGUF type (on the device, canonical bytes); a tied LM head reads the same bytes
through its own QuantLinear.
"""

from __future__ import annotations

import torch
from torch import nn

from vegaserve.engine.layers.linear import WeightSource
from vegaserve.triton_kernels.dequant import dequantize


class QuantEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.raw: torch.Tensor | None = None
        self.type_id = -1

    def load(self, src: WeightSource, device: torch.device) -> None:
        self.raw = src.raw.reshape(self.vocab, -1).to(device)
        self.type_id = src.info.type_id

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw.index_select(0, ids)
        return dequantize(rows, self.type_id, (ids.numel(), self.hidden))
