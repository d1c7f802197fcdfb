"""The dense gated feed-forward: down(silu(gate(x)) * up(x)), gate and up one matmul over their stacked rows.

Under tensor parallelism a lane holds its slice of the intermediate size: down by input columns in whole
quantization blocks (sharding.block_split: a lane may hold a block more than its neighbour), gate and up by
the same range of output rows; the lanes' partial outputs meet in the layer's AllReduce.
"""

from __future__ import annotations

import torch
from torch import nn

from vegaserve.engine.distributed.sharding import lane_block_split, slice_cols, slice_rows
from vegaserve.engine.layers.linear import QuantLinear, QuantMethod
from vegaserve.engine.layers.norm import Q8_1, silu_mul_q8_1


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, method: QuantMethod, tp: int = 1, lane: int = 0) -> None:
        super().__init__()
        self.hidden, self.full_ffn = hidden, ffn
        self.tp, self.lane = tp, lane
        self.method = method
        self._linears(ffn // tp)  # the even share until load reads the down projection's blocks

    def _linears(self, ffn: int) -> None:
        self.ffn = ffn
        self.gate_up = QuantLinear(self.hidden, [ffn] * 2, self.method)
        self.down = QuantLinear(ffn, [self.hidden], self.method)

    def load(self, w, prefix: str) -> None:
        """`w` a models.weights.WeightLoader; prefix "blk.N."."""
        down = w.source(prefix + "ffn_down.weight", (self.hidden, self.full_ffn))
        f = lane_block_split(down, self.tp, self.lane)  # this lane's intermediate rows: whole blocks of down
        if f[1] != self.ffn:
            self._linears(f[1])
        up_shape = (self.full_ffn, self.hidden)
        self.gate_up.load([slice_rows(w.source(prefix + f"ffn_{n}.weight", up_shape), *f) for n in ("gate", "up")],
                          w.device)
        self.down.load([slice_cols(down, *f)], w.device)

    def wants_q8_1(self, m: int) -> bool:
        """Whether forward at m rows takes x's q8_1 copy (the norm before writes it)."""
        return self.gate_up.wants_q8_1(m)

    def forward(self, x: torch.Tensor, xq: Q8_1 | None = None) -> torch.Tensor:
        T = x.shape[0]
        return self.down(*silu_mul_q8_1(self.gate_up(x, xq), self.down.wants_q8_1(T)))

    def delta(self, x: torch.Tensor, xq: Q8_1 | None = None) -> torch.Tensor:
        """forward, as the decoder layer hands it on (MoE.delta's counterpart)."""
        return self.forward(x, xq)
