"""`random_blocks` makes valid, reproducible blocks whose weights look like real ones (finite, about +-2)."""

import pytest
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

SERVED = sorted(GGML_TYPES)
NAMES = [GGML_TYPES[t].name for t in SERVED]


def _weights(type_id: int, n_rows: int, n_blocks: int, seed: int) -> torch.Tensor:
    raw = random_blocks(type_id, n_rows, n_blocks, torch.Generator().manual_seed(seed))
    return dequantize(raw, type_id, (n_rows, n_blocks * GGML_TYPES[type_id].block_size))


@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_random_blocks_have_the_row_shape_of_the_type(type_id):
    spec = GGML_TYPES[type_id]
    raw = random_blocks(type_id, 3, 5, torch.Generator().manual_seed(0))
    assert raw.dtype == torch.uint8
    assert raw.shape == (3, 5 * spec.type_size)


@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_random_blocks_are_reproducible_from_the_seed_and_differ_across_seeds(type_id):
    gen = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731
    assert torch.equal(random_blocks(type_id, 2, 4, gen(5)), random_blocks(type_id, 2, 4, gen(5)))
    assert not torch.equal(random_blocks(type_id, 2, 4, gen(5)), random_blocks(type_id, 2, 4, gen(6)))


@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_random_block_weights_are_finite_moderate_and_varied(type_id):
    w = _weights(type_id, 8, 16, seed=1)
    assert torch.isfinite(w).all()
    assert w.abs().max() <= 2.5
    # Not degenerate: spread out, both signs, many distinct values (MXFP4, the fewest, has 8 exponents
    # times 15 FP4 values, of which a 4096-weight draw hits about 40).
    assert w.std() > 1e-3
    assert (w > 0).any() and (w < 0).any()
    assert w.unique().numel() > 30
