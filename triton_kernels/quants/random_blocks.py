# Valid raw GGUF blocks of any served type, with random codes and finite, moderate scales: what tiny test
# models and kernel benchmarks write, including for the types `gguf.quants` cannot quantize (K-quants,
# the IQ types). Quant bytes are uniformly random (every bit pattern is a valid code); only the scale fields are
# drawn, log-uniformly within a range chosen so that the dequantized weights stay within about +-2, like
# real weights, and never overflow or go non-finite.

from dataclasses import dataclass

import torch

from vegaserve.triton_kernels.dequant import spec_for


@dataclass(frozen=True)
class _ScaleField:
    """A scale inside a block: an f16 at `offset` (or an E8M0 exponent byte when `e8m0`) drawn in [lo, hi]."""

    offset: int
    lo: float
    hi: float
    signed: bool = True
    e8m0: bool = False
    nibbles: bool = False  # the f16's four nibbles are the top nibbles of four u16 at offset (IQ1_M)


# Ranges: max |code| * hi stays near 1 (legacy 4/5-bit codes reach 8/16, Q8_0 127, K-quant sub-scales 63
# times 4/5-bit codes up to 31, Q6_K int8 sub-scales 128 times 32, IQ4_NL levels 127, MXFP4 doubled 12).
_SCALES: dict[str, tuple[_ScaleField, ...]] = {
    "Q4_0": (_ScaleField(0, 1e-3, 3e-2),),
    "Q4_1": (_ScaleField(0, 1e-3, 3e-2, signed=False), _ScaleField(2, 1e-3, 0.25)),
    "Q5_0": (_ScaleField(0, 5e-4, 2e-2),),
    "Q5_1": (_ScaleField(0, 5e-4, 2e-2, signed=False), _ScaleField(2, 1e-3, 0.25)),
    "Q8_0": (_ScaleField(0, 1e-4, 4e-3),),
    "Q4_K": (_ScaleField(0, 1e-4, 2e-3, signed=False), _ScaleField(2, 1e-4, 2e-3, signed=False)),
    "Q5_K": (_ScaleField(0, 5e-5, 1e-3, signed=False), _ScaleField(2, 1e-4, 2e-3, signed=False)),
    "Q6_K": (_ScaleField(208, 1e-5, 3e-4),),
    "IQ4_NL": (_ScaleField(0, 1e-4, 5e-3),),
    # Exponent bytes 118..125: half-scales 2^-10 .. 2^-3.
    "MXFP4": (_ScaleField(0, 118, 125, e8m0=True),),
    # Q2_K: 4-bit sub-scales times 2-bit codes; Q3_K: 6-bit signed sub-scales (to 32) times codes to 4;
    # IQ4_XS: the same sub-scales times levels to 127; IQ2: (s + 0.5) / 4 to 3.9 times grid values to 43;
    # IQ3: (s + 0.5) / 2 or 2s + 1 to 31, times grid values to 62 or 15; IQ1: 2s + 1 to 15 times 1.125.
    "Q2_K": (_ScaleField(80, 5e-4, 2e-2, signed=False), _ScaleField(82, 5e-4, 5e-2, signed=False)),
    "Q3_K": (_ScaleField(108, 1e-4, 8e-3),),
    "IQ4_XS": (_ScaleField(0, 1e-5, 3e-4),),
    "IQ2_XXS": (_ScaleField(0, 1e-4, 6e-3),),
    "IQ2_XS": (_ScaleField(0, 1e-4, 6e-3),),
    "IQ2_S": (_ScaleField(0, 1e-4, 6e-3),),
    "IQ3_XXS": (_ScaleField(0, 5e-5, 2e-3),),
    "IQ3_S": (_ScaleField(0, 5e-5, 2e-3),),
    "IQ1_S": (_ScaleField(0, 1e-3, 5e-2),),
    # IQ1_M keeps its f16 d in the top nibbles of its four u16 scales (at byte 48)
    "IQ1_M": (_ScaleField(48, 1e-3, 5e-2, nibbles=True),),
}

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _draw(count: int, lo: float, hi: float, signed: bool, generator: torch.Generator) -> torch.Tensor:
    """`count` float32 values with magnitudes log-uniform in [lo, hi], each sign equally likely if `signed`."""
    u = torch.rand(count, generator=generator)
    values = lo * (hi / lo) ** u
    if signed:
        values = torch.where(torch.rand(count, generator=generator) < 0.5, -values, values)
    return values


def random_blocks(type_id: int, n_rows: int, n_blocks_per_row: int, generator: torch.Generator) -> torch.Tensor:
    """Raw blocks `[n_rows, n_blocks_per_row * type_size]` uint8 (CPU) of the served type `type_id`."""
    spec = spec_for(type_id)
    n_blocks = n_rows * n_blocks_per_row
    if spec.name in _FLOAT_DTYPES:
        values = torch.rand(n_blocks, generator=generator) * 2.0 - 1.0
        raw = values.to(_FLOAT_DTYPES[spec.name]).view(torch.uint8)
        return raw.reshape(n_rows, n_blocks_per_row * spec.type_size)

    blocks = torch.randint(0, 256, (n_blocks, spec.type_size), dtype=torch.uint8, generator=generator)
    for field in _SCALES[spec.name]:
        if field.e8m0:
            exponent = torch.randint(int(field.lo), int(field.hi) + 1, (n_blocks,), generator=generator)
            blocks[:, field.offset] = exponent.to(torch.uint8)
        elif field.nibbles:
            scale = _draw(n_blocks, field.lo, field.hi, field.signed, generator).to(torch.float16)
            bits = scale.view(torch.int16).to(torch.int32) & 0xFFFF
            top = blocks[:, field.offset + 1 : field.offset + 8 : 2]  # the high byte of each u16
            nibble = (bits[:, None] >> torch.tensor([0, 4, 8, 12])) & 15
            blocks[:, field.offset + 1 : field.offset + 8 : 2] = (top & 15) | (nibble << 4).to(torch.uint8)
        else:
            scale = _draw(n_blocks, field.lo, field.hi, field.signed, generator).to(torch.float16)
            blocks[:, field.offset : field.offset + 2] = scale.view(torch.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, n_blocks_per_row * spec.type_size)
