"""The expert matmuls (triton_kernels/moe.py) against each assignment's expert dequantized by the torch
references (float64): the decode path (a decode mat-vec kernel with one program column per assignment) for
each kernel and the types it serves, and the grouped path (the assignments sorted by expert on the device,
a grouped GEMM over the dequantized stack), with experts left empty, one expert taking every assignment,
k = 1, and outputs poisoned (an assignment a kernel skipped stays NaN). Under the interpreter on a CPU."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import canonical, expert, repack, stack_experts, unpack_to_canonical
from vegaserve.triton_kernels.matvec import KERNELS, Choice
from vegaserve.triton_kernels.matvec_launch import Experts
from vegaserve.triton_kernels.moe import (
    expert_matmul,
    grouped_gemm,
    grouped_quant_gemm,
    reference_expert_matmul,
    sort_by_expert,
)
from vegaserve.triton_kernels.q8_1 import reference_quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IDS = {s.name: t for t, s in GGML_TYPES.items()}
E, N, K = 5, 24, 512

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _stack(name: str, seed: int, layout: bool = True):
    tid = IDS[name]
    raw = random_blocks(tid, E * N, K // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(seed))
    return stack_experts(raw.to(DEVICE), tid, E, N, K, layout)


def _q8_1_form(x: torch.Tensor) -> torch.Tensor:
    q, d, _ = reference_quantize_q8_1(x)
    return (q.double().view(x.shape[0], -1, 32) * d.double()[..., None]).view(x.shape)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


# (kernel, type, launch parameters): every kernel that serves one row, with split-K on
DECODE = [("pieces", "Q4_K", {"block_n": 8, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 0}),
          ("pieces", "Q6_K", {"block_n": 8, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1, "unpack": 1}),
          ("int8", "Q8_0", {"block_n": 16, "nb": 4, "split_k": 2, "num_warps": 1, "carry": 1}),
          ("int8", "MXFP4", {"block_n": 16, "nb": 4, "split_k": 1, "num_warps": 1, "carry": 0}),
          ("int8", "Q4_K", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1}),
          ("int8", "IQ4_XS", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1}),
          ("int8", "Q3_K", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 0}),
          ("int8", "IQ2_XXS", {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1, "carry": 1}),
          ("int8", "Q2_K", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1}),
          ("int8", "IQ3_XXS", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 0}),
          ("int8", "IQ3_S", {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1, "carry": 1}),
          ("int8", "IQ2_XS", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1}),
          ("int8", "IQ2_S", {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1, "carry": 0}),
          ("int8", "IQ1_S", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1, "carry": 1}),
          ("int8", "IQ1_M", {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1, "carry": 0}),
          ("tiles", "Q5_K", {"block_n": 16, "nb": 8, "split_k": 2, "num_warps": 1}),
          ("tiles", "BF16", {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1})]


@pytest.mark.parametrize("kernel, name, params", DECODE, ids=[f"{k}-{n}" for k, n, _ in DECODE])
def test_decode_path_gives_each_assignment_its_experts_product(kernel, name, params):
    w = _stack(name, 1)
    gen = torch.Generator().manual_seed(2)
    choice = Choice(KERNELS[kernel], params)
    # three tokens, two experts each (expert 2 unused, expert 3 twice), then down-style rows: one a row
    for x_div, rows in ((2, 3), (1, 6)):
        x = torch.randn(rows, K, generator=gen).to(DEVICE)
        experts = Experts(torch.tensor([0, 3, 3, 1, 4, 0], device=DEVICE), x_div)
        y = expert_matmul(x, w, experts, choice, grouped=False)
        assert y.shape == (6, N) and torch.isfinite(y).all()
        ref = reference_expert_matmul(_q8_1_form(x.cpu()) if choice.kernel.int8 else x.cpu(), w, experts)
        assert _rel(y, ref) < 1e-5, (kernel, name, x_div)


@pytest.mark.parametrize("ids", [[0, 3, 3, 1, 4, 0, 2, 0, 4, 1, 1, 3, 0, 4, 4, 4, 3, 0, 1, 3],  # expert 2 once
                                 [4] * 20,  # one expert takes every assignment
                                 [1, 1, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 1, 1, 1, 3, 3, 3, 1, 1]],  # three empty
                         ids=["spread", "one-expert", "empty-experts"])
@pytest.mark.parametrize("x_div", [2, 1], ids=["k2", "k1"])
def test_grouped_path_sorts_assignments_by_expert_and_writes_them_back_in_order(ids, x_div):
    w = _stack("Q4_K", 3)
    gen = torch.Generator().manual_seed(4)
    experts = Experts(torch.tensor(ids, device=DEVICE), x_div)
    x = torch.randn(len(ids) // x_div, K, generator=gen).to(DEVICE)
    y = grouped_gemm(x, w, experts, block_m=16, block_n=16, block_k=32)
    assert torch.isfinite(y).all()
    assert _rel(y, reference_expert_matmul(x.cpu(), w, experts)) < 1e-5


@pytest.mark.parametrize("ids", [[0, 3, 3, 1, 4, 0, 2, 0, 4, 1, 1, 3, 0, 4, 4, 4, 3, 0, 1, 3],  # expert 2 once
                                 [4] * 20,  # one expert takes every assignment
                                 [1, 1, 3, 3, 1, 3, 1, 1, 3, 1, 3, 3, 1, 1, 1, 3, 3, 3, 1, 1]],  # three empty
                         ids=["spread", "one-expert", "empty-experts"])
@pytest.mark.parametrize("name, layout", [("Q4_K", True), ("Q8_0", False), ("MXFP4", True)],
                         ids=["Q4_K-repack", "Q8_0-canonical", "MXFP4-repack"])
def test_grouped_quant_gemm_reads_each_experts_blocks_and_writes_rows_in_order(ids, name, layout):
    """The batched-decode grouped path: the quantized GEMM over each expert's run of assignments (x_div 2:
    two experts a token), 1e-5 with f32 operands; and through expert_matmul's `quant` switch."""
    w = _stack(name, 6, layout)
    gen = torch.Generator().manual_seed(7)
    experts = Experts(torch.tensor(ids, device=DEVICE), 2)
    x = torch.randn(len(ids) // 2, K, generator=gen).to(DEVICE)
    ref = reference_expert_matmul(x.cpu(), w, experts)
    y = grouped_quant_gemm(x, w, experts, block_n=16)
    assert y.shape == (len(ids), N)
    assert _rel(y, ref) < 1e-5
    choice = Choice(KERNELS["tiles"], {})
    scratch = torch.empty(E * N * K, dtype=torch.float32, device=DEVICE)
    assert _rel(expert_matmul(x, w, experts, choice, grouped=True, scratch=scratch, quant=True), ref) < 1e-5


def test_sorting_gives_each_expert_its_run_padded_to_whole_blocks():
    ids = torch.tensor([2, 0, 2, 2, 4, 0, 2], device=DEVICE)
    order, counts, starts, pstarts = sort_by_expert(ids, 5, 4)
    assert counts.tolist() == [2, 0, 4, 0, 1]
    assert starts.tolist() == [0, 2, 2, 6, 6]
    assert pstarts.tolist() == [0, 4, 4, 8, 8]
    assert ids[order].tolist() == [0, 0, 2, 2, 2, 2, 4]
    assert order.tolist() == [1, 5, 0, 2, 3, 6, 4]  # stable: each expert's assignments in their order


def test_a_stack_of_experts_keeps_each_experts_bytes_in_either_layout():
    tid = IDS["Q6_K"]
    raw = random_blocks(tid, E * N, K // 256, torch.Generator().manual_seed(5))
    for layout in (True, False):
        w = stack_experts(raw, tid, E, N, K, layout)
        for e in range(E):
            assert torch.equal(unpack_to_canonical(expert(w, e)), raw.view(E, N, -1)[e])
        assert w.expert_bytes == (repack if layout else canonical)(raw.view(E, N, -1)[0], tid, N, K).data.numel()


def test_expert_launches_refuse_a_plain_matrix_and_a_mismatched_count():
    w = _stack("Q8_0", 6)
    plain = repack(random_blocks(IDS["Q8_0"], N, K // 32, torch.Generator().manual_seed(7)).to(DEVICE),
                   IDS["Q8_0"], N, K)
    x = torch.randn(3, K).to(DEVICE)
    choice = Choice(KERNELS["int8"], {"block_n": 16, "nb": 4, "split_k": 1, "num_warps": 1, "carry": 1})
    with pytest.raises(ValueError, match="not a stack"):
        expert_matmul(x, plain, Experts(torch.zeros(6, dtype=torch.int64, device=DEVICE), 2), choice, False)
    with pytest.raises(ValueError, match="assignments"):
        expert_matmul(x, w, Experts(torch.zeros(5, dtype=torch.int64, device=DEVICE), 2), choice, False)
    lanes = Choice(KERNELS["lanes"], {"block_n": 16, "nb": 4, "split_k": 1, "num_warps": 1, "carry": 1})
    with pytest.raises(ValueError, match="assignment is one"):
        expert_matmul(x, w, Experts(torch.zeros(6, dtype=torch.int64, device=DEVICE), 2), lanes, False)


@pytest.mark.parametrize("rows", [8, 10], ids=["even-windows", "short-last-window"])
def test_grouped_path_through_a_scratch_smaller_than_the_stack_goes_a_window_of_rows_at_a_time(rows):
    """A scratch that holds `rows` of every expert's 24: the stack dequantized and multiplied a window at a
    time gives the one-window product exactly (each output is the same sum), every column written."""
    w = _stack("Q4_K", 5)
    gen = torch.Generator().manual_seed(6)
    experts = Experts(torch.tensor([0, 3, 3, 1, 4, 0, 2, 0, 4, 1, 1, 3], device=DEVICE), 2)
    x = torch.randn(6, K, generator=gen).to(DEVICE)
    whole = grouped_gemm(x, w, experts, block_m=16, block_n=16, block_k=32)
    scratch = torch.empty(E * rows * K, device=DEVICE)
    y = grouped_gemm(x, w, experts, block_m=16, block_n=16, block_k=32, scratch=scratch)
    assert torch.equal(y, whole)
    assert _rel(y, reference_expert_matmul(x.cpu(), w, experts)) < 1e-5


@pytest.mark.parametrize("layout", [True, False], ids=["repack", "canonical"])
def test_a_stack_holds_each_expert_as_that_expert_laid_out_alone(layout):
    """stack_experts lays the experts out one at a time into one buffer: expert e of the stack is byte for
    byte expert e's rows repacked (or wrapped) on their own, wherever the raw stack was."""
    tid = IDS["Q4_K"]
    raw = random_blocks(tid, E * N, K // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(7))
    w = stack_experts(raw, tid, E, N, K, layout, DEVICE)
    build = repack if layout else canonical
    for e in range(E):
        alone = build(raw.view(E, N, -1)[e].to(DEVICE), tid, N, K)
        assert torch.equal(expert(w, e).data, alone.data) and expert(w, e).fields == alone.fields
