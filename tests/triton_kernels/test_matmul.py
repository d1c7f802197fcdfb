"""The tile kernels of triton_kernels/matmul.py (tile_matvec, the decode mat-vec's `tiles` kernel, and the
prefill path's dequantizer) against dequant(W) @ x of the torch references (float64).

Every type the kernels serve x both layouts x {mat-vec at 1, 3 and 8 rows, the dense copy bit for bit,
prefill with f32 and fp16 operands}; odd N so the last row tile is partial. Runs under TRITON_INTERPRET=1 on a CPU (tests/
conftest.py) and natively where a GPU exists. bf16 operands only on a GPU: Triton's CPU interpreter has no
bf16 (numpy lacks the type).
"""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import canonical, repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import SUPPORTED, reference_matmul, tile_matvec
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "F16", "BF16", "F32"]
TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has non-finite values (unwritten or broken)"
    return float((y.double().cpu() - ref.cpu()).norm() / ref.norm())


def make(type_name: str, n: int, k: int, layout, seed: int):
    tid = TYPE_IDS[type_name]
    gen = torch.Generator().manual_seed(seed)
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, gen).to(DEVICE)
    return layout(raw, tid, n, k), torch.Generator().manual_seed(seed + 1)


@pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])
@pytest.mark.parametrize("type_name", LEGACY)
def test_tile_matvec_matches_reference(type_name, layout):
    w, gen = make(type_name, 37, 96, layout, 1)
    for m in (1, 3, 8):
        x = torch.randn(m, 96, generator=gen).to(DEVICE)
        assert rel_err(tile_matvec(x, w, block_n=16, nb=1), reference_matmul(x.cpu(), _cpu(w))) < 1e-5


@pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])
@pytest.mark.parametrize("type_name", LEGACY)
def test_prefill_dequantizes_exactly_and_matches_reference_f32_and_fp16_operands(type_name, layout):
    """The prefill path (dense_gemm): the tiles dequantized into a scratch copy equal the reference
    dequantizer bit for bit in f32, and the product matches the reference with f32 and fp16 operands."""
    from vegaserve.triton_kernels.dequant import dequantize
    from vegaserve.triton_kernels.matmul import dense_gemm, dequantize_dense

    w, gen = make(type_name, 37, 96, layout, 2)
    ref_w = dequantize(unpack_to_canonical(_cpu(w)).reshape(-1), w.type_id, (37, 96))
    assert torch.equal(dequantize_dense(w, dtype=torch.float32, block_n=16, nb=1).cpu(), ref_w)
    x = torch.randn(17, 96, generator=gen).to(DEVICE)
    ref = reference_matmul(x.cpu(), _cpu(w))
    assert rel_err(dense_gemm(x, w), ref) < 1e-5
    assert rel_err(dense_gemm(x.half(), w).float(), ref) < 3e-3


def test_split_k_tile_matvec_with_a_shorter_last_split_matches_the_reference():
    """10 blocks in splits of 4: the last split holds 2, its partials summed with the others."""
    w, gen = make("Q4_0", 40, 320, repack, 3)
    x = torch.randn(2, 320, generator=gen).to(DEVICE)
    ref = reference_matmul(x.cpu(), _cpu(w))
    assert rel_err(tile_matvec(x, w, block_n=16, nb=1, split_k=3), ref) < 1e-5


def test_repack_round_trips_and_keeps_size_within_one_percent():
    for name in LEGACY:
        tid = TYPE_IDS[name]
        gen = torch.Generator().manual_seed(4)
        n, k = 64, 4096
        raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, gen)
        w = repack(raw, tid, n, k)
        assert torch.equal(unpack_to_canonical(w), raw)
        assert w.data.numel() <= raw.numel() * 1.01
        for f in w.fields:
            assert f.offset % 16 == 0 and f.row_stride % 16 == 0


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_repack_round_trips_with_one_head_record_per_super_block(type_name):
    """Q4_K and Q5_K keep d, dmin and the 12 scale bytes together, one 16-byte record per super-block in one
    plane (the pieces kernel loads it as four words); every plane starts 16-byte aligned, the bytes round
    trip, and the size stays within 1% of the GGUF rows."""
    tid = TYPE_IDS[type_name]
    raw = random_blocks(tid, 64, 16, torch.Generator().manual_seed(6))
    w = repack(raw, tid, 64, 4096)
    assert torch.equal(unpack_to_canonical(w), raw.view(64, -1))
    assert w.data.numel() <= raw.numel() * 1.01
    head = type_name != "Q6_K"
    starts = [f for i, f in enumerate(w.fields) if not (head and i == 1)]  # a plane's first field each
    assert all(f.offset % 16 == 0 and f.row_stride % 16 == 0 for f in starts)
    if head:
        dm, scales = w.fields[:2]
        assert (dm.block_stride, scales.block_stride, scales.offset - dm.offset) == (16, 16, 4)
        assert dm.row_stride == scales.row_stride == 16 * 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 operands need a GPU (the interpreter has no bf16)")
@pytest.mark.parametrize("type_name", LEGACY)
def test_prefill_bf16_operands_on_gpu(type_name):
    """bf16 keeps 8 significant bits: x, the dense copy of W and the output are each rounded (about 2^-9
    relative each), so the product is checked to 5e-3."""
    from vegaserve.triton_kernels.matmul import dense_gemm

    w, gen = make(type_name, 37, 96, repack, 5)
    x = torch.randn(17, 96, generator=gen).to(DEVICE)
    assert rel_err(dense_gemm(x.bfloat16(), w).float(), reference_matmul(x.cpu(), _cpu(w))) < 5e-3


def test_every_served_legacy_type_has_a_kernel():
    assert {TYPE_IDS[n] for n in LEGACY} <= SUPPORTED


def _cpu(w):
    """The same weight with its buffer on the CPU (the reference dequantizes there)."""
    from dataclasses import replace

    return replace(w, data=w.data.cpu())


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "IQ4_NL", "F16"])
def test_dequantize_dense_equals_reference_dequantizer(type_name):
    from vegaserve.triton_kernels.dequant import dequantize
    from vegaserve.triton_kernels.matmul import dense_gemm, dequantize_dense

    w, gen = make(type_name, 37, 96, repack, 6)
    ref = dequantize(unpack_to_canonical(_cpu(w)).reshape(-1), w.type_id, (37, 96))
    dense = dequantize_dense(w, dtype=torch.float32, block_n=16, nb=1)
    assert torch.equal(dense.cpu(), ref)
    x = torch.randn(5, 96, generator=gen).to(DEVICE)
    assert rel_err(dense_gemm(x, w), reference_matmul(x.cpu(), _cpu(w))) < 1e-5
