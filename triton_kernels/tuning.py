"""Launch parameters are data: `configs/kernels/<target>.json`, keyed by op, weight type and shape class,
written by `vegaserve tune`; a fixed rule per backend is the fallback. The target is the active Triton
target (`cuda_sm90`, `hip_gfx906`, ...), never a hard-coded device name in a launcher.

File format:
    {"target": "cuda_sm90", "matvec": {"Q4_K": {"large": {"1": {...}, "8": {...}}}, ...},
     "matvec_flat": {...keyed like "matvec"...}, "matvec_int8": {...}, "matvec_kernel": {"Q4_K": "int8"},
     "matvec_int8_pairs": false, "prefill": {"dense_from_m": 9}}
Shape classes: `small` (N*K < 2^22), `medium` (< 2^26), `large`; an exact shape key ("4096x14336", N x K)
measured on a model's own matrices comes before its class. Row counts 1..8 map to the nearest measured
count at or above them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "kernels"

# Fallback rules per backend, used where the file has no entry.
# NVIDIA (warp 32, tensor cores): 8-16 rows per program, 512-element k tiles; prefill through the vendor
#   GEMM on a dequantized scratch copy from 9 rows (measured 49-90% of cuBLAS, against 4-7% for the
#   in-register Triton GEMM so far: docs/PERF.md).
# gfx906 (wave64, no matrix cores, fast fp16): wider row tiles to fill 64 lanes, fp16 scratch for hipBLAS.
_FALLBACK: dict[str, dict[str, Any]] = {
    "cuda": {"matvec": {"block_n": 16, "nb": 16, "split_k": 1, "num_warps": 4}, "dense_from_m": 9, "scratch_dtype": "bfloat16"},
    "hip": {"matvec": {"block_n": 16, "nb": 16, "split_k": 1, "num_warps": 4}, "dense_from_m": 9, "scratch_dtype": "float16"},
}


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

    @property
    def backend(self) -> str:
        return self.target.split("_", 1)[0] if self.target != "cpu" else "cuda"

    def measured(self, op: str, type_name: str, n: int, k: int, m: int) -> dict[str, int] | None:
        """The file's launch parameters for `op` at the nearest measured row count at or above m (else the
        largest measured) for the exact shape, else its shape class; None where the file has neither."""
        by_type = self.table.get(op, {}).get(type_name, {})
        by_m = by_type.get(f"{n}x{k}") or by_type.get(shape_class(n, k), {})
        measured = sorted(int(x) for x in by_m)
        if not measured:
            return None
        return dict(by_m[str(next((x for x in measured if x >= m), measured[-1]))])

    def matvec(self, type_name: str, n: int, k: int, m: int) -> dict[str, int]:
        found = self.measured("matvec", type_name, n, k, m)
        return found if found is not None else dict(_FALLBACK[self.backend]["matvec"])

    def matvec_kernel(self, type_name: str) -> str:
        """Which decode mat-vec serves `type_name`: "flat" (matvec_flat.py) or "int8" (matvec_int8.py)
        where the file says so from a side-by-side measurement (benchmarks/matvec_variants.py), else
        "tiles" (matmul.matvec)."""
        return str(self.table.get("matvec_kernel", {}).get(type_name, "tiles"))

    @property
    def matvec_int8_pairs(self) -> bool:
        """Whether a layer's two int8 matrices of different K-quant types (Q4_K q/k beside a Q6_K v) take one
        launch at one row (matvec_int8.matvec_int8_pair) where the file says so from a measurement
        (benchmarks/pair_matvec.py), else one launch each."""
        return bool(self.table.get("matvec_int8_pairs", False))

    @property
    def dense_from_m(self) -> int:
        return int(self.table.get("prefill", {}).get("dense_from_m", _FALLBACK[self.backend]["dense_from_m"]))

    @property
    def scratch_dtype(self) -> str:
        return str(self.table.get("prefill", {}).get("scratch_dtype", _FALLBACK[self.backend]["scratch_dtype"]))


def load_tuning(target: str | None = None, path: str | Path | None = None) -> Tuning:
    target = target or active_target()
    file = Path(path) if path else CONFIG_DIR / f"{target}.json"
    return Tuning(target, _read(str(file)))


@lru_cache(maxsize=8)
def _read(file: str) -> dict[str, Any]:
    p = Path(file)
    if not p.exists():
        return {}
    return json.loads(p.read_text())
