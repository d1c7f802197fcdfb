"""RMSNorm as llama.cpp and transformers compute it: x / sqrt(mean(x^2) + eps) * w, in f32; and the SiLU gate.

On a GPU one Triton launch (triton_kernels/fused.py) does what the torch code below does in several; the
torch code is the CPU path and the kernel's reference. The `*_q8_1` forms also hand back the output's q8_1
copy when the matmuls after them take it (a GPU decode step on int8-dot mat-vecs, QuantLinear.wants_q8_1),
written by the same launch; elsewhere the copy is None and the matmul quantizes for itself, if at all."""

from __future__ import annotations

import torch
from torch import nn

from vegaserve.triton_kernels.moe_ops import ExpertSum

Q8_1 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # triton_kernels/q8_1.py: (int8 codes, scales, scaled sums)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over x's last dimension, in f32, back in x's type: the CPU path's
    norm (RMSNorm's, and rope's head norm). torch's fused form: the same bits as the six ops it replaces,
    10.5 against 14.5 us at a decode row (2 threads)."""
    xf = x.float()
    return torch.nn.functional.rms_norm(xf, (xf.shape[-1],), weight, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from vegaserve.triton_kernels.fused import rms_norm

            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return torch_rms_norm(x, self.weight, self.eps)

    def forward_q8_1(self, x: torch.Tensor, want: bool) -> tuple[torch.Tensor, Q8_1 | None]:
        """(this norm of x [T, N], its q8_1 where `want` and x is on a GPU, else None)."""
        if want and x.is_cuda and x.dim() == 2:
            from vegaserve.triton_kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, q8_1=True)
        return self.forward(x), None

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | ExpertSum,
                    want_q8_1: bool = False) -> tuple[torch.Tensor, torch.Tensor, Q8_1 | None]:
        """(h + delta, this norm of it, the norm's q8_1 as in forward_q8_1): the residual add and the next
        norm, one launch on a GPU. delta may be a mixture-of-experts layer's ExpertSum, summed in the same
        launch (with an f32 residual stream) or first, by add_delta."""
        if isinstance(delta, ExpertSum):
            if not (h.is_cuda and h.dtype == torch.float32 and h.dim() == 2):
                return self.add_forward(h, expert_output(delta), want_q8_1)
        elif not (h.is_cuda and h.dtype == delta.dtype and h.dim() == 2 and h.shape == delta.shape):
            h = h + delta
            return (h, *self.forward_q8_1(h, want_q8_1))
        from vegaserve.triton_kernels.fused import add_rms_norm

        out = add_rms_norm(h, delta, self.weight, self.eps, q8_1=want_q8_1)
        return out if want_q8_1 else (*out, None)


def expert_output(delta: torch.Tensor | ExpertSum) -> torch.Tensor:
    """A layer's output as a tensor: an ExpertSum summed (moe_ops.combine), anything else as it is."""
    if isinstance(delta, ExpertSum):
        from vegaserve.triton_kernels.moe_ops import combine

        return combine(*delta)
    return delta


def add_delta(h: torch.Tensor, delta: torch.Tensor | ExpertSum) -> torch.Tensor:
    """h + a layer's output where no norm follows in the same launch (the last layer's, an MTP block's)."""
    return h + expert_output(delta)


def silu_mul_q8_1(gate_up: torch.Tensor, want: bool) -> tuple[torch.Tensor, Q8_1 | None]:
    """(silu(gate) * up of a fused gate/up output [T, 2F] (gate rows first), its q8_1 where `want` and it is
    on a GPU, else None): one launch on a GPU."""
    if gate_up.is_cuda:
        from vegaserve.triton_kernels.fused import silu_mul as kernel

        return kernel(gate_up, q8_1=True) if want else (kernel(gate_up), None)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up, None
