"""Where a quantized matrix's bytes live on the device: canonical GGUF blocks, or repacked planes.

Every GGUF block type is a fixed record of fields (a scale, a min, packed quants, ...). A field is
addressed, for row r and block b of the matrix, at

    base + offset + r * row_stride + b * block_stride     (bytes)

Canonical layout: one buffer, the GGUF rows as they are; every field has row_stride = bytes per row and
block_stride = the block size in bytes, offset = the field's place inside the block.
Repacked layout: each field in its own plane (the K-quants' d, dmin and scales together, one 16-byte head
record a block: HEAD), a plane's rows contiguous and starting at 16-byte aligned addresses, block_stride =
the record's size; so quants load as wide vectors and scales as short runs.
Both describe the same bytes, so one dequantizing tile function per type serves both layouts; repacking
is a gather of bytes (done on the device at load) and costs at most 15 bytes of padding per row and plane.

A mixture-of-experts layer's E matrices of one shape are one PackedWeight too: each expert laid out on its
own as above, one after another, `expert_bytes` apart, so expert e's fields sit at base + e * expert_bytes
with the same offsets and strides as expert 0's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegaserve.triton_kernels.dequant import spec_for

ALIGN = 16
MAX_FIELDS = 4

# type name -> fields as (name, byte offset in the block, size in bytes); the layouts of quants/*.py
FIELDS: dict[str, tuple[tuple[str, int, int], ...]] = {
    "Q4_0": (("d", 0, 2), ("qs", 2, 16)),
    "Q4_1": (("d", 0, 2), ("m", 2, 2), ("qs", 4, 16)),
    "Q5_0": (("d", 0, 2), ("qh", 2, 4), ("qs", 6, 16)),
    "Q5_1": (("d", 0, 2), ("m", 2, 2), ("qh", 4, 4), ("qs", 8, 16)),
    "Q8_0": (("d", 0, 2), ("qs", 2, 32)),
    "IQ4_NL": (("d", 0, 2), ("qs", 2, 16)),
    "MXFP4": (("e", 0, 1), ("qs", 1, 16)),
    "Q4_K": (("dm", 0, 4), ("scales", 4, 12), ("qs", 16, 128)),
    "Q5_K": (("dm", 0, 4), ("scales", 4, 12), ("qh", 16, 32), ("qs", 48, 128)),
    "Q6_K": (("ql", 0, 128), ("qh", 128, 64), ("scales", 192, 16), ("d", 208, 2)),
    "Q2_K": (("scales", 0, 16), ("qs", 16, 64), ("dm", 80, 4)),
    "Q3_K": (("hmask", 0, 32), ("qs", 32, 64), ("scales", 96, 12), ("d", 108, 2)),
    "IQ4_XS": (("d", 0, 2), ("scales", 2, 6), ("qs", 8, 128)),
    # the lattice types: IQ2_S's qs holds the grid bytes and then the signs (as ggml's block does), IQ3_S's
    # signs run on into its scales (four fields at most)
    "IQ2_XXS": (("d", 0, 2), ("qs", 2, 64)),
    "IQ2_XS": (("d", 0, 2), ("qs", 2, 64), ("scales", 66, 8)),
    "IQ2_S": (("d", 0, 2), ("qs", 2, 64), ("qh", 66, 8), ("scales", 74, 8)),
    "IQ3_XXS": (("d", 0, 2), ("qs", 2, 64), ("scales_signs", 66, 32)),
    "IQ3_S": (("d", 0, 2), ("qs", 2, 64), ("qh", 66, 8), ("signs_scales", 74, 36)),
    "IQ1_S": (("d", 0, 2), ("qs", 2, 32), ("qh", 34, 16)),
    "IQ1_M": (("qs", 0, 32), ("qh", 32, 16), ("scales", 48, 8)),
    "F16": (("w", 0, 2),),
    "BF16": (("w", 0, 2),),
    "F32": (("w", 0, 4),),
}


# fields that share one plane, a record of their bytes per block: the K-quants' d, dmin and 12 scale bytes
# are one 16-byte head record, which a kernel loads as four words with the lanes of a warp along the row
# (matvec_int8's Q4_K pieces kernel); IQ4_XS's d and 6 scale bytes one 8-byte record; every other field has
# a plane of its own
HEAD = {"Q4_K": ("dm", "scales"), "Q5_K": ("dm", "scales"), "IQ4_XS": ("d", "scales")}


@dataclass(frozen=True)
class Field:
    offset: int
    row_stride: int
    block_stride: int


@dataclass
class PackedWeight:
    """A [N, K] matrix of one GGUF type on the device, in either layout."""

    data: torch.Tensor  # uint8, the whole buffer
    type_id: int
    n: int
    k: int
    fields: tuple[Field, ...]
    repacked: bool
    experts: int = 1  # matrices stacked, each [n, k] (stack_experts)
    expert_bytes: int = 0  # the distance between two experts' bytes

    @property
    def type_name(self) -> str:
        return spec_for(self.type_id).name

    @property
    def block_size(self) -> int:
        return spec_for(self.type_id).block_size

    def field_args(self) -> list[int]:
        """offset, row_stride, block_stride of MAX_FIELDS fields, flattened (unused ones are zeros)."""
        out: list[int] = []
        for i in range(MAX_FIELDS):
            f = self.fields[i] if i < len(self.fields) else Field(0, 0, 0)
            out += [f.offset, f.row_stride, f.block_stride]
        return out


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def canonical(raw: torch.Tensor, type_id: int, n: int, k: int) -> PackedWeight:
    """Wrap GGUF rows [n, row_bytes] (uint8, any device) without moving a byte."""
    spec = spec_for(type_id)
    row_bytes = k // spec.block_size * spec.type_size
    raw = raw.reshape(n, row_bytes).contiguous()
    fields = tuple(Field(off, row_bytes, spec.type_size) for _, off, _ in FIELDS[spec.name])
    return PackedWeight(raw.reshape(-1), type_id, n, k, fields, repacked=False)


def repack(raw: torch.Tensor, type_id: int, n: int, k: int) -> PackedWeight:
    """Gather each field into its own aligned plane. Runs where `raw` is (the GPU at load)."""
    spec = spec_for(type_id)
    nblk = k // spec.block_size
    blocks = raw.reshape(n, nblk, spec.type_size)
    planes = _planes(spec.name)
    strides = [_round_up(nblk * size, ALIGN) for _, size, _ in planes]
    data = torch.zeros(sum(strides) * n, dtype=torch.uint8, device=raw.device)
    fields = []
    start = 0
    for (off, size, members), row_stride in zip(planes, strides, strict=True):
        plane = data[start : start + row_stride * n].view(n, row_stride)
        plane[:, : nblk * size] = blocks[:, :, off : off + size].reshape(n, nblk * size)
        fields += [Field(start + f_off - off, row_stride, size) for f_off in members]
        start += row_stride * n
    return PackedWeight(data, type_id, n, k, tuple(fields), repacked=True)


def stack_experts(raw: torch.Tensor, type_id: int, experts: int, n: int, k: int, repacked: bool = True,
                  device: torch.device | None = None) -> PackedWeight:
    """E matrices [n, k] of GGUF rows (raw: experts * n rows, expert-major) as one PackedWeight on `device`
    (default: raw's), each expert in the layout `repacked` picks, expert_bytes apart. The experts are moved
    and laid out one at a time into the stack's buffer, so a load holds the stack and one expert more, not
    the raw stack beside its copies."""
    rows = raw.reshape(experts, n, -1)
    device = raw.device if device is None else torch.device(device)
    build = repack if repacked else canonical
    first = build(rows[0].to(device), type_id, n, k)
    size = first.data.numel()
    data = torch.empty(experts * size, dtype=torch.uint8, device=device)
    data[:size] = first.data
    for e in range(1, experts):
        data[e * size : (e + 1) * size] = build(rows[e].to(device), type_id, n, k).data
    return PackedWeight(data, type_id, n, k, first.fields, repacked, experts, size)


def expert(w: PackedWeight, e: int) -> PackedWeight:
    """Expert e of a stack as a plain matrix (a view of its bytes)."""
    if not 0 <= e < w.experts:
        raise IndexError(f"expert {e} of {w.experts}")
    return PackedWeight(w.data[e * w.expert_bytes : (e + 1) * w.expert_bytes], w.type_id, w.n, w.k, w.fields,
                        w.repacked)


def plane_fields(type_name: str) -> list[tuple[tuple[str, ...], int]]:
    """The repacked planes of a type as (the names of the fields in a record, the record's bytes a block)."""
    names = {off: name for name, off, _ in FIELDS[type_name]}
    return [(tuple(names[o] for o in members), size) for _, size, members in _planes(type_name)]


def _planes(type_name: str) -> list[tuple[int, int, tuple[int, ...]]]:
    """The repacked planes of a type, in field order: (offset in the block, record size, offsets of the
    fields in it). The fields of a plane are neighbours in the block (HEAD)."""
    shared = HEAD.get(type_name, ())
    planes: list[tuple[int, int, tuple[int, ...]]] = []
    for name, off, size in FIELDS[type_name]:
        if name in shared[1:]:
            first, record, members = planes[-1]
            planes[-1] = (first, record + size, (*members, off))
        else:
            planes.append((off, size, (off,)))
    return planes


def unpack_to_canonical(w: PackedWeight) -> torch.Tensor:
    """The GGUF rows [n, row_bytes] back from either layout (tests, and the torch reference path)."""
    spec = spec_for(w.type_id)
    nblk = w.k // spec.block_size
    if not w.repacked:
        return w.data.view(w.n, -1)
    out = torch.empty(w.n, nblk, spec.type_size, dtype=torch.uint8, device=w.data.device)
    first = 0  # index of the plane's first field, which starts its record
    for off, size, members in _planes(spec.name):
        f = w.fields[first]
        first += len(members)
        plane = w.data[f.offset : f.offset + f.row_stride * w.n].view(w.n, f.row_stride)
        out[:, :, off : off + size] = plane[:, : nblk * size].reshape(w.n, nblk, size)
    return out.view(w.n, -1)
