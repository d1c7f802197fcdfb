"""Hands GGUF tensors to the layers that load them, checking names, shapes and types on the way."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from tqdm import tqdm

from vegaserve.engine.gguf_file import GGUFFile
from vegaserve.engine.layers.linear import WeightSource, check_shape, dequantize_source

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightLoader:
    def __init__(self, gguf: GGUFFile, device: torch.device, dtype: torch.dtype, show_progress: bool = True) -> None:
        self.gguf = gguf
        self.device = device
        self.dtype = dtype
        self.show_progress = show_progress
        self.used: set[str] = set()
        self.read: set[str] = set()  # the tensors read (a lane reads a sliced tensor whole)

    def __contains__(self, name: str) -> bool:
        return name in self.gguf

    def source(self, name: str, shape: tuple[int, ...] | None = None) -> WeightSource:
        """The tensor's canonical bytes; with `shape`, checked against the whole tensor the model expects
        (before any lane slices it)."""
        self.used.add(name)
        src = WeightSource(self.gguf.info(name), self.gguf.raw(name), str(self.gguf.path))
        self.read.add(name)
        if shape is not None:
            check_shape(src, tuple(shape))
        return src

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized to a dense `dtype` (default: the model's compute dtype) on the device."""
        w = dequantize_source(self.source(name), tuple(shape), dtype or self.dtype)
        return w.to(self.device)

    def vector(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Norm weights, biases, frequency factors: always f32."""
        return self.dense(name, tuple(shape), torch.float32)

    @property
    def read_bytes(self) -> int:
        return sum(self.gguf.tensors[name].n_bytes for name in self.read)

    def names(self) -> list[str]:
        return list(self.gguf.tensors)

    def skip(self, names: Iterable[str]) -> None:
        """Tensors another rank loads: not reported as unused here."""
        self.used.update(names)

    def progress(self, items: Iterable[T]) -> Iterator[T]:
        items = list(items)
        yield from tqdm(items, desc=f"loading {self.gguf.path.name}", unit="layer", disable=not self.show_progress, leave=False)

    def report_unused(self) -> None:
        unused = sorted(set(self.gguf.tensors) - self.used)
        if unused:
            log.warning("%s: %d tensor(s) not used by the model: %s", self.gguf.path, len(unused), ", ".join(unused[:8]))
