"""benchmarks/repack_table.py's text (the GPU timing itself runs on a GPU only): the layout column comes
from the repacked planes layout.py builds, and the speed and numerics columns read as the fork's table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from repack_table import layout_text, numerics_text, versus  # noqa: E402

from vegaserve.triton_kernels.dequant import GGML_TYPES  # noqa: E402
from vegaserve.triton_kernels.layout import repack  # noqa: E402
from vegaserve.triton_kernels.quants.random_blocks import random_blocks  # noqa: E402

IDS = {s.name: t for t, s in GGML_TYPES.items()}


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_NL", "MXFP4"])
def test_layout_column_lists_the_planes_a_repack_builds(name):
    """The record bytes of the column's planes are those of the planes a repacked matrix has (a plane's
    fields share its record, their block stride), in field order, and sum to the block's bytes: the text
    is the layout the loader builds, not a description kept beside it."""
    text = layout_text(name)
    sizes = [int(part.split(" B ")[0]) for part in text.removesuffix(" a block").split(", ")]
    tid = IDS[name]
    w = repack(random_blocks(tid, 4, 2, torch.Generator().manual_seed(1)), tid, 4, 2 * GGML_TYPES[tid].block_size)
    assert sizes == list(dict.fromkeys(f.block_stride for f in w.fields))
    assert sum(sizes) == GGML_TYPES[tid].type_size


def test_layout_column_names_the_k_quant_head_record():
    assert layout_text("Q4_K") == "16 B dm+scales, 128 B qs a block"


def test_speed_and_numerics_columns():
    assert versus(0.010, 0.0112) == "+12% (10.0 vs 11.2 us)"
    assert versus(0.020, 0.010) == "-50% (20.0 vs 10.0 us)"
    err = {"generation": {"repacked": 1.1e-2, "canonical": 4.2e-7}, "prefill": {"repacked": 2.3e-3, "canonical": 2.3e-3}}
    assert numerics_text(err, {"generation": False, "prefill": True}) == (
        "generation: repacked 1.1e-02, canonical 4.2e-07; prefill: 2.3e-03, identical")
