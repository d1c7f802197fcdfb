# The lattice tables the IQ1/IQ2/IQ3 types index, decoded from quants/iq_grids.py (gguf-py's tables, copied by
# a script), and the sign bytes they share.
#
#   grid point e of a table: WIDTH coordinates, coordinate j = MAP[(entry_e >> (BITS * j)) & (2^BITS - 1)]
#       IQ2_XXS 256, IQ2_XS 512, IQ2_S 1024 points of 8 in {8, 25, 43}                BITS 2
#       IQ3_XXS 256 points of 4 in {4, 12, .., 52, 62}, IQ3_S 512 of 4 in {1, 3, .., 15} BITS 4
#       IQ1_S (and IQ1_M) 2048 points of 8 in {-1, 0, 1}                              BITS 2
#   sign byte of a 7-bit index i: i with bit 7 set where i has an odd number of ones, so that the 8 signs of a
#   group always flip an even number of weights (ggml's ksigns, computed here rather than copied).
#
# The kernels read the 16-bit entries themselves (`codes`) and decode them in registers; the torch
# references index the decoded float32 points (`grid`).

from functools import lru_cache

import torch

from vegaserve.triton_kernels.quants import iq_grids

# IQ1_M indexes IQ1_S's table
_TABLE = {"IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S",
          "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_S"}


def _table(name: str) -> tuple[tuple[int, int], tuple[int, ...], bytes]:
    key = _TABLE[name]
    return getattr(iq_grids, f"{key}_SHAPE"), getattr(iq_grids, f"{key}_MAP"), bytes.fromhex(
        "".join(getattr(iq_grids, f"{key}_HEX")))


@lru_cache(maxsize=32)
def codes(name: str, device: torch.device) -> torch.Tensor:
    """The table's entries, int16 (read as unsigned 16-bit), one per grid point, on `device`: made once per
    device (a copy per call could not run inside a CUDA graph capture)."""
    shape, _, raw = _table(name)
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int16)
    if entries.numel() != shape[0]:
        raise ValueError(f"{name}: {entries.numel()} grid entries, expected {shape[0]}")
    return entries.to(device)


@lru_cache(maxsize=32)
def grid(name: str, device: torch.device) -> torch.Tensor:
    """The decoded grid points, float32 [points, WIDTH], on `device`."""
    (points, width), values, raw = _table(name)
    bits = 2 if len(values) <= 4 else 4
    entries = torch.frombuffer(bytearray(raw), dtype=torch.int16).to(torch.int32) & 0xFFFF
    shifts = torch.arange(width, dtype=torch.int32) * bits
    index = (entries[:, None] >> shifts) & ((1 << bits) - 1)
    return torch.tensor(values, dtype=torch.float32)[index].reshape(points, width).to(device)


@lru_cache(maxsize=32)
def grid_words(name: str, device: torch.device) -> torch.Tensor:
    """The grid points as int8 coordinates, 4 to an int32 word (coordinate j in byte j % 4 of word
    WIDTH / 4 * point + j // 4), on `device`: what the int8 mat-vec gathers (made once per device)."""
    points = grid(name, torch.device("cpu"))
    return points.to(torch.int8).reshape(-1).view(torch.int32).to(device)


def sign_bytes(index: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (any integer dtype) -> the sign bytes, int32: bit 7 the parity of the other seven."""
    i = index.to(torch.int32) & 127
    parity = i ^ (i >> 4)
    parity = parity ^ (parity >> 2)
    parity = (parity ^ (parity >> 1)) & 1
    return i | (parity << 7)


def signs(sign_byte: torch.Tensor) -> torch.Tensor:
    """Sign bytes `[...]` -> `[..., 8]` float32 factors: -1 where bit j is set, else +1."""
    bit = (sign_byte.to(torch.int32)[..., None] >> torch.arange(8, dtype=torch.int32, device=sign_byte.device)) & 1
    return 1.0 - 2.0 * bit.to(torch.float32)


def u32(four_bytes: torch.Tensor) -> torch.Tensor:
    """`[..., 4]` uint8 -> `[...]` int64 of the little-endian unsigned 32-bit value."""
    b = four_bytes.to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def u16(two_bytes: torch.Tensor) -> torch.Tensor:
    """`[..., 2]` uint8 -> `[...]` int32 of the little-endian unsigned 16-bit value."""
    b = two_bytes.to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8)
