"""The per-type repack table (issue 3), in the form of the llama.cpp fork's: for each weight type, the
planes of its repacked layout, then prefill and generation of the engine's own linear layer (QuantLinear
with TritonMethod, the kernels and tuning file a model load picks) on repacked weights against the same
layer on canonical blocks (`--no-repack`), and the numerics: each layout's relative error against
dequant(W) @ x in float64, and whether the two layouts give the same outputs.

    python benchmarks/repack_table.py [--types Q4_K,Q6_K,...] [--shape 4096x14336] [--prefill 512]
        [--tuning FILE] [--json out.json]

Generation is one row of x (the decode step's matmul: q8_1 quantize and int8 kernel where the tuning file
sends the type, on repacked weights; the tile kernel on canonical ones, which read either layout);
prefill is --prefill rows (the dequantize-to-scratch and vendor-GEMM path above the file's dense_from_m).
Each is timed as the decode graph runs it: graph replays over rotating copies of the layer
(triton_kernels/timing.py), medians. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vegaserve.engine.gguf_file import TensorInfo
from vegaserve.engine.layers.linear import QuantLinear, TritonMethod, WeightSource
from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import plane_fields
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}


def layout_text(type_name: str) -> str:
    """The repacked planes of a type, as the table's second column: '16 B dm+scales, 128 B qs' per block."""
    return ", ".join(f"{size} B {'+'.join(names)}" for names, size in plane_fields(type_name)) + " a block"


def versus(t_new: float, t_old: float) -> str:
    """A speed change as the fork's table gives it: '+12% (10.0 vs 11.2 us)'."""
    return f"{t_old / t_new - 1:+.0%} ({t_new * 1e3:.1f} vs {t_old * 1e3:.1f} us)"


def numerics_text(err: dict[str, dict[str, float]], same: dict[str, bool]) -> str:
    """err[path][layout]: relative errors against float64; same[path]: whether the layouts gave equal
    outputs. 'generation: repacked 1.1e-02, canonical 4.2e-07; prefill: 2.3e-03, identical'."""
    parts = []
    for path in ("generation", "prefill"):
        e = err[path]
        if same[path]:
            parts.append(f"{path}: {e['repacked']:.1e}, identical")
        else:
            parts.append(f"{path}: repacked {e['repacked']:.1e}, canonical {e['canonical']:.1e}")
    return "; ".join(parts)


def layers(type_name: str, n: int, k: int, repack: bool, tuning: str | None, copies: int,
           raw: torch.Tensor) -> list[QuantLinear]:
    """`copies` layers of one matrix (the same bytes), loaded as a model load would with or without repack."""
    tid = TYPE_IDS[type_name]
    method = TritonMethod(repack=repack, tuning_file=tuning)
    out = []
    for _ in range(copies):
        lin = QuantLinear(k, [n], method)
        info = TensorInfo("w", tid, type_name, (n, k), raw.numel(), 0, 0)
        lin.load([WeightSource(info, raw.clone(), "random")], torch.device("cuda"))
        out.append(lin)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,IQ4_NL,MXFP4")
    ap.add_argument("--shape", default="4096x14336", help="NxK of the matrix (default: Llama-3-8B's ffn_down)")
    ap.add_argument("--prefill", type=int, default=512, help="rows of x for the prefill column")
    ap.add_argument("--tuning", default=None, help="tuning file (default: the device's in configs/kernels)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("repack_table needs a GPU")
    n, k = (int(v) for v in args.shape.split("x"))
    print(f"{torch.cuda.get_device_name()}, {n}x{k}, generation M=1, prefill M={args.prefill}")
    print("| type | repacked layout | prefill vs canonical | generation vs canonical | numerics (rel. error vs float64) |")
    print("|---|---|---|---|---|")
    rows = []
    for type_name in args.types.split(","):
        tid = TYPE_IDS[type_name]
        raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n + k)).cuda()
        ref_w = dequantize(raw.reshape(-1), tid, (n, k)).double()
        copies = copies_for(raw.numel())
        times: dict[str, dict[str, float]] = {"generation": {}, "prefill": {}}
        err: dict[str, dict[str, float]] = {"generation": {}, "prefill": {}}
        outs: dict[str, dict[str, torch.Tensor]] = {"generation": {}, "prefill": {}}
        gen = torch.Generator(device="cuda").manual_seed(7)
        xs = {"generation": torch.randn(1, k, device="cuda", generator=gen),
              "prefill": torch.randn(args.prefill, k, device="cuda", generator=gen).to(torch.bfloat16)}
        for name, repack in (("repacked", True), ("canonical", False)):
            held = layers(type_name, n, k, repack, args.tuning, copies, raw)
            for path, x in xs.items():
                y = held[0](x)
                ref = x.double() @ ref_w.T
                outs[path][name] = y
                err[path][name] = float((y.double() - ref).norm() / ref.norm())
                times[path][name] = bench_graph([lambda lin=lin, x=x: lin(x) for lin in held])
            del held
            torch.cuda.empty_cache()
        same = {p: torch.equal(outs[p]["repacked"], outs[p]["canonical"]) for p in outs}
        row = {"type": type_name, "n": n, "k": k, "prefill_m": args.prefill, "ms": times, "rel_err": err,
               "identical": same, "layout": layout_text(type_name)}
        rows.append(row)
        print(f"| {type_name} | {row['layout']} | {versus(times['prefill']['repacked'], times['prefill']['canonical'])} | "
              f"{versus(times['generation']['repacked'], times['generation']['canonical'])} | {numerics_text(err, same)} |",
              flush=True)
        del raw, ref_w
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
