"""`vegaserve tune`: measure the decode mat-vecs on this GPU and write configs/kernels/<target>.json.

For each weight type, shape class (one representative shape each) and row count: the tile kernel's
candidates (matmul.matvec), and for the types with an int8-dot kernel (matvec_int8.py) the word-tile
rule's candidates (on NVIDIA sm_80+ also the lanes kernels', matvec_mma.py), its time counted with the
q8_1 quantize launch it needs. Every
candidate's result is checked first (against the f32 product of the reference dequantizer, or for int8
against the product on the dequantized q8_1 activation): one off by more than 1e-4 is discarded, since a
miscompile must never win on speed. Times are graph replays over rotating weight copies (timing.py), as
the decode graph runs the kernels. Written: the fastest tile config ("matvec"), the fastest int8 config
("matvec_int8"), and per type the decode kernel ("matvec_kernel"): int8 where it won at every class and
row count measured, else tiles. Entries for other types or classes are kept.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from vegaserve.triton_kernels import matvec_int8
from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import PackedWeight, repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import SUPPORTED, matvec
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for
from vegaserve.triton_kernels.tuning import CONFIG_DIR, active_target, shape_class

CANDIDATES = [
    {"block_n": bn, "nb": nb, "split_k": sk} for bn in (8, 16, 32) for nb in (8, 16, 32) for sk in (1, 4)
]
SHAPES = {"small": (2048, 2048), "medium": (14336, 4096), "large": (28672, 4096)}
MAX_ERROR = 1e-4

Log = Callable[[str], None]


def choose_kernel(timings: list[tuple[float, float | None]]) -> str:
    """The decode kernel of a type from (tile ms, int8 ms with its quantize launch or None) at each class
    and row count measured: int8 only where it was measured and faster everywhere."""
    if timings and all(t8 is not None and t8 < tt for tt, t8 in timings):
        return "int8"
    return "tiles"


def _fastest(label: str, candidates: list[tuple[dict, Callable[[PackedWeight], torch.Tensor]]],
             error: Callable[[torch.Tensor], float], rotation: list[PackedWeight], log: Log) -> tuple[float, dict]:
    best = None
    for cfg, fn in candidates:
        e = error(fn(rotation[0]))
        if not e <= MAX_ERROR:  # NaN included
            log(f"{label} {cfg}: relative error {e:.2e}, discarded")
            continue
        t = bench_graph([lambda wi=wi, fn=fn: fn(wi) for wi in rotation])
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError(f"{label}: no candidate computed the right result")
    return best


def tune(types: list[str], classes: list[str], rows: list[int], out: Path | None = None,
         log: Log = lambda s: print(s, file=sys.stderr)) -> Path:
    if not torch.cuda.is_available():
        raise RuntimeError("vegaserve tune needs a GPU")
    target = active_target()
    out = out or CONFIG_DIR / f"{target}.json"
    table = json.loads(out.read_text()) if out.exists() else {}
    table["target"] = target
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = {s.name: t for t, s in GGML_TYPES.items()}
    for type_name in types:
        tid = names[type_name]
        if tid not in SUPPORTED:
            raise ValueError(f"no kernel for {type_name}")
        timings: list[tuple[float, float | None]] = []
        for cls in classes:
            n, k = SHAPES[cls]
            assert shape_class(n, k) == cls
            raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n)).cuda()
            w = repack(raw, tid, n, k)
            dense = dequantize(unpack_to_canonical(w).reshape(-1), tid, (n, k))
            rotation = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(copies_for(raw.numel()) - 1)]
            for m in rows:
                label = f"{type_name} {cls} M={m}"
                x = torch.randn(m, k, device="cuda")
                ref = x @ dense.T
                t_tiles, cfg = _fastest(
                    label, [(c, lambda wi, c=c: matvec(x, wi, **c)) for c in CANDIDATES],
                    lambda y: float((y - ref).norm() / ref.norm()), rotation, log)
                table.setdefault("matvec", {}).setdefault(type_name, {}).setdefault(cls, {})[str(m)] = cfg
                gbps = raw.numel() / (t_tiles * 1e-3) / 1e9
                line = f"{type_name:7s} {cls:6s} M={m}: tiles {t_tiles * 1e3:8.1f} us {gbps:6.0f} GB/s {cfg}"
                t_int8 = None
                if tid in matvec_int8.SUPPORTED:
                    q8 = matvec_int8.quantize_q8_1(x)
                    xq = (q8[0].float().view(m, -1, 32) * q8[1][..., None]).view(m, k)
                    ref_q = xq @ dense.T
                    t_q = bench_graph([lambda: matvec_int8.quantize_q8_1(x)] * len(rotation))
                    calls = [(c, lambda wi, c=c: matvec_int8.matvec_int8(x, wi, **c, q8_1=q8))
                             for c in matvec_int8.candidates(tid, n, k, m, sms, matvec_int8.has_matrix_units(x.device))]
                    t8, cfg8 = _fastest(
                        label + " int8", calls,
                        lambda y: float((y - ref_q).norm() / ref_q.norm()), rotation, log)
                    table.setdefault("matvec_int8", {}).setdefault(type_name, {}).setdefault(cls, {})[str(m)] = cfg8
                    t_int8 = t8 + t_q
                    line += f" | int8 {t8 * 1e3:.1f} + q8_1 {t_q * 1e3:.1f} us {cfg8}"
                timings.append((t_tiles, t_int8))
                log(line)
            del w, dense, raw, rotation
        table.setdefault("matvec_kernel", {})[type_name] = choose_kernel(timings)
        log(f"{type_name}: decode mat-vec {table['matvec_kernel'][type_name]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    return out
