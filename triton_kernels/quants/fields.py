# Shared byte-level helpers for the reference dequantizers: split rows of raw GGUF bytes into blocks and read
# the fields of a block (f16 scales, nibbles, single bits) with tensor ops only.
#
# GGUF stores every multi-byte field little-endian; so do the hosts and GPUs we run on, so a field is read by
# reinterpreting its bytes (`.view(dtype)`) rather than by assembling bytes arithmetically.

from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small lookup table on `device`, made once: a host-to-device copy per call would not be allowed
    inside a CUDA graph capture (engine/cuda_graphs.py), and costs a sync besides."""
    return torch.tensor(values, dtype=dtype, device=device)


def as_blocks(raw: torch.Tensor, type_size: int) -> torch.Tensor:
    """View `[..., n_blocks * type_size]` uint8 rows as `[..., n_blocks, type_size]` blocks."""
    if raw.dtype != torch.uint8:
        raise TypeError(f"raw GGUF blocks must be a uint8 tensor, got {raw.dtype}")
    if raw.dim() == 0 or raw.shape[-1] % type_size != 0:
        raise ValueError(f"row of {tuple(raw.shape)} bytes is not a whole number of {type_size}-byte blocks")
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // type_size, type_size)


def to_rows(values: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Merge per-block values `[..., n_blocks, <one block>]` into rows `[..., n_blocks * block_size]`."""
    # Sizes are spelled out (no -1) so that tensors with zero rows reshape too.
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * block_size)


def f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of every block, widened to float32, shaped `[..., n_blocks, 1]`."""
    # The 2-byte slice is strided (one per block); `.contiguous()` packs it so the dtype view is legal.
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def low_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., n]` -> 4-bit values `[..., 2 * n]`: all low nibbles first, then all high nibbles.

    This is the order every 4-bit GGUF type uses inside a group of bytes: byte j holds element j in its low
    nibble and element j + n in its high nibble.
    """
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def bits_le(packed: torch.Tensor) -> torch.Tensor:
    """Bytes `[..., n]` -> bits `[..., 8 * n]` (0 or 1, uint8), bit i of the little-endian integer at index i."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
