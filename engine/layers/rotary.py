"""Rotary position embedding with the scalings GGUF metadata describes.

Two pairings, as llama.cpp names them: NORM rotates adjacent pairs (x[2i], x[2i+1]) and is what `llama`
GGUFs use (the converter permuted q/k rows for it); NEOX rotates (x[i], x[i + d/2]) (qwen2, qwen3).
Only the first `rope_dim` features of a head rotate.

Scalings: linear (positions / factor), per-dimension frequency factors (Llama 3's `rope_freqs.weight`,
dividing each frequency), and YaRN (blend of interpolated and original frequencies over a ramp between
the beta_fast / beta_slow correction dimensions, rounded out to whole dimensions as llama.cpp does except
for gpt-oss, whose reference ramps between the exact ones; cos/sin scaled by 0.1 ln(factor) + 1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vegaserve.engine.layers.norm import torch_rms_norm
from vegaserve.engine.models.arch_config import RopeScaling
from vegaserve.triton_kernels.fused import HeadNorm


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling, freq_factors: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] (f32) and the cos/sin magnitude scale."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    mscale = 1.0
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "yarn":
        orig = scaling.original_context_length or 4096

        def correction_dim(rotations: float) -> float:
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extrapolate = 1.0 - ramp.clamp(0.0, 1.0)  # 1: keep the original frequency
        inv = (inv / scaling.factor) * (1.0 - extrapolate) + inv * extrapolate
        mscale = (0.1 * math.log(scaling.factor) + 1.0) * scaling.attn_factor
    return inv, mscale


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rope_dim: int,
        theta: float,
        max_positions: int,
        scaling: RopeScaling,
        neox: bool,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.neox = neox
        inv, mscale = rope_inv_freq(rope_dim, theta, scaling, freq_factors)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", angles.cos() * mscale, persistent=False)
        self.register_buffer("sin", angles.sin() * mscale, persistent=False)
        self._step_angles: tuple | None = None  # the CPU path's factors of the last positions (_factors)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, store=None, norm: HeadNorm | None = None) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T]. One Triton launch on a GPU (triton_kernels/fused.py),
        the torch code below elsewhere (and as its reference). `store` (a GPU only, layers/attention.py
        kv_store): the same launch writes the rotated keys and the values to the KV cache. `norm`: each head
        RMS-normed before it is rotated (q/k norm), in the same launch on a GPU."""
        if x.is_cuda:
            from vegaserve.triton_kernels.fused import rope

            return rope(x, positions, self.cos, self.sin, self.rope_dim, self.neox, store, norm)
        if store is not None:
            raise ValueError("the cache store in the rotation is the GPU kernel's")
        if norm is not None:
            x = head_norm(x, norm)
        cos, sin = self._factors(positions, x.dtype)
        whole = self.rope_dim == x.shape[-1]
        rot, rest = (x, None) if whole else (x[..., : self.rope_dim], x[..., self.rope_dim :])
        # (a, b) -> (a cos - b sin, b cos + a sin) as rot * cos + partner * sin with sin's first member negated:
        # the same products and sums, so the same bits, in four ops
        if self.neox:  # pairs (i, i + d/2)
            a, b = rot.chunk(2, dim=-1)
            partner = torch.cat((b, a), dim=-1)
        else:  # pairs (2i, 2i + 1)
            partner = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        out = rot * cos + partner * sin
        return out if whole else torch.cat((out, rest), dim=-1)

    def _factors(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, rope_dim] of the CPU path for `positions`, in `dtype`, laid out as the
        pairs are; made once a step, since every layer rotates by the same positions (kept while they
        equal a copy of the last ones: a tensor changed in place is not mistaken for the last)."""
        last = self._step_angles
        if (last is not None and last[1] == dtype and last[0].shape == positions.shape
                and torch.equal(last[0], positions)):
            return last[2], last[3]
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, d/2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        if self.neox:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        self._step_angles = (positions.clone(), dtype, cos, sin)
        return cos, sin


def head_norm(x: torch.Tensor, norm: HeadNorm) -> torch.Tensor:
    """x [T, H, D] with each head RMS-normed as norm says (the torch form of rope's `norm`): heads below
    norm.first_k by weight row 0, the others by row 1, by RMSNorm's own CPU norm (norm.torch_rms_norm)."""
    k = norm.first_k
    parts = [torch_rms_norm(p, w, norm.eps) for p, w in ((x[:, :k], norm.weight[0]), (x[:, k:], norm.weight[1]))
             if p.shape[1]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
