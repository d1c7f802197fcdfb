"""Rotary embedding: pairings and the scalings GGUF metadata describes, against direct formulas."""

from __future__ import annotations

import math

import torch

from vegaserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq
from vegaserve.engine.models.arch_config import RopeScaling


def direct_rope(x, pos, inv, neox):
    """Rotate each pair by pos * inv[i], one pair at a time."""
    out = x.clone().double()
    d = inv.numel() * 2
    for t in range(x.shape[0]):
        for i in range(d // 2):
            a_i, b_i = (i, i + d // 2) if neox else (2 * i, 2 * i + 1)
            ang = float(pos[t]) * float(inv[i])
            a, b = x[t, :, a_i].double(), x[t, :, b_i].double()
            out[t, :, a_i] = a * math.cos(ang) - b * math.sin(ang)
            out[t, :, b_i] = b * math.cos(ang) + a * math.sin(ang)
    return out


def test_norm_and_neox_pairings_match_direct_rotation():
    x = torch.randn(5, 3, 16)
    pos = torch.tensor([0, 1, 7, 30, 99])
    for neox in (False, True):
        rope = RotaryEmbedding(16, 16, 10000.0, 128, RopeScaling(), neox=neox)
        inv, _ = rope_inv_freq(16, 10000.0, RopeScaling(), None)
        assert torch.allclose(rope(x, pos).double(), direct_rope(x, pos, inv, neox), atol=1e-5)


def test_partial_rotary_leaves_the_tail_untouched():
    x = torch.randn(4, 2, 16)
    rope = RotaryEmbedding(16, 8, 10000.0, 64, RopeScaling(), neox=True)
    y = rope(x, torch.arange(4) + 3)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])


def test_linear_scaling_divides_positions_by_the_factor():
    x = torch.randn(3, 2, 16)
    scaled = RotaryEmbedding(16, 16, 10000.0, 64, RopeScaling(kind="linear", factor=4.0), neox=False)
    plain = RotaryEmbedding(16, 16, 10000.0, 64, RopeScaling(), neox=False)
    assert torch.allclose(scaled(x, torch.tensor([4, 8, 40])), plain(x, torch.tensor([1, 2, 10])), atol=1e-5)


def test_frequency_factors_divide_each_frequency():
    factors = torch.linspace(1.0, 8.0, 8)
    with_ff, _ = rope_inv_freq(16, 500000.0, RopeScaling(), factors)
    plain, _ = rope_inv_freq(16, 500000.0, RopeScaling(), None)
    assert torch.allclose(with_ff, plain / factors)


def test_yarn_keeps_high_frequencies_interpolates_low_ones_and_scales_magnitude():
    s = RopeScaling(kind="yarn", factor=4.0, original_context_length=4096)
    inv, mscale = rope_inv_freq(128, 10000.0, s, None)
    plain, _ = rope_inv_freq(128, 10000.0, RopeScaling(), None)
    assert torch.allclose(inv[:4], plain[:4])  # fast-rotating dims: extrapolated (unchanged)
    assert torch.allclose(inv[-4:], plain[-4:] / 4.0)  # slow dims: interpolated by the factor
    assert ((inv >= plain / 4.0 - 1e-12) & (inv <= plain + 1e-12)).all()
    assert math.isclose(mscale, 0.1 * math.log(4.0) + 1.0)


def test_the_cpu_factors_made_once_a_step_follow_positions_changed_in_place_or_replaced():
    """The CPU path keeps the last positions' cos/sin for the next layer of the step: positions changed in
    place (same tensor), a new tensor, a new length and another dtype each get their own rotation."""
    rope = RotaryEmbedding(16, 16, 10000.0, 128, RopeScaling(), neox=False)
    inv, _ = rope_inv_freq(16, 10000.0, RopeScaling(), None)
    x = torch.randn(3, 2, 16)
    pos = torch.tensor([0, 5, 9])
    for _ in range(2):  # the second call takes the kept factors
        assert torch.allclose(rope(x, pos).double(), direct_rope(x, pos, inv, False), atol=1e-5)
    pos.add_(3)
    assert torch.allclose(rope(x, pos).double(), direct_rope(x, pos, inv, False), atol=1e-5)
    other = torch.tensor([40, 41, 42])
    assert torch.allclose(rope(x, other).double(), direct_rope(x, other, inv, False), atol=1e-5)
    assert torch.allclose(rope(x[:1], other[:1]).double(), direct_rope(x[:1], other[:1], inv, False), atol=1e-5)
    y = rope(x.double(), other)
    assert y.dtype == torch.float64 and torch.allclose(y, direct_rope(x, other, inv, False), atol=1e-5)
