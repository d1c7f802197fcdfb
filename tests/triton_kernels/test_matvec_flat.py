"""The flat-tile decode mat-vec (triton_kernels/matvec_flat.py) against dequant(W) @ x of the torch
reference (float64): each type it serves, 1, 3 and 8 rows of x, odd N (a partial last row tile), K of
several tiles with split-K on and off, and the outputs poisoned with NaN before each launch (the partials
are allocated uninitialised, so a row the kernel fails to write fails the finiteness check)."""

from __future__ import annotations

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import canonical, repack
from vegaserve.triton_kernels.matmul import reference_matmul
from vegaserve.triton_kernels.matvec_flat import SUPPORTED, candidates, matvec_flat, rule
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = {t: s.name for t, s in GGML_TYPES.items()}
TYPES = sorted(NAMES[t] for t in SUPPORTED)
IDS = {s.name: t for t, s in GGML_TYPES.items()}


def _weight(name: str, n: int, k: int, seed: int, layout=repack, device: str = DEVICE):
    """The [n, k] matrix of `name` in `layout` on `device` (repacking runs where the bytes are)."""
    tid = IDS[name]
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(seed))
    return layout(raw.to(device), tid, n, k)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output: a row or split the kernel did not write"
    return float((y.double().cpu() - ref).norm() / ref.norm())


pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_flat_matvec_matches_reference(name, split_k):
    qk = GGML_TYPES[IDS[name]].block_size
    k = 4 * max(qk, 64)  # several tiles per row at nb = 1 super-block / 2 blocks
    w, ref_w = _weight(name, 37, k, 11), _weight(name, 37, k, 11, device="cpu")
    gen = torch.Generator().manual_seed(12)
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=gen)
        # nb counts 32-element units: two blocks, or one super-block, per tile
        y = matvec_flat(x.to(DEVICE), w, block_n=16, nb=2 if qk == 32 else 8, split_k=split_k, num_warps=1)
        assert _rel(y, reference_matmul(x, ref_w)) < 1e-5


def test_flat_matvec_rejects_canonical_layout_and_bad_block_n():
    w = _weight("Q4_0", 16, 64, 3, layout=canonical)
    with pytest.raises(ValueError, match="repacked"):
        matvec_flat(torch.zeros(1, 64), w)
    w = _weight("Q4_0", 16, 64, 3)
    with pytest.raises(ValueError, match="block_n"):
        matvec_flat(torch.zeros(1, 64), w, block_n=4, nb=1, split_k=1, num_warps=1)
    with pytest.raises(ValueError, match="1..8 rows"):
        matvec_flat(torch.zeros(9, 64), w)


def test_rule_and_candidates_are_valid_launches():
    for tid in SUPPORTED:
        for m in (1, 8):
            for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)):
                base = rule(tid, n, k, m, 132)
                cands = candidates(tid, n, k, m, 132)
                assert cands[0] == base and len({tuple(sorted(c.items())) for c in cands}) == len(cands)
                for c in cands:
                    assert c["block_n"] >= 8 and c["block_n"] & (c["block_n"] - 1) == 0
                    assert (k // 32) % c["nb"] == 0 and c["split_k"] >= 1
