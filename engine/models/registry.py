"""general.architecture -> model class, and the one function that builds a loaded model from a GGUF."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from vegaserve.engine.distributed.communicator import Communicator
from vegaserve.engine.gguf_file import GGUFFile, ModelLoadError
from vegaserve.engine.layers.linear import CPUMethod, QuantMethod, ReferenceMethod, TritonMethod
from vegaserve.engine.models.arch_config import ArchConfig, arch_config_from_gguf
from vegaserve.engine.models.hybrid import HybridModel
from vegaserve.engine.models.llama import LlamaModel
from vegaserve.engine.models.weights import WeightLoader

log = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "qwen3moe": LlamaModel,
    "qwen2moe": LlamaModel,
    "gpt-oss": LlamaModel,
    "qwen35": HybridModel,
    "qwen35moe": HybridModel,
    "qwen3next": HybridModel,
}


@dataclass
class LoadedModel:
    model: LlamaModel
    arch: ArchConfig
    gguf: GGUFFile


def quant_method_for(device: torch.device, repack: bool, tuning_file: str | None = None,
                     q8_1_cache: bool = True, cpu_int4: bool = True) -> QuantMethod:
    """CPU: CPUMethod (Q4_0, Q4_1 and Q8_0 through torch's int4 kernel, the rest dequantized once, f32
    matmul), or with cpu_int4 off (VEGASERVE_CPU_INT4=0) ReferenceMethod throughout; GPU: the Triton kernels
    on GGUF bytes."""
    if device.type == "cpu":
        return CPUMethod(torch.float32) if cpu_int4 else ReferenceMethod(torch.float32)
    return TritonMethod(repack=repack, tuning_file=tuning_file, q8_1_cache=q8_1_cache)


def load_model(
    gguf: GGUFFile, device: torch.device, max_positions: int, show_progress: bool = True, repack: bool = True,
    tuning_file: str | None = None, comm: Communicator | None = None, layers: range | None = None,
    q8_1_cache: bool = True, shared_split: bool = True, cpu_int4: bool = True,
) -> LoadedModel:
    """The model, or with `comm` one rank's share of it: the `layers` of its pipeline stage, sliced for its
    tensor-parallel lane (models/llama.py). q8_1_cache: the int8 mat-vecs share x's q8_1 copy (config
    kernels.q8_1_cache); shared_split: a shared expert split over the lanes (config kernels.shexp_split)."""
    arch_name = gguf.architecture
    cls = ARCHITECTURES.get(arch_name)
    if cls is None:
        raise ModelLoadError(
            f"{gguf.path}: unknown architecture {arch_name!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    arch = arch_config_from_gguf(gguf.metadata, set(gguf.tensors), str(gguf.path))
    dtype = torch.float32  # activations, norms and the KV cache (f32 until the paged cache arrives)
    model = cls(arch, quant_method_for(device, repack, tuning_file, q8_1_cache, cpu_int4), max_positions, comm, layers,
                shared_split)
    t0 = time.monotonic()
    loader = WeightLoader(gguf, device, dtype, show_progress)
    model.load(loader)
    loader.report_unused()
    model.to(device).eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the repacking's temporaries: the allocator's cache back to the device
    seconds = time.monotonic() - t0
    read = loader.read_bytes
    # the weights' own time and rate (the engine's start adds the KV cache and graphs); `extra` for tools
    log.info("%s: %.2f GB of weights read (-lm %s) and placed in %.1f s, %.2f GB/s", gguf.path.name, read / 1e9,
             gguf.load_mode, seconds, read / seconds / 1e9, extra={"weight_bytes": read, "weight_seconds": seconds})
    return LoadedModel(model, arch, gguf)
