"""The K-quant (Q4_K, Q5_K, Q6_K) and MXFP4 tiles through the tile mat-vec and the prefill path (the tiles
dequantized into a dense copy, then the matmul), against dequant(W) @ x of the torch references in float64.

Each type x both layouts x {mat-vec at 1, 3 and 8 rows, the dense copy bit for bit, prefill with f32 and
fp16 operands};
N = 37 so the last row tile is partial; K of one and two super-blocks (K-quants) or three blocks (MXFP4).
Outputs are poisoned: torch.empty, which the launchers allocate with, fills with NaN here, so an element the
kernel never wrote fails the finiteness check. Runs under TRITON_INTERPRET=1 without a GPU (no bf16 there:
numpy lacks the type), natively on a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize  # noqa: E402
from vegaserve.triton_kernels.layout import canonical, repack, unpack_to_canonical  # noqa: E402
from vegaserve.triton_kernels.matmul import (  # noqa: E402
    SUPPORTED,
    dense_gemm,
    dequantize_dense,
    reference_matmul,
    tile_matvec,
)
from vegaserve.triton_kernels.quants.random_blocks import random_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
N = 37
CASES = [("Q4_K", 256), ("Q4_K", 512), ("Q5_K", 256), ("Q5_K", 512), ("Q6_K", 256), ("Q6_K", 512), ("MXFP4", 96)]
LAYOUTS = pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])


pytestmark = pytest.mark.usefixtures("poisoned_empty")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has non-finite values (unwritten or broken)"
    return float((y.double() - ref).norm() / ref.norm())


def make(type_name: str, k: int, layout, seed: int):
    tid = TYPE_IDS[type_name]
    raw = random_blocks(tid, N, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(seed))
    return layout(raw.to(DEVICE), tid, N, k), torch.Generator().manual_seed(seed + 1)


@LAYOUTS
@pytest.mark.parametrize("type_name,k", CASES)
def test_tile_matvec_matches_reference(type_name, k, layout):
    w, gen = make(type_name, k, layout, 10 + k)
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        assert rel_err(tile_matvec(x, w, block_n=16), reference_matmul(x, w)) < 1e-5


@LAYOUTS
@pytest.mark.parametrize("type_name,k", CASES)
def test_prefill_dequantizes_exactly_and_matches_reference_f32_and_fp16_operands(type_name, k, layout):
    w, gen = make(type_name, k, layout, 20 + k)
    n = w.n
    assert torch.equal(dequantize_dense(w, dtype=torch.float32, block_n=16).cpu(),
                       dequantize(unpack_to_canonical(w).reshape(-1).cpu(), w.type_id, (n, k)))
    x = torch.randn(17, k, generator=gen).to(DEVICE)
    ref = reference_matmul(x, w)
    assert rel_err(dense_gemm(x, w), ref) < 1e-5
    assert rel_err(dense_gemm(x.half(), w).float(), ref) < 3e-3


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_two_super_blocks_per_tile_match_the_reference_too(type_name):
    """nb counts 32-element units: nb=16 gives NB=2, a [BLOCK_N, 512] tile (the default is one super-block)."""
    w, gen = make(type_name, 512, repack, 30)
    x = torch.randn(17, 512, generator=gen).to(DEVICE)
    ref = reference_matmul(x, w)
    assert rel_err(tile_matvec(x[:2], w, block_n=16, nb=16), ref[:2]) < 1e-5
    assert rel_err(x @ dequantize_dense(w, dtype=torch.float32, block_n=16, nb=16).T, ref) < 1e-5


def test_mxfp4_extreme_exponents_dequantize_exactly():
    """e = 0 and 1 give subnormal half-scales; every product is exact, so W^T = I @ W^T equals the reference."""
    tid = TYPE_IDS["MXFP4"]
    raw = random_blocks(tid, 5, 8, torch.Generator().manual_seed(40))
    raw.view(5, 8, 17)[:, :, 0] = torch.tensor([0, 1, 2, 3, 100, 127, 130, 140], dtype=torch.uint8)
    w = canonical(raw.to(DEVICE), tid, 5, 256)
    y = dequantize_dense(w, dtype=torch.float32, block_n=16, nb=8)
    assert torch.equal(y.cpu(), dequantize(raw, tid, (5, 256)))


def test_kquants_and_mxfp4_have_kernels():
    assert {TYPE_IDS[n] for n in ("Q4_K", "Q5_K", "Q6_K", "MXFP4")} <= SUPPORTED
