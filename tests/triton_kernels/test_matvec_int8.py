"""The `int8` decode mat-vec (triton_kernels/matvec_int8.py) and the q8_1 quantizer it reads (q8_1.py): the
quantizer against gguf's Q8_0 quantizer, and each type's product against the reference on the same
quantized activation (float64), with 1, 3 and 8 rows, odd N, tiles loaded ahead or not, split-K on and off
(the last program of a row tile sums the partials), outputs poisoned with NaN. Under the interpreter dot4
is its integer emulation; on a GPU the same test runs the dp4a (or v_dot4) instruction."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vegaserve.triton_kernels import matvec_int8 as mv
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.dequant import GGMLType as T
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matmul import reference_matmul
from vegaserve.triton_kernels.matvec_int8 import TYPES, candidates, kernel_for, matvec_int8, reference_matvec_q8_1
from vegaserve.triton_kernels.matvec_launch import arrival_counts
from vegaserve.triton_kernels.matvec_launch import candidates as launch_candidates
from vegaserve.triton_kernels.q8_1 import quantize_q8_1, reference_quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = {t: s.name for t, s in GGML_TYPES.items()}
IDS = {s.name: t for t, s in GGML_TYPES.items()}
BLOCK_TYPES = ["Q8_0", "Q4_0", "IQ4_NL", "MXFP4"]  # one scale a block of 32: _legacy_kernel


pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.mark.parametrize("quantize", [quantize_q8_1, reference_quantize_q8_1], ids=["kernel", "torch"])
def test_q8_1_quantizer_equals_gguf_q8_0_element_for_element(quantize):
    """The kernel and its torch reference (which the int8 kernels' references quantize with) both give
    gguf's Q8_0 codes and scales."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen) * torch.rand(3, 256, generator=gen) * 4
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, quants 0
    x[2, :32] = torch.arange(32) - 15.5  # halves after scaling by 127 / 15.5: ties round away from zero
    x[2, 32:64] = torch.tensor([127.0] + [v + 0.5 for v in range(-16, 15)])  # d = 1: x itself rounded
    q, d, s = quantize(x.to(DEVICE))
    ref = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(3, 8, 34)
    ref_d = ref[..., :2].copy().view(np.float16)[..., 0]
    ref_q = ref[..., 2:].copy().view(np.int8).reshape(3, 256)
    assert np.array_equal(q.cpu().numpy(), ref_q)
    assert np.array_equal(d.cpu().half().numpy(), ref_d)
    assert torch.allclose(s.cpu(), d.cpu() * q.cpu().view(3, 8, 32).sum(-1).float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", sorted(NAMES[t] for t in TYPES))
@pytest.mark.parametrize("split_k, carry", [(1, 1), (2, 1), (2, 0)])
def test_int8_matvec_matches_reference_on_the_quantized_activation(name, split_k, carry):
    tid = IDS[name]
    qk = GGML_TYPES[tid].block_size
    k = 4 * max(qk, 64)
    raw = random_blocks(tid, 37, k // qk, torch.Generator().manual_seed(5))
    w, ref_w = repack(raw.to(DEVICE), tid, 37, k), repack(raw, tid, 37, k)
    gen = torch.Generator().manual_seed(6)
    params = {"block_n": 16, "nb": 2 if qk == 32 else 8, "split_k": split_k, "num_warps": 1, "carry": carry}
    for m in (1, 8) if split_k == 1 else (1, 3):  # one row, a full tile of rows, a tile with pad rows masked
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        q, d, s = quantize_q8_1(x)
        y = matvec_int8(x, w, params, q8_1=(q, d, s))
        assert torch.isfinite(y).all()
        ref = reference_matvec_q8_1(q.cpu(), d.cpu(), ref_w)
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5
        # and against the unquantized activation: the q8_1 rounding only (about 1/127 per element)
        exact = reference_matmul(x.cpu(), ref_w)
        assert float((y.double().cpu() - exact).norm() / exact.norm()) < 2e-2
    # the split programs' arrival counts are back at zero for the next launch (the calls above relied on it)
    assert not arrival_counts(torch.device(DEVICE), 1).any()


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("nb, split_k, carry", [(16, 1, 1), (4, 1, 0), (16, 2, 1), (4, 3, 1)])
def test_a_tile_that_does_not_divide_the_row_ends_in_a_masked_partial_tile(name, nb, split_k, carry):
    """Rows of 18 blocks (576, SmolLM2's width; gpt-oss's 2880 is 90) in tiles of 16 or 4: the last split's
    whole tiles, then a partial one of 2 blocks (with 3 splits of 4-block tiles, splits of 8, 8 and 2: the
    last has no whole tile). The weight's bytes end at the last row, so a load past the row's end in the last
    row would leave the tensor; experts too (each stack's last expert ends where the buffer does). 1 and 3
    rows (Q8_0's loads per block above one row), poisoned outputs, against the reference on the q8_1 form."""
    from vegaserve.triton_kernels.layout import stack_experts
    from vegaserve.triton_kernels.matvec_launch import Experts, tile_split
    from vegaserve.triton_kernels.moe import reference_expert_matmul

    tid, n, k = IDS[name], 21, 576
    assert tile_split(tid, k, nb, split_k, ragged=True)[0] == nb and 18 % nb  # the tile leaves a part
    gen = torch.Generator().manual_seed(12)
    raw = random_blocks(tid, n, k // 32, gen)
    w, ref_w = repack(raw.to(DEVICE), tid, n, k), repack(raw, tid, n, k)
    params = {"block_n": 16, "nb": nb, "split_k": split_k, "num_warps": 1, "carry": carry}
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        q, d, s = quantize_q8_1(x)
        y = matvec_int8(x, w, params, q8_1=(q, d, s))
        ref = reference_matvec_q8_1(q.cpu(), d.cpu(), ref_w)
        assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, m
    e = 3
    stack_raw = random_blocks(tid, e * n, k // 32, gen)
    stack = stack_experts(stack_raw.view(e, n, -1).to(DEVICE), tid, e, n, k)
    ref_stack = stack_experts(stack_raw.view(e, n, -1), tid, e, n, k)
    ids = torch.tensor([2, 0, 2, 1], dtype=torch.int64)
    x = torch.randn(2, k, generator=gen).to(DEVICE)
    q, d, s = quantize_q8_1(x)
    y = matvec_int8(x, stack, params, q8_1=(q, d, s), experts=Experts(ids.to(DEVICE), 2))
    xq = (q.cpu().double().view(2, -1, 32) * d.cpu().double()[..., None]).view(2, k)
    ref = reference_expert_matmul(xq, ref_stack, Experts(ids, 2))
    assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5


def test_flat_loads_are_the_rule_at_one_row_and_for_every_type_but_q8_0():
    """The 32-element types load each row's quant words of a tile as one run (FLAT 1), except Q8_0 above one
    row, where the [rows, blocks, 4] load measured faster; the K-quants' kernels have no such constexpr."""
    for name in BLOCK_TYPES:
        for m in (1, 2, 8):
            fn, args = kernel_for(IDS[name], m)
            assert fn is mv._legacy_kernel
            assert args["FLAT"] == int(m == 1 or name != "Q8_0"), (name, m)
    assert kernel_for(T.Q4_K, 1) == (mv._q4_k_kernel, {})
    assert kernel_for(T.Q6_K, 8) == (mv._q6_k_kernel, {})


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_flat_and_per_block_quant_loads_give_the_same_sums(name, monkeypatch):
    """FLAT 1 loads each row's quant words of a tile as one run and reshapes it to the blocks (Q8_0: and
    splits the halves); FLAT 0 loads [rows, blocks, 4] (the rule's for Q8_0 above one row). Both forms
    must give the reference's products at 1 and 8 rows (bitwise the same under the interpreter; on a GPU
    the lanes differ, and with them the order of the final row sums)."""
    tid = IDS[name]
    raw = random_blocks(tid, 24, 32, torch.Generator().manual_seed(12))
    w, ref_w = repack(raw.to(DEVICE), tid, 24, 1024), repack(raw, tid, 24, 1024)
    gen = torch.Generator().manual_seed(13)
    rule = mv.kernel_for
    for m, nb, split_k, carry in ((1, 8, 2, 1), (8, 16, 1, 0)):
        x = torch.randn(m, 1024, generator=gen).to(DEVICE)
        q8 = quantize_q8_1(x)
        params = {"block_n": 8, "nb": nb, "split_k": split_k, "num_warps": 1, "carry": carry}
        outs = {}
        for flat in (1, 0):
            monkeypatch.setattr(mv, "kernel_for", lambda t, m_, f=flat: (rule(t, m_)[0], {**rule(t, m_)[1], "FLAT": f}))
            outs[flat] = matvec_int8(x, w, params, q8_1=q8)
        ref = reference_matvec_q8_1(q8[0].cpu(), q8[1].cpu(), ref_w)
        for y in outs.values():
            assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5
        if mv.dot_kind(x.device) == 0:
            assert torch.equal(outs[1], outs[0])


def test_int8_matvec_refuses_a_type_it_has_no_kernel_for():
    tid = IDS["Q5_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(2)), tid, 16, 256)
    with pytest.raises(ValueError, match="no kernel for Q5_K"):
        matvec_int8(torch.randn(1, 256), w, {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1})


def _tile(params: dict) -> tuple:
    return tuple(sorted((key, v) for key, v in params.items() if key != "carry"))


@pytest.mark.parametrize("name", sorted(NAMES[t] for t in TYPES))
def test_int8_sweep_times_each_tile_loaded_ahead_and_in_its_own_iteration(name):
    """candidates: the launch rule's tile candidates (matvec_launch), each with carry 1 and carry 0, no
    config twice; each a launch the launcher takes (block_n a power of two from 8)."""
    tid = IDS[name]
    for m in (1, 8):
        cands = candidates(tid, 28672, 4096, m, 132)
        keys = [tuple(sorted(c.items())) for c in cands]
        assert len(set(keys)) == len(keys)
        launches = {(_tile(c), c["carry"]) for c in cands}
        assert launches == {(tile, carry) for tile, _ in launches for carry in (0, 1)}
        assert {tile for tile, _ in launches} == {_tile(c) for c in launch_candidates(tid, 28672, 4096, m, 132)}
        assert all(c["block_n"] >= 8 and c["block_n"] & (c["block_n"] - 1) == 0 for c in cands)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a GPU")
@pytest.mark.parametrize("name", sorted(NAMES[t] for t in TYPES))
@pytest.mark.parametrize("pdl_on", [False, True], ids=["pdl-off", "pdl-on"])
def test_the_rules_launch_is_right_with_and_without_pdl(name, pdl_on):
    """The rule's launch at two decode shapes, tiles carried, with programmatic dependent launch on and off:
    within 1e-5 of the reference. On an H100 (Triton 3.6) the Q4_K kernel's carried loop compiled without
    PDL gave 7.5% error at 4096 x 1024 (mv._carry now loads each tile in its own iteration there)."""
    from vegaserve.triton_kernels import pdl
    from vegaserve.triton_kernels.matvec_launch import rule

    tid = IDS[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(7)
    try:
        pdl.set_enabled(pdl_on)
        for n, k in ((4096, 1024), (1024, 4096)):
            raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, gen)
            w, ref_w = repack(raw.cuda(), tid, n, k), repack(raw, tid, n, k)
            x = torch.randn(1, k, generator=gen).cuda()
            q, d, s = quantize_q8_1(x)
            params = {**rule(tid, n, k, 1, sms), "carry": 1}
            y = matvec_int8(x, w, params, q8_1=(q, d, s))
            ref = reference_matvec_q8_1(q.cpu(), d.cpu(), ref_w)
            assert float((y.double().cpu() - ref).norm() / ref.norm()) < 1e-5, (name, n, k, params)
    finally:
        pdl.set_enabled(True)
