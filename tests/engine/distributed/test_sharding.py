"""A lane's slice of a GGUF matrix dequantizes to the same slice of the whole matrix; no block is ever cut."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vegaserve.engine.distributed.sharding import append_expert, slice_cols, slice_rows, vocab_slice
from vegaserve.engine.gguf_file import ModelLoadError, TensorInfo
from vegaserve.engine.layers.linear import WeightSource
from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize, spec_for
from vegaserve.triton_kernels.quants.random_blocks import random_blocks


def source(type_name: str, rows: int, cols: int, seed: int = 0) -> WeightSource:
    tid = next(t for t, s in GGML_TYPES.items() if s.name == type_name)
    raw = random_blocks(tid, rows, cols // spec_for(tid).block_size, torch.Generator().manual_seed(seed))
    info = TensorInfo("blk.0.ffn_down.weight", tid, type_name, (rows, cols), raw.numel(), 0, 0)
    return WeightSource(info, raw.reshape(-1), "m.gguf")


def dense(src: WeightSource) -> torch.Tensor:
    return dequantize(src.raw.reshape(-1), src.info.type_id, src.info.shape)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "Q5_1", "IQ4_NL"])
def test_slices_dequantize_to_slices_of_the_whole(type_name: str) -> None:
    src = source(type_name, 12, 1024, seed=len(type_name))
    full = dense(src)
    qk = spec_for(src.info.type_id).block_size
    for lane in range(2):
        cols = slice_cols(src, lane * 512, 512)
        assert cols.info.shape == (12, 512)
        assert torch.equal(dense(cols), full[:, lane * 512 : (lane + 1) * 512])
    rows = slice_rows(src, 5, 4)
    assert rows.info.shape == (4, 1024) and torch.equal(dense(rows), full[5:9])
    with pytest.raises(ModelLoadError, match=f"would cut its {qk}-element blocks"):
        slice_cols(src, qk // 2, qk)


def test_a_whole_slice_is_the_source_itself() -> None:
    src = source("Q8_0", 4, 64)
    assert slice_rows(src, 0, 4) is src and slice_cols(src, 0, 64) is src


@pytest.mark.parametrize(("vocab", "tp"), [(1000, 4), (49152, 3), (7, 2), (10, 1)])
def test_vocab_slices_cover_the_vocabulary_once(vocab: int, tp: int) -> None:
    covered = []
    widths = set()
    for lane in range(tp):
        start, rows, width = vocab_slice(vocab, tp, lane)
        covered += range(start, start + rows)
        widths.add(width)
        assert rows <= width
    assert covered == list(range(vocab)) and len(widths) == 1


def test_a_matrix_appended_to_an_expert_stack_is_its_last_expert() -> None:
    """append_expert: [E, rows, cols] and a [rows, cols] matrix of the same type -> [E + 1, rows, cols] whose
    experts dequantize to the stack's and then the matrix; another type or shape is refused, both named."""
    one = source("Q4_K", 6, 512, seed=1)
    parts = source("Q4_K", 3 * 6, 512, seed=2)
    stack = WeightSource(dataclasses.replace(parts.info, shape=(3, 6, 512)), parts.raw, parts.path)
    both = append_expert(stack, one)
    assert both.info.shape == (4, 6, 512) and both.info.n_bytes == both.raw.numel()
    whole = dequantize(both.raw, both.info.type_id, (24, 512))
    assert torch.equal(whole[:18], dense(parts)) and torch.equal(whole[18:], dense(one))
    with pytest.raises(ModelLoadError, match=r"\(Q8_0, \[6, 512\]\) is no expert of .* \(Q4_K, \[3, 6, 512\]\)"):
        append_expert(stack, source("Q8_0", 6, 512))
    with pytest.raises(ModelLoadError, match="is no expert of"):
        append_expert(stack, source("Q4_K", 5, 512))
