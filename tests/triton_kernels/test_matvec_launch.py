"""Launch planning of the word-tile decode mat-vecs (triton_kernels/matvec_launch.py): the fixed rule and the
sweep's candidates are launches the kernels take, `plan` refuses what they cannot run, and the split-K
arrival counts are one buffer per device that only grows."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import canonical, repack
from vegaserve.triton_kernels.matmul import tile_split
from vegaserve.triton_kernels.matvec_launch import GEOMETRY, arrival_counts, candidates, plan, rule
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

IDS = {s.name: t for t, s in GGML_TYPES.items()}
SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]


@pytest.mark.parametrize("name", sorted(GGML_TYPES[t].name for t in GEOMETRY))
def test_rule_and_candidates_are_launches_the_kernels_take(name):
    """Every config starts from the rule, none twice; block_n a power of two from 8; nb (32-element units)
    divides the row, so a tile holds whole blocks; each K split holds two tiles or more where the row has
    four; wave64 doubles the rule's rows a program."""
    tid = IDS[name]
    for m in (1, 8):
        for n, k in SHAPES:
            base = rule(tid, n, k, m, 132)
            cands = candidates(tid, n, k, m, 132)
            assert cands[0] == base and len({tuple(sorted(c.items())) for c in cands}) == len(cands)
            for c in cands:
                assert set(c) == {"block_n", "nb", "split_k", "num_warps"}
                assert c["block_n"] >= 8 and c["block_n"] & (c["block_n"] - 1) == 0
                assert (k // 32) % c["nb"] == 0 and c["split_k"] >= 1
                per_tile, per_split, splits = tile_split(tid, k, c["nb"], c["split_k"])
                assert per_split % per_tile == 0 and splits <= c["split_k"]  # 14336: 7 splits of 8 asked
                if c is base and splits > 1:
                    assert per_split // per_tile >= 2
            wave64 = rule(tid, n, k, m, 60, warp_size=64)
            assert wave64["block_n"] == min(256, 2 * rule(tid, n, k, m, 60)["block_n"])


def test_k_quants_take_two_rows_a_thread_above_one_row_of_x():
    """4 rows a thread spilled on sm_90 for the K-quants at M > 1: their rule halves block_n there."""
    for name in ("Q4_K", "Q6_K"):
        one, more = rule(IDS[name], 4096, 4096, 1, 132), rule(IDS[name], 4096, 4096, 2, 132)
        assert more["block_n"] * 2 == one["block_n"]
    assert rule(IDS["Q8_0"], 4096, 4096, 1, 132)["block_n"] == rule(IDS["Q8_0"], 4096, 4096, 8, 132)["block_n"]


def test_plan_refuses_canonical_blocks_a_bad_block_n_and_more_than_8_rows():
    tid = IDS["Q4_0"]
    raw = random_blocks(tid, 16, 2, torch.Generator().manual_seed(3))
    params = {"block_n": 16, "nb": 1, "split_k": 1, "num_warps": 1}
    with pytest.raises(ValueError, match="repacked"):
        plan("int8", torch.zeros(1, 64), canonical(raw, tid, 16, 64), params)
    w = repack(raw, tid, 16, 64)
    for block_n in (4, 24):
        with pytest.raises(ValueError, match="block_n"):
            plan("int8", torch.zeros(1, 64), w, {**params, "block_n": block_n})
    for x in (torch.zeros(9, 64), torch.zeros(1, 32)):
        with pytest.raises(ValueError, match="1..8 rows"):
            plan("int8", x, w, params)
    launch = plan("int8", torch.zeros(3, 64), w, {**params, "split_k": 2})
    assert (launch.per_tile, launch.per_split, launch.split) == (1, 1, 2) and launch.grid(16) == (1, 2)


def test_arrival_counts_are_one_zeroed_buffer_a_device_that_only_grows():
    """A captured graph keeps the address it was captured with: a request no larger than the buffer gets
    the same buffer; a larger one a new buffer, the old one kept alive."""
    device = torch.device("cpu")
    first = arrival_counts(device, 8)
    assert first.numel() >= 1 << 16 and not first.any() and first.dtype == torch.int32
    assert arrival_counts(device, 100).data_ptr() == first.data_ptr()
    grown = arrival_counts(device, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    assert arrival_counts(device, 8).data_ptr() == grown.data_ptr()
