"""`vegaserve tune` (triton_kernels/tune.py): the choice of decode kernel from its measurements, and on a
GPU one whole small run into a file."""

from __future__ import annotations

import json

import pytest
import torch

from vegaserve.triton_kernels.tune import choose_kernel, tune
from vegaserve.triton_kernels.tuning import load_tuning


def test_int8_is_chosen_only_where_it_was_measured_and_faster_everywhere():
    assert choose_kernel([(10.0, 6.0), (30.0, 20.0)]) == "int8"
    assert choose_kernel([(10.0, 6.0), (30.0, 31.0)]) == "tiles"  # lost once
    assert choose_kernel([(10.0, None)]) == "tiles"  # no int8 kernel for the type
    assert choose_kernel([(10.0, 6.0), (30.0, None)]) == "tiles"
    assert choose_kernel([]) == "tiles"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tune_writes_tile_and_int8_configs_and_the_kernel_choice(tmp_path):
    out = tmp_path / "t.json"
    out.write_text(json.dumps({"matvec": {"Q4_0": {"small": {"1": {"block_n": 16}}}}}))  # kept: not tuned here
    lines: list[str] = []
    tune(["Q8_0"], ["small"], [1], out, log=lines.append)
    table = json.loads(out.read_text())
    assert table["matvec"]["Q4_0"] == {"small": {"1": {"block_n": 16}}}
    assert set(table["matvec"]["Q8_0"]["small"]["1"]) == {"block_n", "nb", "split_k"}
    assert set(table["matvec_int8"]["Q8_0"]["small"]["1"]) == {"block_n", "nb", "split_k", "num_warps", "carry"}
    assert table["matvec_kernel"]["Q8_0"] in ("tiles", "int8")
    t = load_tuning(table["target"], out)
    assert t.matvec_kernel("Q8_0") == table["matvec_kernel"]["Q8_0"]
    assert any("int8" in line for line in lines)
