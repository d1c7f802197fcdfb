"""The `lanes` decode mat-vec (triton_kernels/matvec_mma.py): one mma.sync a block and 16 rows, each lane
building its operands, against the reference on the same q8_1 activation (float64), outputs poisoned with
NaN; what it refuses (AMD, NVIDIA below sm_80, a block_n its warps cannot split), the one-block tiles it
leaves to the int8 kernel, and its sweep's configs. Under the interpreter the mma instructions are their
emulation (mma_lanes.py), which regathers the matrices from each lane's words."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels import matvec_mma
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.int8_ops import PTX_DP4A
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec_mma import candidates, has_matrix_units, matvec_lanes
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

IDS = {s.name: t for t, s in GGML_TYPES.items()}
LANES_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"]


pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.mark.parametrize("name", LANES_TYPES)
@pytest.mark.parametrize("block_n, num_warps, nb, split_k, carry",
                         [(16, 1, 2, 1, 1), (32, 1, 4, 2, 0), (64, 2, 8, 1, 1), (64, 4, 4, 2, 1)],
                         ids=["one-group", "two-groups-split", "two-warps", "four-warps-split"])
def test_lanes_kernels_match_the_reference(name, block_n, num_warps, nb, split_k, carry, q8_1_reference_check):
    """One m16n8k32 per block (Q4_K: sub-block; Q6_K an m16n8k16 per 16) and 16 rows, each lane's A, B and D
    words where the instruction's fragment puts them (under the interpreter its emulation regathers the
    matrices from those words, so a word in the wrong lane or register is a wrong product here): the
    reference's product at 1, 3 and 8 rows of x (columns of B past M zero), odd N (rows past N clamped and
    not stored), 1 and 2 groups of 16 rows a warp, 1, 2 and 4 warps, 2 to 8 blocks a tile, split-K."""
    q8_1_reference_check(matvec_lanes, name, 37, 512, (1, 3, 8), 22,
                         {"block_n": block_n, "nb": nb, "split_k": split_k, "num_warps": num_warps, "carry": carry})


def test_lanes_kernels_refuse_a_block_n_their_warps_cannot_split():
    tid = IDS["Q4_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(23)), tid, 16, 256)
    with pytest.raises(ValueError, match="multiple of 16 x num_warps"):
        matvec_lanes(torch.randn(2, 256), w, {"block_n": 32, "nb": 8, "split_k": 1, "num_warps": 4})


@pytest.mark.parametrize("name", ["Q8_0", "MXFP4"])  # 2-byte and 1-byte scale records
@pytest.mark.parametrize("k, nb, lanes", [(384, 8, True), (256, 1, False), (96, 2, False)],
                         ids=["tile-of-4", "nb-1", "odd-row"])
def test_lanes_kernels_leave_one_block_tiles_to_the_int8_kernel(name, k, nb, lanes, monkeypatch,
                                                                 q8_1_reference_check):
    """The lanes kernel reads a tile's q8_1 scales in pairs, so a tile of one block (nb 1, or a row of 3
    blocks, whose only power-of-two tile is 1) runs the int8 kernel with the same launch instead of failing;
    12 blocks at nb 8 take tiles of 4 there. Each the reference's product."""
    handed = []
    real = matvec_mma.matvec_int8
    monkeypatch.setattr(matvec_mma, "matvec_int8",
                        lambda x, w, params, *a: handed.append(params) or real(x, w, params, *a))
    params = {"block_n": 16, "nb": nb, "split_k": 1, "num_warps": 1}
    q8_1_reference_check(matvec_lanes, name, 21, k, (3,), 25, params)
    assert handed == ([] if lanes else [params])


@pytest.mark.parametrize("name", ["IQ4_XS", "Q3_K", "IQ2_XXS", "Q2_K", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S",
                                  "IQ1_M"])
def test_lanes_kernel_refuses_the_int8_kernels_super_block_record_types(name):
    """The new types the int8 kernel serves (scales decoded from super-block records, the lattice types'
    points gathered) have no lanes kernel: refused by name, and the tuning sweep offers no lanes candidate."""
    from vegaserve.triton_kernels import tune

    tid = IDS[name]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(29)), tid, 16, 256)
    with pytest.raises(ValueError, match=f"no kernel for {name}"):
        matvec_lanes(torch.randn(2, 256), w, {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1})
    assert {c.kernel.name for c in tune.candidates(tid, 28672, 4096, 8, 132, True)} == {"tiles", "int8"}


def test_lanes_kernel_is_refused_on_amd_and_below_sm_80(monkeypatch):
    """gfx906 has no matrix units, and mma.sync m16n8k32 (int8) needs sm_80: the launcher says so instead of
    compiling; the interpreter (and so a CPU tensor) runs its emulation."""
    tid = IDS["Q4_K"]
    w = repack(random_blocks(tid, 16, 1, torch.Generator().manual_seed(19)), tid, 16, 256)
    params = {"block_n": 16, "nb": 8, "split_k": 1, "num_warps": 1}
    assert not has_matrix_units(torch.device("cpu"))
    with monkeypatch.context() as patch:
        patch.setattr(torch.version, "hip", "6.3.0")
        with pytest.raises(ValueError, match="NVIDIA sm_80 and later"):
            matvec_lanes(torch.randn(2, 256), w, params)
    monkeypatch.setattr(matvec_mma, "dot_kind", lambda device: PTX_DP4A)  # a GPU without matrix units
    with pytest.raises(ValueError, match="NVIDIA sm_80 and later"):
        matvec_lanes(torch.randn(2, 256), w, params)


@pytest.mark.parametrize("name", LANES_TYPES)
@pytest.mark.parametrize("n, k", [(28672, 4096), (4096, 14336), (1024, 4096)])
def test_lanes_sweep_configs_are_launches_the_lanes_kernel_takes(name, n, k):
    """Each config one the launcher takes (block_n a multiple of 16 x num_warps, nb a power of two of two
    blocks or more, a split of two tiles or more) on 1, 2 and 4 warps; the first split of each row tile
    gives two programs an SM where the row's tiles allow it, and twice that split is timed too."""
    tid = IDS[name]
    lanes = candidates(tid, n, k, 132)
    assert {c["num_warps"] for c in lanes} == {1, 2, 4} and {c["block_n"] for c in lanes} == {32, 64, 128}
    assert len({tuple(sorted(c.items())) for c in lanes}) == len(lanes)
    qk = GGML_TYPES[tid].block_size
    for c in lanes:
        assert c["block_n"] % (16 * c["num_warps"]) == 0 and c["nb"] & (c["nb"] - 1) == 0 and c["nb"] >= 2
        tiles = k // qk // max(1, c["nb"] * 32 // qk)
        assert tiles // c["split_k"] >= 2
    for tile in {(c["block_n"], c["num_warps"], c["nb"]) for c in lanes}:
        splits = sorted(c["split_k"] for c in lanes if (c["block_n"], c["num_warps"], c["nb"]) == tile)
        tiles = k // qk // max(1, tile[2] * 32 // qk)
        assert -(-n // tile[0]) * splits[0] >= 2 * 132 or tiles // (2 * splits[0]) < 2, (tile, splits)
        assert splits in ([splits[0]], [splits[0], 2 * splits[0]])
