"""Launch parameters are data: `configs/kernels/<target>.json`, written by `vegaserve tune`; a fixed rule per
backend is the fallback. The target is the active Triton target (`cuda_sm90`, `hip_gfx906`, ...), never a
hard-coded device name in a launcher.

File format:
    {"target": "cuda_sm90", "source": "how the entries were measured",
     "matvec": {"Q4_K": {"28672x4096": {"1": {"kernel": "pieces", "block_n": 16, ...}, "8": {...}},
                         "medium": {...}, "any": {"1": {"kernel": "pieces"}, "8": {"kernel": "int8"}}}},
     "matvec_canonical": {...},
     "experts": {"MXFP4": {"5760x2880": {"4": {"split_k": 4}, "32": {"split_k": 1}}}},
     "gemm": {"Q4_K": {"28672x4096": {"16": {"block_m": 16, "block_n": 64, "split_k": 4}, ...}, ...}},
     "prefill": {"dense_from_m": 129, "scratch_dtype": "bfloat16", "scratch_mib": 1024},
     "allreduce": {"gate_bytes": 524288, "block": 1024, "num_warps": 4}}
`matvec` holds the decode mat-vec of repacked weights (1..8 rows), `matvec_canonical` of weights kept in
GGUF's blocks (`--no-repack`), `experts` the decode mat-vec of a repacked stack of experts (one expert's
N x K) by assignments a launch (tokens x experts a token; each is one expert at one row): an entry there
replaces the `matvec` entry of one expert at one row (its kernel where it names none), so a launch of many
assignments can split K less than one of few; `gemm` the quantized GEMM's launch parameters from 9 rows up to
`dense_from_m` (either layout; gemm.quant_gemm), where the dequantize + vendor GEMM path takes over, its
scratch (one buffer for every layer) at most `scratch_mib` (a larger matrix or stack of experts goes through
it a window of rows at a time). `allreduce` holds the custom AllReduce's size gate (larger messages take NCCL / RCCL)
and its launch parameters. An entry names its kernel (triton_kernels/matvec.py) and launch parameters; those it
leaves out come from the kernel's rule. Shape keys: the exact shape ("4096x14336", N x K) first, then its
class (`small` N*K < 2^22, `medium` < 2^26, `large`), then `any`. A row count takes the entry of the
nearest measured count at or above it, else the largest. Without an entry: the backend's fallback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "kernels"

# Fallback per backend, where the file has no entry:
# NVIDIA (warp 32, tensor cores) and gfx906 (wave64, no matrix cores): the tile kernel on 16 rows and 16
# blocks a program. NVIDIA: the quantized GEMM from 9 to 128 rows (H100: 1.7-2.7x faster than the
# dequantize + cuBLAS path at 16-64 rows on the Llama-3-8B shapes, 1.3-1.5x slower at 256), then the vendor
# GEMM on a dequantized scratch copy in bf16. gfx906: the vendor GEMM from 9 rows, in fp16 (its fastest GEMM
# type; it has no bf16 units), until the quantized GEMM is measured there (without matrix cores its tl.dot
# is FMA).
# The prefill scratch: at most 1 GiB (the largest stack of Qwen3.6-35B-A3B's experts, 256 x 1024 x 2048 in
# bf16, still in one piece; gpt-oss-120b's gate/up stack, 4.2 GB, in five windows).
# The AllReduce gate: 512 KiB, vLLM's bound for its one-shot AllReduce, until our own is measured on
# several GPUs (the timing issue that follows issue 29); blocks of 1024 f32, 4 warps (4 waves on gfx906).
_ALLREDUCE = {"gate_bytes": 512 * 1024, "block": 1024, "num_warps": 4}
_FALLBACK: dict[str, dict[str, Any]] = {
    "cuda": {"matvec": {"kernel": "tiles", "block_n": 16, "nb": 16, "split_k": 1, "num_warps": 4},
             "dense_from_m": 129, "scratch_dtype": "bfloat16", "scratch_mib": 1024,
             "allreduce": _ALLREDUCE},
    "hip": {"matvec": {"kernel": "tiles", "block_n": 16, "nb": 16, "split_k": 1, "num_warps": 4},
            "dense_from_m": 9, "scratch_dtype": "float16", "scratch_mib": 1024,
            "allreduce": _ALLREDUCE},
}
TABLES = ("matvec", "matvec_canonical")  # the decode mat-vec tables; `gemm` is the GEMM's
SHAPE_CLASSES = ("small", "medium", "large")


def shape_class(n: int, k: int) -> str:
    size = n * k
    return "small" if size < 2**22 else "medium" if size < 2**26 else "large"


def active_target() -> str:
    """`cuda_sm90`, `hip_gfx906`, ... from Triton's active driver; `cpu` without a GPU."""
    try:
        from triton.runtime import driver

        t = driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no GPU driver: the interpreter or a CPU-only machine
        return "cpu"
    arch = f"sm{t.arch}" if t.backend == "cuda" else str(t.arch)
    return f"{t.backend}_{arch}"


@dataclass
class Tuning:
    target: str
    table: dict[str, Any] = field(default_factory=dict)
    file: str | None = None

    @property
    def backend(self) -> str:
        return self.target.split("_", 1)[0] if self.target != "cpu" else "cuda"

    def matvec(self, type_name: str, n: int, k: int, m: int, repacked: bool = True) -> dict[str, Any]:
        """The decode mat-vec entry of an N x K matrix of `type_name` at m rows: {"kernel": name, launch
        parameters...}, the file's where it has one, else the backend's fallback."""
        found = self._entry("matvec" if repacked else "matvec_canonical", type_name, n, k, m)
        return found if found is not None else dict(_FALLBACK[self.backend]["matvec"])

    def gemm(self, type_name: str, n: int, k: int, m: int) -> dict[str, int]:
        """The quantized GEMM's launch parameters for an N x K matrix at m rows (9 to dense_from_m - 1): the
        file's entry where it has one, else {} (the launcher's rule, gemm.gemm_rule)."""
        return self._entry("gemm", type_name, n, k, m) or {}

    def experts(self, type_name: str, n: int, k: int, assignments: int) -> dict[str, Any] | None:
        """The `experts` entry of a stack of N x K experts at `assignments` a launch, or None."""
        return self._entry("experts", type_name, n, k, assignments)

    def expert_counts(self, type_name: str, n: int, k: int) -> list[int]:
        """The assignment counts the `experts` table measured for a stack of N x K experts, ascending."""
        return sorted(int(a) for a in self._by_m("experts", type_name, n, k))

    def _entry(self, table: str, type_name: str, n: int, k: int, m: int) -> dict[str, Any] | None:
        by_m = self._by_m(table, type_name, n, k)
        measured = sorted(int(x) for x in by_m)
        if not measured:
            return None
        return dict(by_m[str(next((x for x in measured if x >= m), measured[-1]))])

    def _by_m(self, table: str, type_name: str, n: int, k: int) -> dict[str, Any]:
        by_type = self.table.get(table, {}).get(type_name, {})
        return by_type.get(f"{n}x{k}") or by_type.get(shape_class(n, k)) or by_type.get("any") or {}

    @property
    def dense_from_m(self) -> int:
        return int(self.table.get("prefill", {}).get("dense_from_m", _FALLBACK[self.backend]["dense_from_m"]))

    @property
    def scratch_dtype(self) -> str:
        return str(self.table.get("prefill", {}).get("scratch_dtype", _FALLBACK[self.backend]["scratch_dtype"]))

    @property
    def scratch_mib(self) -> int:
        return int(self.table.get("prefill", {}).get("scratch_mib", _FALLBACK[self.backend]["scratch_mib"]))

    @property
    def allreduce(self) -> dict[str, int]:
        """The custom AllReduce's gate_bytes, block and num_warps: the file's where it sets them."""
        return {**_FALLBACK[self.backend]["allreduce"], **self.table.get("allreduce", {})}


def load_tuning(target: str | None = None, path: str | Path | None = None) -> Tuning:
    target = target or active_target()
    file = Path(path) if path else CONFIG_DIR / f"{target}.json"
    if not file.exists():
        return Tuning(target, {}, None)
    return Tuning(target, _read(str(file), file.stat().st_mtime_ns), str(file))


@lru_cache(maxsize=8)
def _read(file: str, mtime_ns: int) -> dict[str, Any]:
    """The file's table, read once per version of it (`vegaserve tune` rewrites it)."""
    return json.loads(Path(file).read_text())
