# Torch reference "dequantizers" for the plain float types: GGUF stores them as little-endian IEEE values,
# one element per block, so dequantizing is a reinterpretation of the bytes plus an exact widening.
#
#   F32  4 B: binary32          returned as a view of the input bytes (no copy)
#   F16  2 B: binary16          widened to float32 (exact)
#   BF16 2 B: top half of a binary32; widened by appending 16 zero bits (exact)

import torch

from vegaserve.triton_kernels.quants.fields import as_blocks


def _reinterpret(raw: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    as_blocks(raw, width)  # validates dtype and row length
    # `.view(dtype)` needs unit stride in the last dimension; rows handed over as slices may lack it.
    return raw.contiguous().view(dtype)


def dequantize_f32(raw: torch.Tensor) -> torch.Tensor:
    return _reinterpret(raw, 4, torch.float32)


def dequantize_f16(raw: torch.Tensor) -> torch.Tensor:
    return _reinterpret(raw, 2, torch.float16).to(torch.float32)


def dequantize_bf16(raw: torch.Tensor) -> torch.Tensor:
    return _reinterpret(raw, 2, torch.bfloat16).to(torch.float32)
