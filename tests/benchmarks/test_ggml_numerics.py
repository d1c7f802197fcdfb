"""ggml-cpu arithmetic emulation: each function against a per-element Python/NumPy loop of the same formula."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vegaserve.triton_kernels.dequant import dequantize

# an analysis tool beside the benchmarks, not engine code: loaded by path
_spec = importlib.util.spec_from_file_location(
    "vegaserve_bench_ggml_numerics", Path(__file__).resolve().parents[2] / "benchmarks" / "ggml_numerics.py"
)
G = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = G
_spec.loader.exec_module(G)


def f16(v: float) -> float:
    return float(np.float32(np.float16(np.float32(v))))


def ref_q8_1_block(xs: list[float], variant: str) -> tuple[list[int], float, float]:
    """quantize_row_q8_1 (x86 AVX: id = 127/amax, nearest-even; ref: id = 1/d, roundf) for one block."""
    x = np.asarray(xs, dtype=np.float32)
    amax = np.float32(max(abs(float(v)) for v in x))
    d = np.float32(amax / np.float32(127.0))
    if variant == "x86":
        inv = np.float32(np.float32(127.0) / amax) if amax != 0 else np.float32(0)
        q = [int(np.rint(np.float32(v * inv))) for v in x]
    else:
        inv = np.float32(np.float32(1.0) / d) if d != 0 else np.float32(0)
        q = [int(math.copysign(math.floor(abs(float(np.float32(v * inv))) + 0.5), float(v))) for v in x]
    s = f16(float(np.float32(d * np.float32(sum(q)))))
    return q, f16(float(d)), s


@pytest.mark.parametrize("variant", ["x86", "ref"])
def test_q8_1_block_matches_per_element_reference(variant):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g) * torch.tensor([0.01, 1.0, 30.0, 500.0])[:, None]
    x[1, 3] = 0.0
    x[3, 32:] = 0.0  # an all-zero block: d = 0, q = 0
    q, d16, s16 = G.quantize_q8_1(x, variant)
    for r in range(4):
        for b in range(2):
            rq, rd, rs = ref_q8_1_block(x[r, 32 * b : 32 * b + 32].tolist(), variant)
            assert q[r, b].int().tolist() == rq
            assert d16[r, b, 0].item() == rd
            assert s16[r, b, 0].item() == rs


def test_roundf_ties_go_away_from_zero_and_torch_round_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 2.4999998, -3.5])
    assert G.round_half_away(x).tolist() == [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, 2.0, -4.0]
    assert torch.round(x).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 0.0, 2.0, -4.0]


def test_q8_K_block_matches_per_element_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 512, generator=g) * 3
    x[0, 7] = -50.0  # a negative max: iscale > 0
    q, d = G.quantize_q8_K(x)
    for r in range(2):
        for b in range(2):
            blk = np.asarray(x[r, 256 * b : 256 * b + 256].tolist(), dtype=np.float32)
            amax, mx = 0.0, 0.0
            for v in blk:
                if abs(v) > amax:
                    amax, mx = abs(v), v
            iscale = np.float32(np.float32(-127.0) / np.float32(mx))
            rq = [min(127, int(np.rint(np.float32(iscale * v)))) for v in blk]
            assert q[r, b].int().tolist() == rq
            assert d[r, b, 0].item() == float(np.float32(np.float32(1.0) / iscale))


def q4_1_bytes(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q4_1 blocks: f16 d, f16 m, 16 bytes of nibbles."""
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(n * k // 32):
        d = np.float16(rng.uniform(0.001, 0.02)).tobytes()
        m = np.float16(rng.uniform(-0.15, 0.0)).tobytes()
        blocks.append(d + m + rng.integers(0, 256, 16, dtype=np.uint8).tobytes())
    return torch.frombuffer(bytearray(b"".join(blocks)), dtype=torch.uint8)


def test_legacy_blocks_dequantize_like_the_engine():
    raw = q4_1_bytes(3, 64, seed=2)
    blocks = G.LegacyBlocks.from_raw(raw, G.Q4_1, (3, 64))
    assert torch.equal(blocks.dequantize(), dequantize(raw, G.Q4_1, (3, 64)))
    assert torch.equal(G.block_mins_from_raw(raw, G.Q4_1, (3, 64)), blocks.m)


def test_q4_1_linear_matches_loop_over_blocks_with_stored_sum():
    """y = sum_b d_w d_x sum(q_w q_x) + m_b s_b, with s the f16 q8_1 sum (not the exact sum of x)."""
    raw = q4_1_bytes(5, 96, seed=3)
    w = G.LegacyBlocks.from_raw(raw, G.Q4_1, (5, 96))
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(4))
    q, d16, s16 = G.quantize_q8_1(x)
    ref = np.zeros((2, 5))
    for t in range(2):
        for n in range(5):
            for b in range(3):
                qw = w.q[n, 32 * b : 32 * b + 32].double().numpy()
                sumi = float(np.dot(qw, q[t, b].double().numpy()))
                ref[t, n] += w.d[n, b].item() * d16[t, b, 0].item() * sumi + w.m[n, b].item() * s16[t, b, 0].item()
    fast = G.quantized_linear_like_ggml(x, w.dequantize(), G.Q4_1, block_min=w.m)
    exact = G.legacy_linear_exact(x, w)
    np.testing.assert_allclose(fast.double().numpy(), ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(exact.double().numpy(), ref, rtol=0, atol=2e-6)


def test_activation_quant_kinds_by_weight_type():
    assert [G.vec_dot_type(t) for t in (G.Q4_0, G.Q4_1, G.Q8_0, G.IQ4_NL, G.Q4_K, G.Q6_K, G.F16)] == [
        "q8_0", "q8_1", "q8_0", "q8_0", "q8_K", "q8_K", "f16"]
    x = torch.randn(3, 256)
    assert torch.equal(G.quantize_activation_like_ggml(x, G.F16), x.half().float())
    assert (G.quantize_activation_like_ggml(x, G.Q4_K) - x).abs().max() <= x.abs().max() / 127


def ref_flash_attention(q, k, v, mask, scale):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk, one query row at a time, f16 V accumulator."""
    H, n, D = q.shape
    out = np.zeros((H, n, D), dtype=np.float32)
    g = H // k.shape[0]
    for h in range(H):
        for i in range(n):
            qh = q[h, i].astype(np.float16).astype(np.float32)
            M, S = -np.inf, np.float32(0)
            acc = np.zeros(D, dtype=np.float16)
            for j in range(k.shape[1]):
                if mask is not None and not mask[i, j]:
                    continue
                kj = k[h // g, j].astype(np.float16).astype(np.float32)
                s = np.float32(np.dot(qh.astype(np.float64), kj.astype(np.float64))) * np.float32(scale)
                ms, vs = np.float32(1), np.float32(1)
                if s > M:
                    ms = np.float32(np.exp(np.float32(M - s))) if M != -np.inf else np.float32(0)
                    M = s
                    acc = (acc.astype(np.float32) * ms).astype(np.float16)
                else:
                    vs = np.float32(np.exp(np.float32(s - M)))
                vj = v[h // g, j].astype(np.float16).astype(np.float32)
                acc = (acc.astype(np.float32) + vj * vs).astype(np.float16)
                S = np.float32(S * ms + vs)
            out[h, i] = acc.astype(np.float32) * (np.float32(1) / S)
    return out


def test_one_chunk_attention_matches_loop_with_f16_accumulator():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 3, 16, generator=gen) * 3
    k = torch.randn(2, 7, 16, generator=gen)
    v = torch.randn(2, 7, 16, generator=gen) * 5
    mask = torch.arange(7)[None, :] <= torch.arange(4, 7)[:, None]
    got = G.ggml_flash_attention(q, k, v, mask, 0.25, path="one_chunk").numpy()
    ref = ref_flash_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy(), 0.25)
    # same f16 accumulator; only the last f32 bits of the dot / expf / 1/S may differ
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert (torch.from_numpy(got) - sdpa).abs().max() > 1e-3  # ~400x the tolerance above: f16 rounding shows


def test_tiled_attention_is_f32_softmax_over_f16_kv():
    gen = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 70, 8, generator=gen), torch.randn(1, 70, 8, generator=gen), torch.randn(1, 70, 8, generator=gen)
    mask = torch.ones(70, 70, dtype=torch.bool).tril()
    got = G.ggml_flash_attention(q, k, v, mask, 0.3)  # auto: 70 >= 64 queries -> tiled
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.half().float().expand(2, -1, -1), v.half().float().expand(2, -1, -1), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_rope_angles_use_iterated_f32_theta_scale():
    cos, sin = G.ggml_rope_cos_sin(torch.tensor([0, 7, 53]), 8, 100000.0)
    theta_scale = np.float32(math.pow(100000.0, -2.0 / 8))
    for r, p in enumerate([0, 7, 53]):
        theta = np.float32(p)
        for i in range(4):
            assert cos[r, i].item() == pytest.approx(float(np.cos(theta)), abs=1e-6)
            assert sin[r, i].item() == pytest.approx(float(np.sin(theta)), abs=1e-6)
            theta = np.float32(theta * theta_scale)
