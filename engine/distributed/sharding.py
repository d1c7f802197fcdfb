"""A lane's slice of a GGUF matrix, cut from its canonical bytes before the layer stores it.

GGUF rows are independent, so slicing output rows (column-parallel linears, the vocab-parallel embedding
and LM head) cuts nothing. Slicing input columns (row-parallel linears) takes whole blocks of every row:
`block_split` deals a matrix's blocks over the lanes, as evenly as they go (a lane may hold one block more
than its neighbour), and the column-parallel matrix that feeds it takes the same range of rows; the caller
checked (topology.check_model_splits) that every lane gets a block, and this refuses any cut block. The
layer then repacks its own slice on its own device.
"""

from __future__ import annotations

import dataclasses

import torch

from vegaserve.engine.gguf_file import ModelLoadError
from vegaserve.engine.layers.linear import WeightSource
from vegaserve.triton_kernels.dequant import spec_for


def _with_shape(src: WeightSource, raw, shape: tuple[int, ...]) -> WeightSource:
    info = dataclasses.replace(src.info, shape=shape, n_bytes=raw.numel())
    return WeightSource(info, raw, src.path)


def block_split(cols: int, block: int, tp: int, lane: int) -> tuple[int, int]:
    """(first column, columns) of lane's slice of `cols` input columns in whole `block`-element blocks: the
    blocks dealt evenly, the first lanes one more each where they do not divide (an even split where they
    do, so whole-block even splits are unchanged)."""
    n = cols // block
    if n * block != cols or n < tp:
        raise ValueError(f"{cols} columns in blocks of {block} do not give each of {tp} lanes a whole block")
    per, extra = divmod(n, tp)
    return (lane * per + min(lane, extra)) * block, (per + (lane < extra)) * block


def lane_block_split(src: WeightSource, tp: int, lane: int) -> tuple[int, int]:
    """block_split of a row-split matrix's input columns (the last dimension), in its own type's blocks."""
    cols = src.info.shape[-1]
    qk = spec_for(src.info.type_id).block_size
    try:
        return block_split(cols, qk, tp, lane)
    except ValueError as e:
        raise ModelLoadError(f"{src.path}: tensor {src.info.name} ({src.info.type_name}): {e}") from e


def slice_rows(src: WeightSource, start: int, count: int) -> WeightSource:
    """Output rows start .. start + count of a [rows, cols] matrix (a vector: its elements)."""
    shape = src.info.shape
    rows = shape[0]
    if start < 0 or start + count > rows:
        raise ModelLoadError(f"{src.path}: tensor {src.info.name}: rows {start}..{start + count} out of {rows}")
    if start == 0 and count == rows:
        return src
    raw = src.raw.reshape(rows, -1)[start : start + count]
    return _with_shape(src, raw, (count, *shape[1:]))


def slice_cols(src: WeightSource, start: int, count: int) -> WeightSource:
    """Input columns start .. start + count of a [rows, cols] matrix, in whole quantization blocks."""
    rows, cols = src.info.shape
    if start == 0 and count == cols:
        return src
    qk = spec_for(src.info.type_id).block_size
    if start % qk or count % qk or start + count > cols:
        raise ModelLoadError(
            f"{src.path}: tensor {src.info.name} ({src.info.type_name}): columns {start}..{start + count} "
            f"would cut its {qk}-element blocks"
        )
    ts = spec_for(src.info.type_id).type_size
    raw = src.raw.reshape(rows, -1)[:, start // qk * ts : (start + count) // qk * ts].contiguous()
    return _with_shape(src, raw, (rows, count))


def slice_expert_rows(src: WeightSource, start: int, count: int) -> WeightSource:
    """Rows start .. start + count of every expert of an [E, rows, cols] tensor (a column-parallel slice of
    each expert: its share of the gate and up projections)."""
    experts, rows, cols = src.info.shape
    if start < 0 or start + count > rows:
        raise ModelLoadError(f"{src.path}: tensor {src.info.name}: rows {start}..{start + count} out of {rows}")
    if start == 0 and count == rows:
        return src
    raw = src.raw.reshape(experts, rows, -1)[:, start : start + count].contiguous()
    return _with_shape(src, raw, (experts, count, cols))


def slice_expert_cols(src: WeightSource, start: int, count: int) -> WeightSource:
    """Input columns start .. start + count of every expert of an [E, rows, cols] tensor (a row-parallel
    slice: the down projection's), in whole quantization blocks."""
    experts, rows, cols = src.info.shape
    if start == 0 and count == cols:
        return src
    part = slice_cols(_with_shape(src, src.raw, (experts * rows, cols)), start, count)
    return _with_shape(src, part.raw, (experts, rows, count))


def append_expert(stack: WeightSource, one: WeightSource) -> WeightSource:
    """An [E, rows, cols] stack with the [rows, cols] matrix `one` as its expert E: [E + 1, rows, cols], the
    stack's bytes then one's (a shared expert run as one more of the stack's)."""
    experts, rows, cols = stack.info.shape
    if one.info.shape != (rows, cols) or one.info.type_id != stack.info.type_id:
        raise ModelLoadError(f"{one.path}: tensor {one.info.name} ({one.info.type_name}, {list(one.info.shape)}) "
                             f"is no expert of {stack.info.name} ({stack.info.type_name}, {list(stack.info.shape)})")
    raw = torch.cat([stack.raw.reshape(-1), one.raw.reshape(-1)])
    return _with_shape(stack, raw, (experts + 1, rows, cols))


def vocab_slice(vocab: int, tp: int, lane: int) -> tuple[int, int, int]:
    """(first row, rows, padded width) of a lane's vocabulary slice: ceil(vocab / tp) rows per lane, the
    last lane fewer; every lane's logits are padded to the same width for the gather."""
    per = -(-vocab // tp)
    start = min(lane * per, vocab)
    return start, min(per, vocab - start), per


def gather_rows(src: WeightSource, ranges: list[tuple[int, int]]) -> WeightSource:
    """The output rows of several (start, count) ranges of a [rows, cols] matrix, in order, as one matrix."""
    parts = [slice_rows(src, a, n) for a, n in ranges]
    if len(parts) == 1:
        return parts[0]
    rows = sum(n for _, n in ranges)
    raw = torch.cat([q.raw.reshape(n, -1) for q, (_, n) in zip(parts, ranges, strict=True)])
    return _with_shape(src, raw, (rows, *src.info.shape[1:]))


def gather_cols(src: WeightSource, ranges: list[tuple[int, int]]) -> WeightSource:
    """The input columns of several (start, count) ranges of a [rows, cols] matrix, in order, as one matrix
    (each range in whole quantization blocks)."""
    parts = [slice_cols(src, a, n) for a, n in ranges]
    if len(parts) == 1:
        return parts[0]
    rows = src.info.shape[0]
    raw = torch.cat([q.raw.reshape(rows, -1) for q in parts], dim=1).contiguous()
    return _with_shape(src, raw, (rows, sum(n for _, n in ranges)))


def head_ranges(heads: list[int], width: int, base: int = 0) -> list[tuple[int, int]]:
    """(start, count) row or column ranges of `heads` of `width` each after `base`, adjacent heads merged."""
    out: list[tuple[int, int]] = []
    for h in heads:
        start = base + h * width
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + width)
        else:
            out.append((start, width))
    return out
