"""The gated DeltaNet's input and output kernels (triton_kernels/delta_io.py) against their torch references,
which are the CPU path's formulas: strided views as the layer hands them over (y's q, k and v channels; the
in-projection's gate columns anywhere in its row), gates past softplus's threshold and far below zero, the
output's q8_1 copy equal to quantize_q8_1 of that output; outputs poisoned first. And the kernels compile
for an NVIDIA sm_90 and an AMD gfx906 target at Qwen3.6's head widths."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.delta_io import inputs, output, reference_inputs, reference_output

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("poisoned_empty")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite output: an element the kernel did not write"
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().norm())


@pytest.mark.parametrize("hk, hv", [(2, 6), (4, 4)])
def test_inputs_equal_the_torch_formulas(hk, hv):
    gen = torch.Generator().manual_seed(hk * 10 + hv)
    T, D = 5, 16
    wide = torch.randn(T, 2 * hk * D + hv * D + 24, generator=gen) * 3
    y = wide[:, 8 : 8 + 2 * hk * D + hv * D]  # rows strided, as a slice of a wider output
    p = torch.randn(T, 3 * hv + 5, generator=gen) * 4
    cols = torch.randperm(p.shape[1], generator=gen)[: 2 * hv].reshape(2, hv).to(torch.int32)
    p[0, cols[1]] = torch.linspace(-40, 40, hv)  # alpha + dt past softplus's threshold and far below zero
    ssm_a = -torch.rand(hv, generator=gen) * 8
    dt = torch.randn(hv, generator=gen)
    want = reference_inputs(y, p[:, cols[0].long()], p[:, cols[1].long()], ssm_a, dt, hk, D, 1e-6)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    got = inputs(d(y), d(p), d(cols), d(ssm_a), d(dt), hk, D, 1e-6)
    for name, a, b in zip(("q", "k", "g", "beta"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert torch.allclose(a.cpu(), b, rtol=2e-6, atol=1e-7), (name, rel(a, b))


@pytest.mark.parametrize("q8", [False, True])
def test_output_equals_the_torch_gated_norm(q8):
    from vegaserve.triton_kernels.q8_1 import quantize_q8_1

    gen = torch.Generator().manual_seed(3 + q8)
    T, HV, D = 3, 4, 64
    o = torch.randn(T, HV, D, generator=gen) * 5
    wide = torch.randn(T, HV * D + 40, generator=gen) * 2
    z = wide[:, 16 : 16 + HV * D]
    w = torch.randn(D, generator=gen)
    y, yq = output(o.to(DEVICE), z.to(DEVICE), w.to(DEVICE), 1e-6, torch.float32, q8_1=q8)
    assert y.shape == (T, HV * D) and rel(y, reference_output(o, z, w, 1e-6)) < 1e-6
    if q8:
        assert all(torch.equal(a, b) for a, b in zip(yq, quantize_q8_1(y), strict=True))
    else:
        assert yq is None


def test_shapes_the_kernels_cannot_take_are_refused():
    y, p = torch.zeros(2, 96), torch.zeros(2, 12)
    cols = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="delta inputs"):
        inputs(y, p, cols, torch.zeros(3), torch.zeros(2), 2, 16, 1e-6)  # ssm_a of 3 heads for 2
    with pytest.raises(ValueError, match="delta inputs"):
        inputs(y.t(), p, cols, torch.zeros(2), torch.zeros(2), 2, 16, 1e-6)
    with pytest.raises(ValueError, match="delta output"):
        output(torch.zeros(2, 2, 16), torch.zeros(2, 32), torch.zeros(16), 1e-6, torch.float32, q8_1=True)  # D < 32
    with pytest.raises(ValueError, match="delta output"):
        output(torch.zeros(2, 2, 16), torch.zeros(2, 31), torch.zeros(16), 1e-6, torch.float32)


COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vegaserve.triton_kernels import delta_io

backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, warp)

def build(fn, consts, ptrs):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": 4})

f32 = "*fp32"
# Qwen3.6-27B: 16 key heads, 48 value heads of 128
build(delta_io._inputs_kernel, dict(HK=16, HV=48, HV_P2=64, D=128, PDL=False),
      {"y_ptr": f32, "p_ptr": f32, "cols_ptr": "*i32", "a_ptr": f32, "dt_ptr": f32, "q_ptr": f32, "k_ptr": f32,
       "g_ptr": f32, "beta_ptr": f32, "eps": "fp32", "scale": "fp32"})
build(delta_io._output_kernel, dict(HV=48, D=128, Q8=True, PDL=False),
      {"o_ptr": f32, "z_ptr": f32, "w_ptr": f32, "y_ptr": f32, "q_ptr": "*i8", "qd_ptr": f32, "qs_ptr": f32,
       "eps": "fp32"})
print("compiled")
"""


@pytest.mark.parametrize("backend,arch,warp", [("cuda", "90", 32), ("hip", "gfx906", 64)], ids=["sm90", "gfx906"])
def test_the_kernels_compile_for_the_target(backend, arch, warp, offline_compile):
    offline_compile(COMPILE, backend, arch, warp)
