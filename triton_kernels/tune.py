"""`vegaserve tune`: measure the decode mat-vec kernels on this GPU and write configs/kernels/<target>.json.

For each weight type, shape class (one representative shape each) and row count, every kernel that serves
the type (matvec.KERNELS; lanes only where the GPU has matrix units) is timed over its candidates, an
int8 kernel's time counted with the q8_1 quantize launch it needs. Every candidate's result is checked
first (against the product of the reference dequantizer, for the int8 kernels on the q8_1 activation):
one off by more than 1e-4 is discarded, since a miscompile must never win on speed. Times are graph
replays over rotating weight copies (timing.py), as the decode graph runs the kernels. Written: the
fastest of all as the `matvec` entry, the fastest tile config (which reads either layout) as the
`matvec_canonical` entry. Entries for other types, shapes or classes are kept.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from vegaserve.triton_kernels import matvec_int8, matvec_mma, matvec_pieces
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import PackedWeight, repack
from vegaserve.triton_kernels.matvec import KERNELS, Choice, matvec, reference_matvec
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for
from vegaserve.triton_kernels.tuning import CONFIG_DIR, active_target, shape_class

TILE_CANDIDATES = [
    {"block_n": bn, "nb": nb, "split_k": sk} for bn in (8, 16, 32) for nb in (8, 16, 32) for sk in (1, 4)
]
SHAPES = {"small": (2048, 1024), "medium": (14336, 4096), "large": (28672, 4096)}  # one of each class
MAX_ERROR = 1e-4

Log = Callable[[str], None]


def candidates(type_id: int, n: int, k: int, m: int, sms: int, matrix_units: bool) -> list[Choice]:
    """Every kernel's launch configs for a type, shape and row count."""
    out = [Choice(KERNELS["tiles"], c) for c in TILE_CANDIDATES]
    if type_id in matvec_int8.TYPES:
        out += [Choice(KERNELS["int8"], c) for c in matvec_int8.candidates(type_id, n, k, m, sms)]
    if type_id in matvec_pieces.TYPES:
        out += [Choice(KERNELS["pieces"], c) for c in matvec_pieces.candidates(type_id, n, k, m, sms)]
    if matrix_units and type_id in matvec_mma.TYPES:
        out += [Choice(KERNELS["lanes"], c) for c in matvec_mma.candidates(type_id, n, k, sms)]
    return out


def _fastest(label: str, choices: list[Choice], x: torch.Tensor, rotation: list[PackedWeight],
             t_quantize: float, log: Log) -> tuple[float, Choice]:
    best = None
    q8 = quantize_q8_1(x)
    refs = {}
    for choice in choices:
        int8 = choice.kernel.int8
        if int8 not in refs:
            refs[int8] = reference_matvec(x, rotation[0], choice).float()
        ref = refs[int8]
        try:
            y = matvec(x, rotation[0], choice, q8_1=q8 if int8 else None)
        except ValueError as e:  # a config the launcher refuses
            log(f"{label} {choice.kernel.name} {choice.params}: refused ({e})")
            continue
        e = float((y - ref).norm() / ref.norm())
        if not e <= MAX_ERROR:  # NaN included
            log(f"{label} {choice.kernel.name} {choice.params}: relative error {e:.2e}, discarded")
            continue
        t = bench_graph([lambda wi=wi, c=choice: matvec(x, wi, c, q8_1=q8 if c.kernel.int8 else None)
                         for wi in rotation])
        t += t_quantize if int8 else 0.0
        if best is None or t < best[0]:
            best = (t, choice)
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
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    names = {s.name: t for t, s in GGML_TYPES.items()}
    for type_name in types:
        if type_name not in names:
            raise ValueError(f"no kernel for {type_name}")
        tid = names[type_name]
        for cls in classes:
            n, k = SHAPES[cls]
            assert shape_class(n, k) == cls
            raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n)).to(device)
            w = repack(raw, tid, n, k)
            rotation = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(copies_for(raw.numel()) - 1)]
            for m in rows:
                label = f"{type_name} {cls} M={m}"
                x = torch.randn(m, k, device=device)
                t_q = bench_graph([lambda: quantize_q8_1(x)] * len(rotation))
                all_choices = candidates(tid, n, k, m, sms, matvec_mma.has_matrix_units(device))
                t, best = _fastest(label, all_choices, x, rotation, t_q, log)
                t_tiles, tiles = _fastest(label, [c for c in all_choices if c.kernel.name == "tiles"], x, rotation,
                                          t_q, log)
                entry = {"kernel": best.kernel.name, **best.params}
                table.setdefault("matvec", {}).setdefault(type_name, {}).setdefault(cls, {})[str(m)] = entry
                table.setdefault("matvec_canonical", {}).setdefault(type_name, {}).setdefault(cls, {})[str(m)] = {
                    "kernel": "tiles", **tiles.params}
                gbps = raw.numel() / (t * 1e-3) / 1e9
                log(f"{type_name:7s} {cls:6s} M={m}: {best.kernel.name} {t * 1e3:8.1f} us {gbps:6.0f} GB/s "
                    f"{best.params} | tiles {t_tiles * 1e3:.1f} us")
            del w, raw, rotation
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=2) + "\n")
    return out
