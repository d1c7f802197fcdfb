"""The quantized GEMM's int8 mode (gemm.quant_gemm with int8 1, gemm_int8.py) against float64 references, each
type with the mode in both layouts, under the interpreter on a CPU.

Two bounds. Against the product on x's q8_1 form (matvec_int8.reference_matvec_q8_1: x replaced by codes * d)
the only error is the kernel's own: each sub-block's int32 sum is exact, then it is converted, scaled by the
weight's and x's scales (d sc of a K-quant is exact in f32: an 11-bit f16 times a 6- or 8-bit integer) and
added into an f32 accumulator, at most 4 roundings a term plus one an add over at most 32 terms an output
(Q6_K: two a 32-element chunk) and the split-K sum, about 40 * 2^-24 = 2.4e-6 of the terms' magnitude; Q4_K
and Q5_K's min terms cancel part of their sums (a factor of a few), so 1e-5, as the f32-operand GEMM tests
(measured 5e-8 to 9e-8). Against the product on x itself the q8_1 rounding adds its own: half a step of d =
amax / 127 uniformly, an RMS of amax / (127 * sqrt(12)), about 5.0e-3 of x's RMS for 32 normal values (amax
about 2.2); the product's relative error is the same (measured 5.3e-3 to 5.8e-3), so 8e-3.
"""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.gemm import quant_gemm
from vegaserve.triton_kernels.layout import canonical, repack
from vegaserve.triton_kernels.matmul import reference_matmul
from vegaserve.triton_kernels.matvec_int8 import reference_matvec_q8_1
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
INT8_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "IQ4_NL", "MXFP4"]

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has non-finite values (unwritten or broken)"
    return float((y.double().cpu() - ref.cpu()).norm() / ref.norm())


def make(type_name: str, n: int, k: int, layout, seed: int):
    tid = TYPE_IDS[type_name]
    gen = torch.Generator().manual_seed(seed)
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, gen).to(DEVICE)
    return layout(raw, tid, n, k), torch.Generator().manual_seed(seed + 1)


def _cpu(w):
    from dataclasses import replace

    return replace(w, data=w.data.cpu())


def _cpu_q8_1(q8):
    return tuple(t.cpu() for t in q8)


@pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])
@pytest.mark.parametrize("type_name", INT8_TYPES)
def test_int8_gemm_matches_the_q8_1_product_at_16_64_and_200_rows(type_name, layout):
    """16 rows in K splits of one tile (block_m 16, block_n 32), 64 rows in one block of 32 x 16, 200 rows over
    four blocks of 64, the last partial; N = 37 (a partial weight block); outputs from poisoned memory. Within
    1e-5 of the product on x's q8_1 form and 8e-3 of the product on x (the module docstring's bounds)."""
    qk = GGML_TYPES[TYPE_IDS[type_name]].block_size
    k = 512 if qk == 256 else 128
    w, gen = make(type_name, 37, k, layout, 21)
    for m, block_m, block_n, split_k in ((16, 16, 32, 2), (64, 32, 16, 1), (200, 64, 16, 1)):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        q8 = quantize_q8_1(x)
        y = quant_gemm(x, w, block_m=block_m, block_n=block_n, nb=8 if qk == 256 else 2, split_k=split_k, int8=1,
                       q8_1=q8)
        assert y.shape == (m, 37)
        q, d, _ = _cpu_q8_1(q8)
        assert rel_err(y, reference_matvec_q8_1(q, d, _cpu(w))) < 1e-5, (m, split_k)
        assert rel_err(y, reference_matmul(x.cpu(), _cpu(w))) < 8e-3, (m, split_k)


def test_int8_gemm_quantizes_x_itself_when_not_given_its_q8_1():
    """Without q8_1 the launcher quantizes x (quantize_q8_1): the same output, bit for bit."""
    w, gen = make("Q4_K", 37, 512, repack, 22)
    x = torch.randn(20, 512, generator=gen).to(DEVICE)
    mine = quant_gemm(x, w, block_m=16, block_n=16, int8=1)
    assert torch.equal(mine, quant_gemm(x, w, block_m=16, block_n=16, int8=1, q8_1=quantize_q8_1(x)))


@pytest.mark.parametrize("name, layout", [("Q4_K", True), ("Q6_K", False), ("Q8_0", True)],
                         ids=["Q4_K-repack", "Q6_K-canonical", "Q8_0-repack"])
def test_grouped_int8_gemm_gathers_q8_1_rows_as_x_rows(name, layout):
    """The grouped mode (moe.grouped_quant_gemm) on x's q8_1: each assignment's expert times its row's q8_1
    form (x_div 2: two experts a token, one expert left empty), within 1e-5."""
    from vegaserve.triton_kernels.layout import stack_experts
    from vegaserve.triton_kernels.matvec_launch import Experts
    from vegaserve.triton_kernels.moe import grouped_quant_gemm, reference_expert_matmul

    e, n, k = 5, 24, 512
    tid = TYPE_IDS[name]
    raw = random_blocks(tid, e * n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(23))
    w = stack_experts(raw.to(DEVICE), tid, e, n, k, layout)
    ids = [0, 3, 3, 1, 4, 0, 0, 0, 4, 1, 1, 3, 0, 4, 4, 4, 3, 0, 1, 3]  # expert 2 has none
    experts = Experts(torch.tensor(ids, device=DEVICE), 2)
    x = torch.randn(len(ids) // 2, k, generator=torch.Generator().manual_seed(24)).to(DEVICE)
    q8 = quantize_q8_1(x)
    q, d, _ = _cpu_q8_1(q8)
    x_q8 = (q.double().view(q.shape[0], -1, 32) * d.double()[..., None]).view(q.shape)
    y = grouped_quant_gemm(x, w, experts, block_n=16, int8=1, q8_1=q8)
    assert y.shape == (len(ids), n)
    assert rel_err(y, reference_expert_matmul(x_q8, _cpu(w), experts)) < 1e-5


def test_int8_gemm_refuses_types_without_codes_and_a_wrong_q8_1():
    w, gen = make("Q5_0", 37, 128, repack, 25)
    x = torch.randn(16, 128, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="no codes for Q5_0"):
        quant_gemm(x, w, block_m=16, block_n=16, int8=1)
    w, _ = make("Q4_K", 37, 256, repack, 25)
    x = torch.randn(16, 256, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="int8 \\[16, 256\\]"):
        quant_gemm(x, w, block_m=16, block_n=16, int8=1, q8_1=quantize_q8_1(x[:8]))
    with pytest.raises(ValueError, match="on float x"):
        quant_gemm(x, w, block_m=16, block_n=16, nb=8, int8=1, sub=1)
