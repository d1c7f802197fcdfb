"""Decode mat-vec, production kernel (matmul.matvec with the engine's tuned parameters) against the
flat-tile candidate (matvec_flat.py: 16-byte word loads decoded in place, activations read in the
weights' order), in one process, on the same weights and activations, with the copy bandwidth measured
in the same run.

Hypothesis: the production kernel's 3-D tiles are reshaped and converted through shared memory, and it
loads 16 rows x a few blocks per iteration, too little in flight per SM; the flat form keeps each
thread's 16 bytes in registers and sizes split-K from the bytes in flight. Prediction: M=1 at >= 60% of
copy bandwidth for Q8_0, Q4_0, Q4_K and Q6_K (production: 18-39%), M=8 <= 2x M=1.

    python benchmarks/matvec_variants.py [--types Q4_K,Q6_K,Q8_0,Q4_0] [--shapes 28672x4096,...] [--ms 1,8]
        [--kernels flat,int8] [--timer graph|events] [--json out.json] [--write-tuning FILE]

Each flat config is checked against x @ dequant(W)^T (f32) before it is timed; a config whose relative
error exceeds 1e-4 is reported and skipped. Times are medians: with `--timer graph` (the default) of
graph replays of calls on rotating weight copies (triton_kernels/timing.py, what a decode graph sees),
with `--timer events` of triton.testing.do_bench (one call per event pair: launch latency included,
docs/PERF.md compares the two). The ceilings beside them: the copy
bandwidth and torch's sum over as many bytes as the weight, timed the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import matvec
from vegaserve.triton_kernels.matvec_flat import candidates, groups_per_block, matvec_flat, rule
from vegaserve.triton_kernels.matvec_int8 import SUPPORTED as INT8_TYPES
from vegaserve.triton_kernels.matvec_int8 import candidates as int8_candidates
from vegaserve.triton_kernels.matvec_int8 import has_matrix_units, matvec_int8, quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for
from vegaserve.triton_kernels.tuning import load_tuning

from bench_kernels import bench as bench_events  # noqa: E402 - run from benchmarks/ or with it on sys.path
from bench_kernels import copy_bandwidth, read_bandwidth  # noqa: E402

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}


def wide_candidates(type_id: int, k: int, threads_per_warp: int = 32) -> list[dict[str, int]]:
    """A grid around the shipped configs: 16-64 rows per program, tiles of 2-8 super-blocks (8-32
    blocks of 32 for the legacy types), 4 or 8 warps, 1 or 2 K splits, both carry modes; only those
    giving every thread 1 to 8 rows of a group, and K splits that leave each split 2 tiles."""
    qk = GGML_TYPES[type_id].block_size
    out = []
    for block_n, nb, warps, split, carry in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2), (1, 0)):
        blocks = max(1, nb * 32 // qk)
        rows_per_thread = block_n * blocks * groups_per_block(type_id) / (threads_per_warp * warps)
        if 1 <= rows_per_thread <= 8 and (k // qk) // (blocks * split) >= 2:
            out.append({"block_n": block_n, "nb": nb, "num_warps": warps, "split_k": split, "carry": carry})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0")
    ap.add_argument("--shapes", default="28672x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--kernels", default="flat,int8", help="candidates to time beside production: flat, int8")
    ap.add_argument("--timer", choices=("graph", "events"), default="graph",
                    help="graph: calls on rotating weight copies replayed in one CUDA graph, as in the decode "
                         "graph (triton_kernels/timing.py); events: do_bench, one call per event pair after an "
                         "L2 flush (launch latency included)")
    ap.add_argument("--wide", action="store_true",
                    help="int8: time a grid of launch configs (rows per program, tile length, warps, K splits, "
                         "carry) instead of the rule's neighbours; minutes per shape")
    ap.add_argument("--json", default=None, help="write the rows here as a JSON list")
    ap.add_argument("--write-tuning", default=None,
                    help="write the shipped tuning file with \"matvec_kernel\" set to int8 (or else flat) for every "
                         "type where that kernel beat production on every shape and row count timed")
    args = ap.parse_args()
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    tuning = load_tuning()
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs, tuning target {tuning.target}")
    print("| type | shape | M | production | flat rule | flat best | best config | best / production | "
          "int8 best (+ q8_1) | int8 config | int8 / production | "
          "torch sum of as many bytes, % copy bw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.types.split(","):
        tid = TYPE_IDS[name]
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n + k)).cuda()
            w = repack(raw, tid, n, k)
            dense = dequantize(unpack_to_canonical(w).reshape(-1), tid, (n, k))
            nbytes = raw.numel()
            rotation = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(copies_for(nbytes) - 1)]
            t_read = read_bandwidth(nbytes) if args.timer == "graph" else None

            def bench(fn, ws=rotation):  # noqa: F811 - fn(weight) -> result; median ms per call
                if args.timer == "graph":
                    return bench_graph([lambda wi=wi: fn(wi) for wi in ws])
                return bench_events(lambda: fn(w))

            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device="cuda")
                ref = x @ dense.T

                def err(y: torch.Tensor) -> float:
                    return float((y - ref).norm() / ref.norm())

                prod_cfg = tuning.matvec(name, n, k, m)
                e_prod = err(matvec(x, w, **prod_cfg))
                t_prod = bench(lambda wi: matvec(x, wi, **prod_cfg))
                base = rule(tid, n, k, m, sms)
                timed = []
                for cfg in candidates(tid, n, k, m, sms) if "flat" in args.kernels else []:
                    e = err(matvec_flat(x, w, **cfg))
                    if e > 1e-4:
                        print(f"  flat {name} {shape} M={m} {cfg}: relative error {e:.2e}, skipped")
                        continue
                    timed.append((bench(lambda wi, c=cfg: matvec_flat(x, wi, **c)), cfg, e))
                t_rule = next((t for t, c, _ in timed if c == base), float("nan"))
                t_best, cfg_best, e_best = min(timed, key=lambda r: r[0]) if timed else (float("nan"), None, None)

                def pct(t: float) -> str:
                    return f"{t * 1e3:.1f} us ({nbytes / (t * 1e-3) / bw:.1%})"

                int8_cols, t_int8, cfg_int8, t_q = "| - | - | - | - |", None, None, None
                if tid in INT8_TYPES and "int8" in args.kernels:
                    q8 = quantize_q8_1(x)
                    t_q = bench(lambda wi: quantize_q8_1(x))
                    xd = (q8[0].float().view(m, -1, 32) * q8[1][..., None]).view(m, k)
                    ref_q = xd @ dense.T

                    def time_int8(cfg: dict) -> float | None:
                        e = float((matvec_int8(x, w, **cfg, q8_1=q8) - ref_q).norm() / ref_q.norm())
                        if e > 1e-4:
                            print(f"  int8 {name} {shape} M={m} {cfg}: relative error {e:.2e}, skipped")
                            return None
                        return bench(lambda wi: matvec_int8(x, wi, **cfg, q8_1=q8))

                    for cfg in (wide_candidates(tid, k) if args.wide else int8_candidates(tid, n, k, m, sms, has_matrix_units(x.device))):
                        t = time_int8(cfg)
                        if t is not None and (t_int8 is None or t < t_int8):
                            t_int8, cfg_int8 = t, cfg
                    for more in (2, 4) if cfg_int8 else ():  # more K splits of the best: more programs in flight
                        c = {**cfg_int8, "split_k": cfg_int8["split_k"] * more}
                        t = time_int8(c)
                        if t is not None and t < t_int8:
                            t_int8, cfg_int8 = t, c
                    if t_read is None:
                        t_read = nbytes / (bench_events(lambda: w.data.view(torch.float32).sum()) * 1e-3)
                    if t_int8 is not None:
                        int8_cols = (f"| {pct(t_int8)} (+ {t_q * 1e3:.1f} us) | {cfg_int8} | "
                                     f"{t_prod / (t_int8 + t_q):.2f}x | {t_read / bw:.1%} |")
                print(f"| {name} | {shape} | {m} | {pct(t_prod)} | {pct(t_rule)} | {pct(t_best)} | "
                      f"{cfg_best} | {t_prod / t_best:.2f}x {int8_cols}", flush=True)
                rows.append({"type": name, "n": n, "k": k, "m": m, "bytes": nbytes, "copy_bw": bw,
                             "production_ms": t_prod, "production_cfg": prod_cfg, "production_err": e_prod,
                             "flat_rule_ms": t_rule, "flat_rule_cfg": base, "flat_best_ms": t_best,
                             "flat_best_cfg": cfg_best, "flat_best_err": e_best, "int8_best_ms": t_int8,
                             "int8_best_cfg": cfg_int8, "q8_1_ms": t_q})
    for name in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            by_m = {r["m"]: r for r in rows if r["type"] == name and (r["n"], r["k"]) == (n, k)}
            if 1 in by_m and 8 in by_m:
                print(f"{name} {shape}: M=8 / M=1 time, production "
                      f"{by_m[8]['production_ms'] / by_m[1]['production_ms']:.2f}, flat "
                      f"{by_m[8]['flat_best_ms'] / by_m[1]['flat_best_ms']:.2f}" + (
                          f", int8 {by_m[8]['int8_best_ms'] / by_m[1]['int8_best_ms']:.2f}"
                          if by_m[1]["int8_best_ms"] and by_m[8]["int8_best_ms"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.write_tuning:
        out = Path(args.write_tuning)  # a file an earlier run wrote is extended, else the shipped one copied
        table = json.loads(out.read_text()) if out.exists() else (dict(tuning.table) or {"target": tuning.target})
        kernel = dict(table.get("matvec_kernel", {}))
        for name in args.types.split(","):
            mine = [r for r in rows if r["type"] == name]
            if mine and all(r["int8_best_ms"] and r["int8_best_ms"] + r["q8_1_ms"] < r["production_ms"] for r in mine):
                kernel[name] = "int8"
            elif mine and all(r["flat_rule_ms"] < r["production_ms"] for r in mine):
                kernel[name] = "flat"
        table["matvec_kernel"] = kernel
        int8 = table.setdefault("matvec_int8", {})
        for r in rows:  # the fastest checked int8 config per exact shape and row count
            if r["int8_best_cfg"] is not None:
                int8.setdefault(r["type"], {}).setdefault(f"{r['n']}x{r['k']}", {})[str(r["m"])] = r["int8_best_cfg"]
        with open(args.write_tuning, "w") as f:
            json.dump(table, f, indent=2)
        print(f"wrote {args.write_tuning}: matvec_kernel {kernel}, matvec_int8 entries for "
              f"{sorted((t, sh) for t, by in int8.items() for sh in by)}")


if __name__ == "__main__":
    main()
