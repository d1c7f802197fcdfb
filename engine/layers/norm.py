"""RMSNorm as llama.cpp and transformers compute it: x / sqrt(mean(x^2) + eps) * w, in f32; and the SiLU gate.

On a GPU one Triton launch (triton_kernels/fused.py) does what the torch code below does in six; the
torch code is the CPU path and the kernel's reference."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from vegaserve.triton_kernels.fused import rms_norm

            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, this norm of it): the residual add and the next norm, one launch on a GPU."""
        if h.is_cuda and h.dtype == delta.dtype and h.dim() == 2 and h.shape == delta.shape:
            from vegaserve.triton_kernels.fused import add_rms_norm

            return add_rms_norm(h, delta, self.weight, self.eps)
        h = h + delta
        return h, self(h)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up output [T, 2F] (gate rows first): one launch on a GPU."""
    if gate_up.is_cuda:
        from vegaserve.triton_kernels.fused import silu_mul as kernel

        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
