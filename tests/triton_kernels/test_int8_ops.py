"""The int8 helpers of the decode mat-vecs (triton_kernels/int8_ops.py): lookup16's table levels and
pairs_order's byte arrangement, in both permute schemes (NVIDIA's prmt, AMD's v_perm_b32), against numpy.
Each runs as its instruction on a GPU, as its integer emulation under the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.int8_ops import lookup16, pairs_order
from vegaserve.triton_kernels.matvec_int8 import dot_kind
from vegaserve.triton_kernels.quants.iq4_nl import LEVELS as IQ4_NL_LEVELS
from vegaserve.triton_kernels.quants.mxfp4 import DOUBLED_E2M1

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _lookup_kernel(q_ptr, lo_ptr, hi_ptr, TABLE: tl.constexpr, DOT: tl.constexpr, BYTE_SELECT: tl.constexpr,
                   PAIRS: tl.constexpr = False):
    i = tl.arange(0, 256)
    lo, hi = lookup16(tl.load(q_ptr + i), TABLE, DOT, BYTE_SELECT, PAIRS)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


@triton.jit
def _pairs_kernel(lo_ptr, hi_ptr, a_ptr, b_ptr, DOT: tl.constexpr):
    i = tl.arange(0, 256)
    a, b = pairs_order(tl.load(lo_ptr + i), tl.load(hi_ptr + i), DOT)
    tl.store(a_ptr + i, a)
    tl.store(b_ptr + i, b)


@pytest.mark.parametrize("byte_select", [0, 1], ids=["nibble-selectors", "byte-selectors"])
@pytest.mark.parametrize("table, levels", [(1, IQ4_NL_LEVELS), (2, DOUBLED_E2M1)], ids=["IQ4_NL", "MXFP4"])
def test_table_lookup_gives_each_nibbles_level(table, levels, byte_select):
    """Both permute schemes of lookup16 (NVIDIA's prmt with nibble selectors, AMD's v_perm_b32 with byte
    selectors; each as its instruction or, elsewhere, its integer emulation) against a plain table lookup
    of every nibble, over random words and the all-codes words."""
    words = torch.randint(-2**31, 2**31, (256,), generator=torch.Generator().manual_seed(9), dtype=torch.int64)
    words[:16] = torch.tensor([int.from_bytes(bytes([c | (15 - c) << 4] * 4), "little", signed=True) for c in range(16)])
    q = words.to(torch.int32).to(DEVICE)
    lo, hi = torch.empty_like(q), torch.empty_like(q)
    _lookup_kernel[(1,)](q, lo, hi, TABLE=table, DOT=dot_kind(q.device), BYTE_SELECT=byte_select)
    raw = q.cpu().numpy().view(np.uint8).reshape(256, 4)
    table_np = np.array(levels, dtype=np.int8)
    want_lo = table_np[raw & 15].reshape(-1).view(np.int32)
    want_hi = table_np[raw >> 4].reshape(-1).view(np.int32)
    assert np.array_equal(lo.cpu().numpy(), want_lo) and np.array_equal(hi.cpu().numpy(), want_hi)


@pytest.mark.parametrize("table, levels", [(1, IQ4_NL_LEVELS), (2, DOUBLED_E2M1)], ids=["IQ4_NL", "MXFP4"])
def test_pairs_order_puts_words_in_the_lookups_pair_order(table, levels):
    """lookup16's PAIRS words hold the levels of nibbles (0 low, 0 high, 1 low, 1 high), (2 low, 2 high, 3 low,
    3 high); pairs_order arranges two words' bytes the same way: so the PAIRS levels against pairs_order'd
    activations sum to what the interleaved levels against the activations in order sum to."""
    gen = torch.Generator().manual_seed(10)
    q = torch.randint(-2**31, 2**31, (256,), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    lo, hi = torch.empty_like(q), torch.empty_like(q)
    _lookup_kernel[(1,)](q, lo, hi, TABLE=table, DOT=dot_kind(q.device), BYTE_SELECT=0, PAIRS=True)
    raw = q.cpu().numpy().view(np.uint8).reshape(256, 4)
    table_np = np.array(levels, dtype=np.int8)
    want = table_np[np.stack([raw & 15, raw >> 4], axis=-1).reshape(256, 8)]  # nibble order: byte t low, high
    assert np.array_equal(lo.cpu().numpy().view(np.int8).reshape(256, 4), want[:, :4])
    assert np.array_equal(hi.cpu().numpy().view(np.int8).reshape(256, 4), want[:, 4:])
    xl = torch.randint(-2**31, 2**31, (256,), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    xh = torch.randint(-2**31, 2**31, (256,), generator=gen, dtype=torch.int64).to(torch.int32).to(DEVICE)
    a, b = torch.empty_like(q), torch.empty_like(q)
    _pairs_kernel[(1,)](xl, xh, a, b, DOT=dot_kind(q.device))
    xlb = xl.cpu().numpy().view(np.int8).reshape(256, 4)
    xhb = xh.cpu().numpy().view(np.int8).reshape(256, 4)
    inter = np.stack([xlb, xhb], axis=-1).reshape(256, 8)  # (lo byte 0, hi byte 0, lo byte 1, ...)
    assert np.array_equal(a.cpu().numpy().view(np.int8).reshape(256, 4), inter[:, :4])
    assert np.array_equal(b.cpu().numpy().view(np.int8).reshape(256, 4), inter[:, 4:])
