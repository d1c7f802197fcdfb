"""The tile dequantizers' level functions against the formats' tables, every code: IQ4_NL's rounded quartic
(tiles_legacy.iq4_nl_value) and MXFP4's doubled e2m1 values (tiles_mxfp4.e2m1_doubled). A kernel writes
each code's level; the result must equal the table exactly (the matmul tests see the levels only through
products with random data). Under TRITON_INTERPRET=1 on a CPU, natively on a GPU (where the quartic's
multiply-adds may fuse: the fit's 0.067 margin to the rounding point covers that)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.quants.iq4_nl import LEVELS
from vegaserve.triton_kernels.quants.mxfp4 import DOUBLED_E2M1
from vegaserve.triton_kernels.tiles_legacy import iq4_nl_value
from vegaserve.triton_kernels.tiles_mxfp4 import e2m1_doubled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _levels_kernel(out_ptr, WHICH: tl.constexpr):
    code = tl.arange(0, 16)
    if WHICH == 0:
        v = iq4_nl_value(code)
    else:
        v = e2m1_doubled(code).to(tl.float32)
    tl.store(out_ptr + code, v)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("which, table", [(0, LEVELS), (1, DOUBLED_E2M1)], ids=["iq4_nl", "mxfp4"])
def test_level_functions_give_every_code_its_table_value_exactly(which, table):
    out = torch.empty(16, dtype=torch.float32, device=DEVICE)
    _levels_kernel[(1,)](out, WHICH=which)
    assert out.cpu().tolist() == [float(v) for v in table]
