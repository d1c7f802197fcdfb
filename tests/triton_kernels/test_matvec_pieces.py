"""The `pieces` decode mat-vec (triton_kernels/matvec_pieces.py): Q4_K and Q6_K with each row's loads along
it, against the reference on the same q8_1 activation (float64) at 1, 3 and 8 rows, odd N, 1 to 8
super-blocks a tile, split-K on and off, tiles carried or not, outputs poisoned with NaN; its two
int-to-float forms (unpack) give the same products bit for bit; its sweep is one row only."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec_pieces import candidates, matvec_pieces
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IDS = {s.name: t for t, s in GGML_TYPES.items()}


pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("nb, split_k, carry", [(2, 1, 1), (4, 2, 0), (8, 1, 0)])
def test_pieces_kernels_match_the_reference(name, nb, split_k, carry, q8_1_reference_check):
    """The quant words and scale records loaded along each row, the scales decoded per 16-byte piece (Q4_K:
    the min term once a sub-block; Q6_K: each piece's qh bits from the run it shares with another piece):
    the reference's product at 1, 3 and 8 rows, odd N."""
    q8_1_reference_check(matvec_pieces, name, 21, 2048, (1, 3, 8), 14,
                         {"block_n": 8, "nb": nb * 8, "split_k": split_k, "num_warps": 1, "carry": carry})


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_pieces_unpack_variants_give_the_same_products(name, q8_1_reference_check):
    """unpack 1 (exact int-to-float by adds; Q4_K: masks chosen per piece) against unpack 0 (conversions;
    Q4_K: a select between both forms): the same scales and sums, so the same products, at 1 and 3 rows;
    and the reference's."""
    q8_1_reference_check(matvec_pieces, name, 21, 2048, (1, 3), 18,
                         {"block_n": 8, "nb": 64, "split_k": 1, "num_warps": 1, "unpack": 1})
    tid = IDS[name]
    raw = random_blocks(tid, 21, 8, torch.Generator().manual_seed(20))
    w = repack(raw.to(DEVICE), tid, 21, 2048)
    params = {"block_n": 8, "nb": 32, "split_k": 2, "num_warps": 1}
    for m in (1, 3):
        x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(21 + m)).to(DEVICE)
        q8 = quantize_q8_1(x)
        unpacked = matvec_pieces(x, w, {**params, "unpack": 1}, q8)
        assert torch.equal(unpacked, matvec_pieces(x, w, {**params, "unpack": 0}, q8))


def test_pieces_refuse_the_types_they_have_no_kernel_for():
    tid = IDS["Q8_0"]
    w = repack(random_blocks(tid, 16, 8, torch.Generator().manual_seed(2)), tid, 16, 256)
    with pytest.raises(ValueError, match="Q4_K and Q6_K"):
        matvec_pieces(torch.randn(1, 256), w, {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1})


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_pieces_sweep_is_one_row_only_over_carry_unpack_and_8_or_32_rows(name):
    """At one row: each config once, carry and unpack both ways, 8 and 32 rows a program beside the rule's,
    each block_n a power of two from 8. Above one row none (the int8 kernel's groups are timed there)."""
    tid = IDS[name]
    one = candidates(tid, 28672, 4096, 1, 132)
    assert len({tuple(sorted(c.items())) for c in one}) == len(one)
    assert {c["carry"] for c in one} == {c["unpack"] for c in one} == {0, 1}
    assert {8, 32} <= {c["block_n"] for c in one}
    assert all(c["block_n"] >= 8 and c["block_n"] & (c["block_n"] - 1) == 0 for c in one)
    assert candidates(tid, 28672, 4096, 2, 132) == candidates(tid, 28672, 4096, 8, 132) == []
