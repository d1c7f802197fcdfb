"""The tiles of the low-bit super-block types (Q2_K, Q3_K, IQ4_XS and the lattice types IQ3_XXS, IQ3_S,
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) through the tile mat-vec (the decode mat-vec's `tiles` kernel) and the
prefill path (the tiles dequantized into a dense copy, then the matmul), against dequant(W) @ x of the torch
references in float64.

Each type x both layouts x {mat-vec at 1, 3 and 8 rows within 1e-5, the dense copy bit for bit in f32,
prefill with f32 and fp16 operands}; N = 37 so the last row tile is partial; K of two super-blocks, tiled one
and two at a time. Outputs are poisoned (torch.empty fills with NaN here), so an element the kernel never
wrote fails the finiteness check. Runs under TRITON_INTERPRET=1 without a GPU, natively on a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize  # noqa: E402
from vegaserve.triton_kernels.layout import FIELDS, canonical, repack, unpack_to_canonical  # noqa: E402
from vegaserve.triton_kernels.matmul import (  # noqa: E402
    SUPPORTED,
    dense_gemm,
    dequantize_dense,
    reference_matmul,
    tile_matvec,
)
from vegaserve.triton_kernels.matvec import KERNELS, choose  # noqa: E402
from vegaserve.triton_kernels.quants.random_blocks import random_blocks  # noqa: E402
from vegaserve.triton_kernels.tuning import load_tuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
TYPES = ["Q2_K", "Q3_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
N, K = 37, 512
LAYOUTS = pytest.mark.parametrize("layout", [repack, canonical], ids=["repack", "canonical"])

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "output has non-finite values (unwritten or broken)"
    return float((y.double().cpu() - ref.cpu()).norm() / ref.norm())


def make(type_name: str, layout, seed: int):
    tid = TYPE_IDS[type_name]
    raw = random_blocks(tid, N, K // 256, torch.Generator().manual_seed(seed))
    return layout(raw.to(DEVICE), tid, N, K), raw, torch.Generator().manual_seed(seed + 1)


@LAYOUTS
@pytest.mark.parametrize("type_name", TYPES)
def test_tile_matvec_matches_reference(type_name, layout):
    w, raw, gen = make(type_name, layout, 10)
    ref_w = canonical(raw, w.type_id, N, K)
    for m, nb in ((1, 8), (3, 16), (8, 8)):  # nb 8: a super-block a tile; 16: two
        x = torch.randn(m, K, generator=gen)
        assert rel_err(tile_matvec(x.to(DEVICE), w, block_n=16, nb=nb), reference_matmul(x, ref_w)) < 1e-5


@LAYOUTS
@pytest.mark.parametrize("type_name", TYPES)
def test_prefill_dequantizes_exactly_and_matches_reference_f32_and_fp16_operands(type_name, layout):
    w, raw, gen = make(type_name, layout, 20)
    expected = dequantize(raw.reshape(-1), w.type_id, (N, K))
    assert torch.equal(dequantize_dense(w, dtype=torch.float32, block_n=16).cpu(), expected)
    x = torch.randn(9, K, generator=gen)
    ref = reference_matmul(x, canonical(raw, w.type_id, N, K))
    assert rel_err(dense_gemm(x.to(DEVICE), w), ref) < 1e-5
    assert rel_err(dense_gemm(x.half().to(DEVICE), w).float(), ref) < 3e-3


@pytest.mark.parametrize("type_name", TYPES)
def test_repack_round_trips_with_aligned_planes_within_one_percent(type_name):
    tid = TYPE_IDS[type_name]
    spec = GGML_TYPES[tid]
    assert sum(size for _, _, size in FIELDS[type_name]) == spec.type_size  # the fields tile the block
    raw = random_blocks(tid, 64, 16, torch.Generator().manual_seed(6))
    w = repack(raw, tid, 64, 4096)
    assert torch.equal(unpack_to_canonical(w), raw)
    assert w.data.numel() <= raw.numel() * 1.01
    planes = {f.offset - f.offset % 16 for f in w.fields}  # a head record's later fields sit inside its plane
    assert all(p % 16 == 0 for p in planes) and all(f.row_stride % 16 == 0 for f in w.fields)


def test_every_new_type_is_served_by_the_tiles_kernel():
    ids = {TYPE_IDS[n] for n in TYPES}
    assert ids <= SUPPORTED and ids <= KERNELS["tiles"].types


@pytest.mark.parametrize("target", ["cuda_sm90", "hip_gfx906", "cpu"])
def test_the_tuning_files_give_the_new_types_the_tiles_kernel_but_where_the_sm90_file_names_int8(target):
    """The sm_90 file names the int8 kernel for every new type in the repacked layout (the only one it
    reads); the canonical layout and the other targets take the backend's fallback, the tiles kernel, at
    every row count."""
    tuning = load_tuning(target)
    int8 = set(TYPES) if target == "cuda_sm90" else set()
    for name in TYPES:
        tid = TYPE_IDS[name]
        raw = torch.zeros(N, 16 * GGML_TYPES[tid].type_size, dtype=torch.uint8)
        for layout in (repack, canonical):
            w = layout(raw, tid, N, 16 * 256)
            want = "int8" if name in int8 and layout is repack else "tiles"
            assert {choose(w, m, tuning).kernel.name for m in range(1, 9)} == {want}, (target, name, layout)


LLAMA_QUANTIZE = Path(__file__).resolve().parents[1] / "data" / "llama_quantize" / "blocks.gguf"


@LAYOUTS
def test_blocks_written_by_llama_quantize_dequantize_exactly_in_the_tiles(layout):
    """Real blocks of each type (tests/data/llama_quantize): the prefill path's dense copy equals the
    reference bit for bit, and the mat-vec at one row matches it."""
    for tensor in gguf.GGUFReader(LLAMA_QUANTIZE).tensors:
        tid, n, k = int(tensor.tensor_type), int(tensor.shape[1]), int(tensor.shape[0])
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8))
        w = layout(raw.to(DEVICE), tid, n, k)
        expected = dequantize(raw.reshape(-1), tid, (n, k))
        assert torch.equal(dequantize_dense(w, dtype=torch.float32, block_n=16).cpu(), expected), tensor.name
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(tid))
        assert rel_err(tile_matvec(x.to(DEVICE), w, block_n=16, nb=8), x.double() @ expected.double().T) < 1e-5


def test_blocks_written_by_llama_quantize_through_the_int8_kernels():
    """The same real blocks through the int8 mat-vec of each new type it serves (repacked), at 1 and 3 rows:
    the reference's product on the q8_1 activation (what the kernel multiplies), within 1e-5."""
    from vegaserve.triton_kernels.matvec_int8 import TYPES as INT8, matvec_int8, reference_matvec_q8_1
    from vegaserve.triton_kernels.q8_1 import quantize_q8_1

    seen = set()
    for tensor in gguf.GGUFReader(LLAMA_QUANTIZE).tensors:
        tid, n, k = int(tensor.tensor_type), int(tensor.shape[1]), int(tensor.shape[0])
        if tid not in INT8:
            continue
        seen.add(GGML_TYPES[tid].name)
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8))
        w, ref_w = repack(raw.to(DEVICE), tid, n, k), repack(raw, tid, n, k)
        for m in (1, 3):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(tid + m)).to(DEVICE)
            q, d, s = quantize_q8_1(x)
            y = matvec_int8(x, w, {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1}, q8_1=(q, d, s))
            assert rel_err(y, reference_matvec_q8_1(q.cpu(), d.cpu(), ref_w)) < 1e-5, (tensor.name, m)
    assert seen == set(TYPES)
