"""RMSNorm, rotary embedding and SiLU-mul kernels (triton_kernels/fused.py) against the engine's torch
code (engine/layers), which is the CPU path: odd sizes, strided views as the model hands them over
(q and k split out of one qkv output), both rope pairings, a partial rope_dim, outputs poisoned first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vegaserve.engine.layers.norm import RMSNorm
from vegaserve.engine.layers.rotary import RotaryEmbedding
from vegaserve.engine.models.arch_config import RopeScaling
from vegaserve.triton_kernels.fused import add_rms_norm, gate_heads, rms_norm, rope, silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("poisoned_empty")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite output: an element the kernel did not write"
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().norm())


@pytest.mark.parametrize("n", [96, 576, 1000])
def test_rms_norm_equals_the_torch_norm_on_strided_rows(n):
    gen = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n, generator=gen)
    wide = torch.randn(7, n + 24, generator=gen) * 3
    x = wide[:, 8 : 8 + n]  # rows with a stride of n + 24, as a split of a wider output
    y = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-5)
    assert y.shape == (7, n)
    assert rel(y, norm(x)) < 1e-6


@pytest.mark.parametrize("n", [96, 1000])
def test_add_rms_norm_equals_the_residual_add_then_the_torch_norm(n):
    gen = torch.Generator().manual_seed(n + 1)
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = torch.randn(n, generator=gen)
    h = torch.randn(5, n, generator=gen) * 2
    wide = torch.randn(5, n + 8, generator=gen)
    delta = wide[:, 4 : 4 + n]  # a strided delta, as a slice of a wider output
    h_out, y = add_rms_norm(h.to(DEVICE), delta.to(DEVICE), norm.weight.to(DEVICE), 1e-6)
    assert torch.equal(h_out.cpu(), h + delta)  # the add itself is exact: same type, same rounding
    assert rel(y, norm(h + delta)) < 1e-6
    h2, y2, none = norm.add_forward(h, delta)  # the CPU path of the same call
    assert torch.equal(h2, h + delta) and torch.equal(y2, norm(h + delta)) and none is None


@pytest.mark.parametrize("with_bias, with_shared", [(False, False), (True, True)])
@pytest.mark.parametrize("n, q8", [(96, False), (1056, True)], ids=["one-program", "slices"])
def test_add_rms_norm_of_an_expert_sum_equals_the_sums_launch_then_the_add(with_bias, with_shared, n, q8):
    """A mixture-of-experts layer's ExpertSum as the delta: summed inside the norm's launch, the same bits
    (h, norm, q8_1) as moe_ops.combine and then add_rms_norm of its output; at 1056 with the q8_1 copy a
    row spreads over three programs, each summing its slice and the whole row."""
    from vegaserve.triton_kernels.moe_ops import ExpertSum, combine

    gen = torch.Generator().manual_seed(n + with_bias)
    T, k, E = 3, 4, 6
    parts = ExpertSum(torch.randn(T * k, n, generator=gen), torch.rand(T, k, generator=gen),
                      torch.randint(0, E, (T, k), generator=gen),
                      torch.randn(E, n, generator=gen) if with_bias else None,
                      torch.randn(T, n, generator=gen) if with_shared else None,
                      torch.randn(T, generator=gen) if with_shared else None)
    parts = ExpertSum(*(p.to(DEVICE) if p is not None else None for p in parts))
    h = (torch.randn(T, n, generator=gen) * 2).to(DEVICE)
    w = torch.randn(n, generator=gen).to(DEVICE)
    got = add_rms_norm(h, parts, w, 1e-6, q8_1=q8)
    want = add_rms_norm(h, combine(*parts), w, 1e-6, q8_1=q8)
    flat = [t for o in (got, want) for t in (o[:2] + tuple(o[2]) if q8 else o)]
    half = len(flat) // 2
    assert all(torch.equal(a, b) for a, b in zip(flat[:half], flat[half:], strict=True))
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = w.cpu()
    assert torch.equal(got[0].cpu(), h.cpu() + combine(*parts).cpu())
    assert rel(got[1], norm(h.cpu() + combine(*parts).cpu())) < 1e-6


def test_the_norms_add_forward_and_add_delta_sum_an_expert_sum_wherever_they_run():
    """RMSNorm.add_forward and norm.add_delta take an ExpertSum on either device (on a GPU the norm's
    launch sums it, off one the sum's launch runs first, then the torch add and norm) and give what the
    summed tensor gives; parts that do not fit the residual stream are refused with their shapes."""
    from vegaserve.engine.layers.norm import add_delta
    from vegaserve.triton_kernels.moe_ops import ExpertSum, combine

    gen = torch.Generator().manual_seed(5)
    T, k, n = 2, 3, 64
    parts = ExpertSum(torch.randn(T * k, n, generator=gen).to(DEVICE), torch.rand(T, k, generator=gen).to(DEVICE),
                      torch.randint(0, 4, (T, k), generator=gen).to(DEVICE))
    h = torch.randn(T, n, generator=gen).to(DEVICE)
    norm = RMSNorm(n, 1e-6).to(DEVICE)
    norm.weight.data = torch.randn(n, generator=gen).to(DEVICE)
    summed = combine(*parts)
    assert torch.equal(add_delta(h, parts), h + summed)
    for a, b in zip(norm.add_forward(h, parts), norm.add_forward(h, summed)):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match=r"experts' sum \[2, 64\]"):
        add_rms_norm(torch.zeros(3, n, device=DEVICE), parts, norm.weight, 1e-6)
    with pytest.raises(ValueError, match="rows for 2 tokens of 3 experts"):
        add_rms_norm(h, parts._replace(y=parts.y[:5]), norm.weight, 1e-6)


def test_rope_of_q_and_k_in_one_call_equals_two_calls():
    gen = torch.Generator().manual_seed(9)
    T, H, KV, D = 3, 4, 2, 64
    rot = RotaryEmbedding(D, D, 10000.0, 32, RopeScaling(), False)
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen)
    positions = torch.tensor([1, 8, 30])
    qk = rope(qkv[:, : (H + KV) * D].view(T, H + KV, D).to(DEVICE), positions.to(DEVICE), rot.cos.to(DEVICE),
              rot.sin.to(DEVICE), D, False)
    q, k, _ = qkv.split([H * D, KV * D, KV * D], dim=-1)
    assert rel(qk[:, :H], rot(q.reshape(T, H, D), positions)) < 1e-6
    assert rel(qk[:, H:], rot(k.reshape(T, KV, D), positions)) < 1e-6


@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
@pytest.mark.parametrize("rope_dim", [64, 32], ids=["full", "partial"])
def test_rope_equals_the_torch_rotary_on_qkv_views(neox, rope_dim):
    gen = torch.Generator().manual_seed(rope_dim + neox)
    T, H, KV, D = 5, 6, 2, 64
    rot = RotaryEmbedding(D, rope_dim, 10000.0, 64, RopeScaling(), neox)
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen)
    positions = torch.tensor([0, 3, 17, 40, 63])

    def q_and_k(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([H * D, KV * D, KV * D], dim=-1)
        return q.view(T, H, D), k.view(T, KV, D)

    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    for x, ref in zip(q_and_k(qkv.to(DEVICE)), q_and_k(qkv), strict=True):
        assert x.stride(0) == (H + 2 * KV) * D  # a view into the qkv output, not a copy
        y = rope(x, positions.to(DEVICE), cos, sin, rope_dim, neox)
        assert rel(y, rot(ref, positions)) < 1e-6


@pytest.mark.parametrize("neox, rope_dim", [(False, 64), (True, 32)], ids=["norm-full", "neox-partial"])
def test_rope_with_the_cache_store_writes_what_write_kv_writes(neox, rope_dim):
    """store: the rotated keys and the values go to the cache in the rope launch: the same rotated output
    as without it, and caches (f16, filled with NaN around) equal element for element to write_kv of the
    rotated keys and the values. 9 query and 3 key heads (SmolLM2's), so one program holds both kinds."""
    from vegaserve.triton_kernels.attention import write_kv
    from vegaserve.triton_kernels.fused import KVStore

    gen = torch.Generator().manual_seed(rope_dim + 3 * neox)
    T, H, KV, D = 4, 9, 3, 64
    rot = RotaryEmbedding(D, rope_dim, 10000.0, 64, RopeScaling(), neox)
    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen).to(DEVICE)
    qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
    v = qkv[:, (H + KV) * D :].view(T, KV, D)
    positions = torch.tensor([2, 9, 33, 60]).to(DEVICE)
    slots = torch.tensor([5, 0, 11, 7]).to(DEVICE)
    caches = [torch.full((12, KV, D), float("nan"), dtype=torch.float16, device=DEVICE) for _ in range(4)]
    y = rope(qk, positions, cos, sin, rope_dim, neox, KVStore(caches[0], caches[1], slots, v, H))
    ref = rope(qk, positions, cos, sin, rope_dim, neox)
    assert torch.equal(y, ref)
    write_kv(caches[2], caches[3], slots, ref[:, H:], v)
    for got, want in zip(caches[:2], caches[2:], strict=True):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="cache store"):
        rope(qk, positions, cos, sin, rope_dim, neox, KVStore(caches[0], caches[1], slots, v, H - 1))


@pytest.mark.parametrize("neox, rope_dim, dtype", [(False, 64, torch.float32), (True, 32, torch.float32),
                                                    (False, 64, torch.bfloat16)],
                         ids=["norm-full-f32", "neox-partial-f32", "norm-full-bf16"])
def test_rope_with_head_norms_equals_each_norm_then_the_rotation(neox, rope_dim, dtype):
    """norm: q's heads normed by q's weight and k's by k's inside the rotation (and the keys so normed in the
    cache) equal RMSNorm of each (its output in x's type, as the norm kernel stores it) then the rotation;
    the module's torch path gives the same bits as the two norms then the rotation."""
    from vegaserve.engine.layers.rotary import head_norm
    from vegaserve.triton_kernels.fused import HeadNorm, KVStore

    gen = torch.Generator().manual_seed(rope_dim + 7 * neox)
    T, H, KV, D = 3, 6, 2, 64
    rot = RotaryEmbedding(D, rope_dim, 10000.0, 64, RopeScaling(), neox)
    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    qkv = (torch.randn(T, (H + 2 * KV) * D, generator=gen) * 4).to(dtype)
    weight = torch.randn(2, D, generator=gen) + 1.0
    norms = [RMSNorm(D, 1e-6) for _ in range(2)]
    for n, w in zip(norms, weight, strict=True):
        n.weight.data = w.clone()
    positions = torch.tensor([1, 20, 47])
    qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
    v = qkv[:, (H + KV) * D :].view(T, KV, D)
    ref = torch.cat((rot(norms[0](qk[:, :H]), positions), rot(norms[1](qk[:, H:]), positions)), dim=1)
    norm = HeadNorm(weight, H, 1e-6)
    assert torch.equal(rot(qk, positions, norm=norm), ref)  # the torch path: the same ops
    assert torch.equal(head_norm(qk[:, H:], HeadNorm(weight, 0, 1e-6)), norms[1](qk[:, H:]))
    slots = torch.tensor([4, 0, 9])
    cdt = torch.float16 if dtype == torch.float32 else dtype  # (bf16 activations keep a bf16 cache)
    caches = [torch.full((10, KV, D), float("nan"), dtype=cdt, device=DEVICE) for _ in range(2)]
    d = lambda t: t.to(DEVICE)  # noqa: E731
    y = rope(d(qk), d(positions), cos, sin, rope_dim, neox, KVStore(*caches, d(slots), d(v), H),
             HeadNorm(d(weight), H, 1e-6))
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: a rounding apart where the sums of squares differ
    assert y.dtype == dtype and rel(y, ref) < tol
    assert rel(caches[0][slots].float(), ref[:, H:].to(cdt).float()) < max(tol, 1e-3)
    assert torch.equal(caches[1][slots].cpu(), v.to(cdt)) and caches[0].isnan().sum() == (10 - T) * KV * D
    # q alone and k alone (heads apart, as gated attention has them): row 0 for q, row 1 for k
    q_only = rope(d(qk[:, :H]), d(positions), cos, sin, rope_dim, neox, None, HeadNorm(d(weight), H, 1e-6))
    k_only = rope(d(qk[:, H:]), d(positions), cos, sin, rope_dim, neox, None, HeadNorm(d(weight), 0, 1e-6))
    assert rel(q_only, ref[:, :H]) < tol and rel(k_only, ref[:, H:]) < tol
    with pytest.raises(ValueError, match="head norm"):
        rope(d(qk), d(positions), cos, sin, rope_dim, neox, None, HeadNorm(d(weight[0]), H, 1e-6))


def test_silu_mul_equals_torch_over_several_column_blocks():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 1500, generator=gen) * 4
    gate, up = x.chunk(2, dim=-1)
    assert rel(silu_mul(x.to(DEVICE)), F.silu(gate) * up) < 1e-6


@pytest.mark.parametrize("q8", [False, True])
def test_gate_heads_equals_the_torch_gate_on_the_q_rows_view(q8):
    """Gated attention's output gate: a sigmoid(gate) with the gate a strided view of the q projection's
    rows (per head, D of query then D of gate, as GatedAttention splits them), its q8_1 copy equal to
    quantize_q8_1 of the output."""
    from vegaserve.triton_kernels.q8_1 import quantize_q8_1

    gen = torch.Generator().manual_seed(11 + q8)
    T, H, D = 3, 4, 64
    qg = (torch.randn(T, H * 2 * D + 16, generator=gen) * 3)[:, 8 : 8 + H * 2 * D].reshape(T, H, 2, D)
    a = torch.randn(T, H, D, generator=gen)
    y, yq = gate_heads(a.to(DEVICE), qg.to(DEVICE)[:, :, 1], q8_1=q8)
    want = a.reshape(T, H * D) * torch.sigmoid(qg[:, :, 1].reshape(T, H * D))
    assert y.shape == (T, H * D) and rel(y, want) < 1e-6
    if q8:
        assert all(torch.equal(u, v) for u, v in zip(yq, quantize_q8_1(y), strict=True))
    else:
        assert yq is None
    with pytest.raises(ValueError, match="gate_heads"):
        gate_heads(a, a[:, :2], q8_1=q8)


def test_shapes_the_kernels_cannot_take_are_refused():
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(torch.zeros(4, 8).t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="differ"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="rope_dim"):
        rope(torch.zeros(2, 1, 8), torch.zeros(2, dtype=torch.long), torch.zeros(4, 2), torch.zeros(4, 2), 3, False)
    with pytest.raises(ValueError, match="2F"):
        silu_mul(torch.zeros(2, 5))


@pytest.mark.parametrize("n", [96, 1056])
def test_norms_and_silu_mul_write_the_q8_1_of_their_output_as_quantize_q8_1_does(n):
    """q8_1=True: the same output, and its q8_1 equal byte for byte to quantize_q8_1 of that output (a
    size that is no power of two, so the last q8_1 blocks of a program are masked; SiLU-mul's rows span
    two programs at 1056)."""
    from vegaserve.triton_kernels.q8_1 import quantize_q8_1

    gen = torch.Generator().manual_seed(n + 7)
    w = torch.randn(n, generator=gen).to(DEVICE)
    x = (torch.randn(3, n, generator=gen) * 2).to(DEVICE)
    delta = torch.randn(3, n, generator=gen).to(DEVICE)
    gate_up = torch.randn(3, 2 * n, generator=gen).to(DEVICE)

    def same_q8_1(y, q8):
        ref = quantize_q8_1(y)
        assert all(torch.equal(a, b) for a, b in zip(q8, ref, strict=True))

    y, q8 = rms_norm(x, w, 1e-5, q8_1=True)
    assert torch.equal(y, rms_norm(x, w, 1e-5))
    same_q8_1(y, q8)
    h, y, q8 = add_rms_norm(x, delta, w, 1e-5, q8_1=True)
    assert all(torch.equal(a, b) for a, b in zip((h, y), add_rms_norm(x, delta, w, 1e-5), strict=True))
    same_q8_1(y, q8)
    y, q8 = silu_mul(gate_up, q8_1=True)
    assert torch.equal(y, silu_mul(gate_up))
    same_q8_1(y, q8)
