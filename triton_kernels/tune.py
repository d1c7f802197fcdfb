"""`vegaserve tune`: measure mat-vec launch parameters on this GPU and write configs/kernels/<target>.json.

For each weight type, shape class (one representative shape each) and row count, every candidate config
runs on random valid blocks; a config whose result differs from the f32 reference by more than 1e-4 is
discarded (a miscompile must never win on speed), and the fastest remaining one is written. Existing
entries for other types or classes are kept.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import SUPPORTED, matvec
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.tuning import CONFIG_DIR, active_target, shape_class

CANDIDATES = [
    {"block_n": bn, "nb": nb, "split_k": sk} for bn in (8, 16, 32) for nb in (8, 16, 32) for sk in (1, 4)
]
SHAPES = {"small": (2048, 2048), "medium": (14336, 4096), "large": (28672, 4096)}


def _time_ms(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def tune(types: list[str], classes: list[str], rows: list[int], out: Path | None = None,
         log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Path:
    if not torch.cuda.is_available():
        raise RuntimeError("vegaserve tune needs a GPU")
    target = active_target()
    out = out or CONFIG_DIR / f"{target}.json"
    table = json.loads(out.read_text()) if out.exists() else {}
    table["target"] = target
    names = {s.name: t for t, s in GGML_TYPES.items()}
    for type_name in types:
        tid = names[type_name]
        if tid not in SUPPORTED:
            raise ValueError(f"no kernel for {type_name}")
        for cls in classes:
            n, k = SHAPES[cls]
            assert shape_class(n, k) == cls
            raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n)).cuda()
            w = repack(raw, tid, n, k)
            dense = dequantize(unpack_to_canonical(w).reshape(-1), tid, (n, k))
            for m in rows:
                x = torch.randn(m, k, device="cuda")
                ref = x @ dense.T
                best = None
                for cfg in CANDIDATES:
                    y = matvec(x, w, **cfg)
                    if float((y - ref).norm() / ref.norm()) > 1e-4:
                        log(f"{type_name} {cls} M={m} {cfg}: wrong result, discarded")
                        continue
                    t = _time_ms(lambda c=cfg: matvec(x, w, **c))
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is None:
                    raise RuntimeError(f"{type_name} {cls} M={m}: no candidate computed the right result")
                gbps = raw.numel() / (best[0] * 1e-3) / 1e9
                log(f"{type_name:7s} {cls:6s} M={m}: {best[0] * 1e3:8.1f} us  {gbps:6.0f} GB/s  {best[1]}")
                table.setdefault("matvec", {}).setdefault(type_name, {}).setdefault(cls, {})[str(m)] = best[1]
            del w, dense, raw
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    return out
