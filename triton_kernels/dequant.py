"""The GGUF weight types vegaserve serves, and their torch reference dequantization.

`GGML_TYPES` maps a ggml type id (the number a GGUF file stores, as in `gguf.GGMLQuantizationType`) to its
`QuantSpec`; `dequantize` turns the raw bytes of a tensor of that type into float32. The per-family
reference code lives in `quants/`, one file per family, each opening with its block layout.

Ids and sizes are written out here rather than read from the `gguf` package: `triton_kernels` imports
nothing but torch and the standard library (the tests cross-check them against `gguf.GGML_QUANT_SIZES`).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from vegaserve.triton_kernels.quants import floats, iq1, iq2, iq3, iq4_nl, kquants, legacy, mxfp4


class GGMLType(IntEnum):
    """The ggml type ids of the weight types served: the one table every launcher and rule names them by
    (a @triton.jit kernel takes the id as a constexpr)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    MXFP4 = 39


@dataclass(frozen=True)
class QuantSpec:
    """One GGUF weight type: `block_size` elements are stored in `type_size` bytes."""

    name: str
    type_id: int
    block_size: int
    type_size: int


_SERVED: tuple[tuple[QuantSpec, Callable[[torch.Tensor], torch.Tensor]], ...] = (
    (QuantSpec("F32", GGMLType.F32, 1, 4), floats.dequantize_f32),
    (QuantSpec("F16", GGMLType.F16, 1, 2), floats.dequantize_f16),
    (QuantSpec("Q4_0", GGMLType.Q4_0, 32, 18), legacy.dequantize_q4_0),
    (QuantSpec("Q4_1", GGMLType.Q4_1, 32, 20), legacy.dequantize_q4_1),
    (QuantSpec("Q5_0", GGMLType.Q5_0, 32, 22), legacy.dequantize_q5_0),
    (QuantSpec("Q5_1", GGMLType.Q5_1, 32, 24), legacy.dequantize_q5_1),
    (QuantSpec("Q8_0", GGMLType.Q8_0, 32, 34), legacy.dequantize_q8_0),
    (QuantSpec("Q2_K", GGMLType.Q2_K, 256, 84), kquants.dequantize_q2_k),
    (QuantSpec("Q3_K", GGMLType.Q3_K, 256, 110), kquants.dequantize_q3_k),
    (QuantSpec("Q4_K", GGMLType.Q4_K, 256, 144), kquants.dequantize_q4_k),
    (QuantSpec("Q5_K", GGMLType.Q5_K, 256, 176), kquants.dequantize_q5_k),
    (QuantSpec("Q6_K", GGMLType.Q6_K, 256, 210), kquants.dequantize_q6_k),
    (QuantSpec("IQ2_XXS", GGMLType.IQ2_XXS, 256, 66), iq2.dequantize_iq2_xxs),
    (QuantSpec("IQ2_XS", GGMLType.IQ2_XS, 256, 74), iq2.dequantize_iq2_xs),
    (QuantSpec("IQ3_XXS", GGMLType.IQ3_XXS, 256, 98), iq3.dequantize_iq3_xxs),
    (QuantSpec("IQ1_S", GGMLType.IQ1_S, 256, 50), iq1.dequantize_iq1_s),
    (QuantSpec("IQ4_NL", GGMLType.IQ4_NL, 32, 18), iq4_nl.dequantize_iq4_nl),
    (QuantSpec("IQ3_S", GGMLType.IQ3_S, 256, 110), iq3.dequantize_iq3_s),
    (QuantSpec("IQ2_S", GGMLType.IQ2_S, 256, 82), iq2.dequantize_iq2_s),
    (QuantSpec("IQ4_XS", GGMLType.IQ4_XS, 256, 136), iq4_nl.dequantize_iq4_xs),
    (QuantSpec("IQ1_M", GGMLType.IQ1_M, 256, 56), iq1.dequantize_iq1_m),
    (QuantSpec("BF16", GGMLType.BF16, 1, 2), floats.dequantize_bf16),
    (QuantSpec("MXFP4", GGMLType.MXFP4, 32, 17), mxfp4.dequantize_mxfp4),
)

GGML_TYPES: dict[int, QuantSpec] = {spec.type_id: spec for spec, _ in _SERVED}
_DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {spec.type_id: fn for spec, fn in _SERVED}

# Types a GGUF file may hold that we do not serve; named only so that the error says which one it was.
_UNSERVED_NAMES: dict[int, str] = {
    9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 34: "TQ1_0", 35: "TQ2_0",
    40: "NVFP4", 41: "Q1_0",
}


class UnsupportedTypeError(ValueError):
    """A tensor's ggml type is one vegaserve cannot dequantize."""

    def __init__(self, type_id: int) -> None:
        name = _UNSERVED_NAMES.get(int(type_id), f"unknown ggml type {int(type_id)}")
        served = ", ".join(spec.name for spec in GGML_TYPES.values())
        super().__init__(f"GGUF tensor type {name} (id {int(type_id)}) is not supported; supported: {served}")
        self.type_id = int(type_id)


def spec_for(type_id: int) -> QuantSpec:
    """The spec of a served type; raises UnsupportedTypeError for any other id."""
    spec = GGML_TYPES.get(int(type_id))
    if spec is None:
        raise UnsupportedTypeError(type_id)
    return spec


def is_supported(type_id: int) -> bool:
    return int(type_id) in GGML_TYPES


def row_bytes(type_id: int, n_elements: int) -> int:
    """Bytes that `n_elements` consecutive elements (a whole number of blocks) occupy."""
    spec = spec_for(type_id)
    if n_elements % spec.block_size != 0:
        raise ValueError(f"{spec.name} rows hold whole blocks of {spec.block_size}; got {n_elements} elements")
    return n_elements // spec.block_size * spec.type_size


def dequantize(raw: torch.Tensor, type_id: int, shape: Sequence[int]) -> torch.Tensor:
    """Raw GGUF bytes of a tensor -> float32 tensor of `shape`, on `raw`'s device.

    `shape` is the logical shape in numpy order (the last dimension is the row, the reverse of ggml's ne).
    `raw` is a uint8 tensor holding exactly that many rows of blocks, in any shape (flat, or
    `[..., row_bytes]` as `GGUFReader` presents it). For F32 the result may share memory with `raw`.
    """
    spec = spec_for(type_id)
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise ValueError("a GGUF tensor has at least one dimension")
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw GGUF bytes must be a uint8 tensor, got {raw.dtype}")
    bytes_per_row = row_bytes(type_id, shape[-1])
    expected = math.prod(shape[:-1]) * bytes_per_row
    if raw.numel() != expected:
        raise ValueError(f"{spec.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}")
    rows = raw.reshape(*shape[:-1], bytes_per_row)
    return _DEQUANTIZERS[spec.type_id](rows).reshape(shape)
