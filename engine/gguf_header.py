"""The header of one GGUF file, read and checked against the file's size before anything is built from it.

A GGUF header is counts and lengths followed by what they count: a metadata array declares its element
count, a string its byte length, the file its tensor and key counts. gguf-py's reader trusts them and walks
element by element, building a numpy view per element, so a 51-byte file that declares 2**62 array elements
grows the process without end. Here every declared count, length and offset is held against the bytes left
in the file before it is used, so a damaged or hostile header costs time and memory in proportion to the
file's size (arrays are capped too, at MAX_ARRAY_ELEMENTS), and fails with one line naming the field.

Layout (GGUF v2 and v3, little-endian; gguf-py's `GGUFValueType` numbers the value types):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, dims u64[n_dims] (ggml order), type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data, each tensor at data start + its offset

    string = length u64 | bytes (UTF-8);  array = item_type u32 | count u64 | count x item

Values come out as gguf-py's `ReaderField.contents()` gives them: Python ints, floats, bools, str, and lists.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
# The longest metadata array a model carries is its vocabulary (262,144 tokens in Gemma 3); a list of this many
# Python values is already ~600 MB, so a longer declared array is refused rather than built.
MAX_ARRAY_ELEMENTS = 1 << 24

_NUMERIC = {  # value type -> numpy little-endian dtype
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}  # fmt: skip
_ITEM_BYTES = {t: np.dtype(d).itemsize for t, d in _NUMERIC.items()} | {GGUFValueType.STRING: 8}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


class GGUFFormatError(ValueError):
    """A header field that cannot be right; str() is `<field>: <what is wrong>`, one line."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_id: int  # a GGMLQuantizationType value
    dims: tuple[int, ...]  # ggml order: dims[0] is the row (contiguous) length
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    alignment: int
    data_offset: int  # absolute offset of the data section


class _Cursor:
    """Reads little-endian fields from a buffer of `size` bytes, each checked to lie inside it."""

    def __init__(self, buf: mmap.mmap | bytes, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def take(self, n: int, field: str, what: str) -> int:
        """Claims the next `n` bytes; returns where they start."""
        if n > self.size - self.pos:
            raise GGUFFormatError(
                f"{field}: {what} needs {n} bytes at offset {self.pos}, but the file ends at {self.size} "
                "(damaged or truncated GGUF header)"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, field: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, field, "a 32-bit integer"))[0]

    def u64(self, field: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, field, "a 64-bit integer"))[0]

    def string(self, field: str) -> str:
        n = self.u64(field)
        start = self.take(n, field, "the string")
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(
                f"{field}: the string at offset {start} is not valid UTF-8 (byte {e.start})"
            ) from None

    def value_type(self, field: str) -> GGUFValueType:
        raw = self.u32(field)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFormatError(f"{field}: unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType, field: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(field)
        if vtype == GGUFValueType.ARRAY:
            return self.array(field)
        size = _ITEM_BYTES[vtype]
        start = self.take(size, field, f"a {vtype.name} value")
        return np.frombuffer(self.buf, _NUMERIC[vtype], 1, start).tolist()[0]

    def array(self, field: str) -> list[Any]:
        item = self.value_type(field + " (array item type)")
        if item == GGUFValueType.ARRAY:
            raise GGUFFormatError(f"{field}: arrays of arrays are not supported")  # nor by llama.cpp
        count = self.u64(field + " (array length)")
        # Each element takes at least this many bytes: a count the rest of the file cannot hold is refused
        # before a single element is read.
        least = count * _ITEM_BYTES[item]
        if least > self.size - self.pos:
            raise GGUFFormatError(
                f"{field}: an array of {count} {item.name} values needs at least {least} bytes at offset "
                f"{self.pos}, but the file ends at {self.size} (damaged or truncated GGUF header)"
            )
        if count > MAX_ARRAY_ELEMENTS:
            raise GGUFFormatError(f"{field}: an array of {count} {item.name} values is longer than the "
                                  f"{MAX_ARRAY_ELEMENTS} any model's metadata holds")
        if item != GGUFValueType.STRING:
            start = self.take(least, field, "the array")
            return np.frombuffer(self.buf, _NUMERIC[item], count, start).tolist()
        return [self.string(f"{field} element {i}") for i in range(count)]


def read_header(buf: mmap.mmap | bytes, size: int) -> Header:
    """Parses and checks the header in `buf` (the whole file, `size` bytes); raises GGUFFormatError."""
    c = _Cursor(buf, size)
    if bytes(buf[:4]) != MAGIC:
        raise GGUFFormatError(f"magic: expected {MAGIC!r}, found {bytes(buf[:4])!r}")
    c.pos = 4
    version = c.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version >> 16 in SUPPORTED_VERSIONS:
            raise GGUFFormatError("version: a big-endian GGUF file; only little-endian files are supported")
        raise GGUFFormatError(f"version: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = c.u64("tensor_count"), c.u64("kv_count")
    for count, name, least in ((n_kv, "kv_count", _MIN_KV_BYTES), (n_tensors, "tensor_count", _MIN_TENSOR_INFO_BYTES)):
        if count * least > size - c.pos:
            raise GGUFFormatError(
                f"{name}: {count} entries need at least {count * least} bytes, but the file has {size - c.pos} "
                "after the header (damaged or truncated GGUF header)"
            )

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"metadata entry {i} of {n_kv} (key)")
        field = f"metadata key {key!r}"
        if key in metadata:
            raise GGUFFormatError(f"{field}: appears twice")
        metadata[key] = c.value(c.value_type(field + " (value type)"), field)
    alignment = _alignment(metadata)

    entries = []
    for i in range(n_tensors):
        entries.append(_tensor_info(c, f"tensor info {i} of {n_tensors}", alignment))
    data_offset = -(-c.pos // alignment) * alignment
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise GGUFFormatError(f"tensor {entry.name}: appears twice in the tensor index")
        seen.add(entry.name)
        end = data_offset + entry.offset + entry.n_bytes
        if end > size:
            type_name = GGMLQuantizationType(entry.type_id).name
            raise GGUFFormatError(
                f"tensor {entry.name} ({type_name}, shape {list(reversed(entry.dims))}): truncated file: its data "
                f"needs bytes up to {end} but the file has {size}"
            )
    return Header(version, metadata, entries, alignment, data_offset)


def _alignment(metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    # gguf-py stores it as UINT32; a bool or float here is a damaged file, as is 0 or a non-power of two
    if type(value) is not int or value <= 0 or value & (value - 1):
        raise GGUFFormatError(f"metadata key 'general.alignment': {value!r} is not a positive power of two")
    return value


def _tensor_info(c: _Cursor, where: str, alignment: int) -> TensorEntry:
    name = c.string(where + " (name)")
    field = f"{where} ({name!r})"
    n_dims = c.u32(field + " n_dims")
    if n_dims > MAX_DIMS:
        raise GGUFFormatError(f"{field}: n_dims {n_dims} is more than the {MAX_DIMS} a GGML tensor has")
    dims = tuple(c.u64(f"{field} dimension {d}") for d in range(n_dims))
    raw_type = c.u32(field + " type")
    offset = c.u64(field + " offset")
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"{field}: unknown tensor type {raw_type}") from None
    if any(d >= 1 << 63 for d in dims):  # ggml's dimensions are int64
        raise GGUFFormatError(f"{field}: dimension {max(dims)} does not fit in 63 bits")
    row = dims[0] if dims else 1
    if row % block:
        raise GGUFFormatError(f"{field}: a row of {row} elements is not a whole number of "
                              f"{ggml_type.name} blocks of {block}")
    if offset % alignment:
        raise GGUFFormatError(f"{field}: data offset {offset} is not a multiple of the alignment {alignment}")
    n_elements = 1
    for d in dims:
        n_elements *= d
    return TensorEntry(name, int(ggml_type), dims, offset, n_elements // block * type_size)
