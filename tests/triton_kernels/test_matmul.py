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


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_prefill_through_a_scratch_smaller_than_the_matrix_goes_a_window_of_rows_at_a_time(type_name):
    """dense_gemm with room for 16 of 37 rows: three windows (16, 16, 5), the product equal to the whole
    matrix's column for column; a window of dequantize_dense is those rows of the whole, bit for bit."""
    from vegaserve.triton_kernels.matmul import dense_gemm, dequantize_dense

    k = 256
    w, gen = make(type_name, 37, k, repack, 3)
    whole = dequantize_dense(w, dtype=torch.float32, block_n=16)
    assert torch.equal(dequantize_dense(w, dtype=torch.float32, block_n=16, rows=(16, 21)), whole[16:])
    x = torch.randn(17, k, generator=gen).to(DEVICE)
    y = dense_gemm(x, w, torch.empty(16 * k, device=DEVICE))
    assert torch.isfinite(y).all() and rel_err(y, x @ whole.T) < 1e-6


def test_row_windows_fit_the_room_in_whole_tiles_and_cover_every_row():
    from vegaserve.triton_kernels.matmul import row_windows

    assert row_windows(5760, 2880, None, 128) == [(0, 5760)]
    assert row_windows(5760, 2880, 128 * 5760 * 2880, 128) == [(0, 5760)]  # room for all: one window
    windows = row_windows(5760, 2880, 2**29, 128)  # 1 GiB of bf16: 1456 rows, 1280 in whole tiles of 256
    assert windows == [(0, 1280), (1280, 1280), (2560, 1280), (3840, 1280), (5120, 640)]
    assert row_windows(37, 256, 16 * 256) == [(0, 16), (16, 16), (32, 5)]  # under 256 rows: as many as fit
    with pytest.raises(ValueError, match="holds no row"):
        row_windows(37, 256, 255)


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


# The quantized GEMM (9 rows up to the tuning file's dense_from_m): the types the issue names, every
# legacy-block type, a float type, and one each of the low-bit K-quants, IQ4_XS and the lattice types.
GEMM_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "F16", "BF16",
              "Q2_K", "Q3_K", "IQ4_XS", "IQ3_S"]


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])
@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_quant_gemm_matches_reference_at_16_64_and_200_rows(type_name, layout):
    """f32 operands with IEEE products (1e-5) at 16 rows in two K splits, 64 rows in one block of 64 and
    200 rows over four blocks, the last partial; fp16 operands at 64 rows (3e-3). N = 37: a partial weight
    block; outputs from poisoned memory, so an unwritten element fails."""
    from vegaserve.triton_kernels.gemm import quant_gemm

    qk = GGML_TYPES[TYPE_IDS[type_name]].block_size
    k = 512 if qk == 256 else 128
    w, gen = make(type_name, 37, k, layout, 7)
    for m, block_m, split_k in ((16, 16, 2), (64, 64, 1), (200, 64, 1)):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        y = quant_gemm(x, w, block_m=block_m, block_n=16, nb=8 if qk == 256 else 2, split_k=split_k)
        assert y.shape == (m, 37)
        assert rel_err(y, reference_matmul(x.cpu(), _cpu(w))) < 1e-5, (m, split_k)
    x = torch.randn(64, k, generator=gen).to(DEVICE)
    y = quant_gemm(x.half(), w, block_m=32, block_n=16)
    assert rel_err(y, reference_matmul(x.half().float().cpu(), _cpu(w))) < 3e-3


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])
def test_quant_gemm_q4_k_product_a_sub_block_matches_reference(layout):
    """Q4_K with a product a sub-block (sub 1): f32 operands with IEEE products (1e-5) at 16 rows in two K
    splits, 64 rows, 200 rows over four blocks; fp16 at 64 rows (3e-3); N = 37 (a partial weight block), three
    super-blocks a row (an odd split), outputs from poisoned memory."""
    from vegaserve.triton_kernels.gemm import quant_gemm

    w, gen = make("Q4_K", 37, 768, layout, 11)
    for m, block_m, split_k in ((16, 16, 2), (64, 64, 1), (200, 64, 1)):
        x = torch.randn(m, 768, generator=gen).to(DEVICE)
        y = quant_gemm(x, w, block_m=block_m, block_n=16, nb=8, split_k=split_k, sub=1)
        assert y.shape == (m, 37)
        assert rel_err(y, reference_matmul(x.cpu(), _cpu(w))) < 1e-5, (m, split_k)
    x = torch.randn(64, 768, generator=gen).to(DEVICE)
    y = quant_gemm(x.half(), w, block_m=64, block_n=16, sub=1)
    assert rel_err(y, reference_matmul(x.half().float().cpu(), _cpu(w))) < 3e-3
    with pytest.raises(ValueError, match="Q4_K's with tiles of one super-block"):
        quant_gemm(x, make("Q6_K", 37, 768, layout, 11)[0], sub=1)


def test_quant_gemm_refuses_blocks_below_the_matrix_units_size():
    from vegaserve.triton_kernels.gemm import quant_gemm

    w, _ = make("Q8_0", 37, 96, repack, 8)
    with pytest.raises(ValueError, match="at least 16 rows"):
        quant_gemm(torch.randn(20, 96).to(DEVICE), w, block_m=8)
    with pytest.raises(ValueError, match="x \\[M, 96\\]"):
        quant_gemm(torch.randn(20, 64).to(DEVICE), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 operands need a GPU (the interpreter has no bf16)")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4", "IQ4_NL", "BF16"])
def test_quant_gemm_bf16_operands_on_gpu(type_name):
    """x and the dequantized tile rounded to bf16 (about 2^-9 relative each): 5e-3, at the block sizes a
    tuning entry uses (64 x 64, two K splits)."""
    from vegaserve.triton_kernels.gemm import quant_gemm

    w, gen = make(type_name, 200, 1024, repack, 9)
    x = torch.randn(100, 1024, generator=gen).to(DEVICE)
    y = quant_gemm(x.bfloat16(), w, block_m=64, block_n=64, split_k=2)
    assert rel_err(y, reference_matmul(x.bfloat16().float().cpu(), _cpu(w))) < 5e-3
