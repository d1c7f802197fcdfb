"""The lanes mat-vec above 8 rows of x (column groups of 8 sharing each tile's A words)
against the one-row mat-vec and the quantized GEMM, on a GPU with matrix units (sm_80+).

    python benchmarks/bench_lanes_wide.py [--types Q4_K,Q8_0] [--shapes 28672x4096,4096x14336,6144x4096]
        [--ms 1,8,16,32,64] [--all-splits] [--jobs 16] [--compile-only]

Per type, shape and M:
  matvec(1)  the tuning file's choice at one row (matvec.choose), timed as tune.py times it (tune._fastest:
             checked against the reference first, graph replays over rotating weight copies, the q8_1
             quantize launch added for an int8 kernel);
  lanes(M)   matvec_mma.matvec_lanes at M rows over matvec_mma.candidates (the smaller split of each tile
             shape; --all-splits: both), the fastest right one (tune._fastest, quantize time included);
  gemm(M)    gemm.quant_gemm on x in bf16 with gemm.gemm_params (the tuning file's entry over the rule), as
             benchmarks/bench_kernels.py calls it, checked against the float64 product (2e-2, bf16 x).
Ratios lanes(M)/matvec(1) and gemm(M)/matvec(1): what M rows cost against one (a ratio of 1 is a free
batch). The lanes kernel takes M as a constexpr and compiles slowly at wide M (Triton's coalesce pass: 23 s
for Q4_K at M = 64 with one row group a warp, 50-57 s with two, on the 2-core machine this was written on;
the defaults are ~180 launches, ~30 CPU-minutes there), so every lanes launch is compiled first in --jobs
processes (each launches it once on zero weights, which fills Triton's cache for the timed process). Q6_K
compiles several times slower than Q4_K (9 s at M = 8): leave it out unless there is time. Narrow with
--ms, --shapes or --types if the compile phase runs long.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time

import torch

from vegaserve.triton_kernels import matvec_mma, tune
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.gemm import gemm_params, quant_gemm
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matmul import reference_matmul
from vegaserve.triton_kernels.matvec import KERNELS, Choice, choose, device_shape
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for
from vegaserve.triton_kernels.tuning import load_tuning

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
GEMM_MAX_ERROR = 2e-2  # x in bf16 against the float64 product (bench_kernels.py's bound)


def lanes_configs(type_id: int, n: int, k: int, sms: int, all_splits: bool) -> list[dict[str, int]]:
    """matvec_mma.candidates, only the smaller split of each tile shape unless all_splits."""
    out, seen = [], set()
    for c in matvec_mma.candidates(type_id, n, k, sms):
        shape = (c["block_n"], c["num_warps"], c["nb"])
        if all_splits or shape not in seen:
            out.append(c)
            seen.add(shape)
    return out


def _zero_weight(type_name: str, n: int, k: int):
    tid = TYPE_IDS[type_name]
    spec = GGML_TYPES[tid]
    raw = torch.zeros(n * (k // spec.block_size) * spec.type_size, dtype=torch.uint8, device="cuda")
    return repack(raw, tid, n, k)


_WEIGHTS: dict = {}


def _compile_one(job: tuple[str, int, int, int, dict]) -> tuple[tuple, float, str]:
    """Worker: launch the lanes kernel once as the timed run will (same shapes, so the same specialization)."""
    type_name, n, k, m, params = job
    t0 = time.time()
    try:
        w = _WEIGHTS.get((type_name, n, k))
        if w is None:
            w = _WEIGHTS[(type_name, n, k)] = _zero_weight(type_name, n, k)
        matvec_mma.matvec_lanes(torch.zeros(m, k, device="cuda"), w, params)
        torch.cuda.synchronize()
        return job[:4], time.time() - t0, ""
    except Exception as e:  # noqa: BLE001 - reported, and the timed run reports it again
        return job[:4], time.time() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def precompile(jobs: list[tuple], workers: int) -> None:
    """Compile every distinct lanes launch in `workers` processes, the widest M first (the longest compiles).
    N and K are run-time arguments: launches that differ only in the shape are one kernel, compiled once."""
    distinct: dict = {}
    for job in jobs:
        distinct.setdefault((job[0], job[3], json.dumps(job[4], sort_keys=True)), job)
    jobs = sorted(distinct.values(), key=lambda j: -j[3])
    t0 = time.time()
    slowest = []
    with mp.get_context("spawn").Pool(workers) as pool:
        for key, seconds, error in pool.imap_unordered(_compile_one, jobs, chunksize=1):
            slowest.append((seconds, key))
            if error:
                print(f"  compile {key}: {error}", flush=True)
    slowest.sort(reverse=True)
    print(f"compiled {len(jobs)} lanes launches in {time.time() - t0:.0f} s on {workers} processes; slowest "
          + ", ".join(f"{k[0]} M={k[3]} {s:.0f}s" for s, k in slowest[:4]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q8_0")
    ap.add_argument("--shapes", default="28672x4096,4096x14336,6144x4096")
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--all-splits", action="store_true", help="both splits of each lanes tile shape")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--compile-only", action="store_true",
                    help="fill Triton's cache and stop (a later run, in another call, times from the cache)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lanes_wide needs a GPU")
    if not hasattr(matvec_mma, "MAX_ROWS"):
        sys.exit(f"{matvec_mma.__file__}: this lanes kernel takes 1..8 rows; run from the lanes-wide branch's tree")
    device = torch.device("cuda")
    if not matvec_mma.has_matrix_units(device):
        sys.exit("the lanes kernel needs NVIDIA sm_80 or later")
    start = time.time()
    sms = device_shape(device)[0]
    tuning = load_tuning()
    types, ms = args.types.split(","), [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"device {torch.cuda.get_device_name()}  {sms} SMs  lanes kernel {matvec_mma.__file__}  tuning "
          f"{tuning.file or tuning.target}", flush=True)

    jobs = [(t, n, k, m, c) for t in types for n, k in shapes for m in ms
            for c in lanes_configs(TYPE_IDS[t], n, k, sms, args.all_splits)]
    precompile(jobs, max(1, min(args.jobs, len(jobs))))
    if args.compile_only:
        return

    def log(line: str) -> None:
        print("  " + line, flush=True)

    print(f"{'type':5s} {'shape':>11s} {'M':>3s} {'matvec(1) us':>12s} {'lanes(M) us':>11s} {'gemm(M) us':>10s} "
          f"{'lanes/mv1':>9s} {'gemm/mv1':>8s}  lanes config | gemm config | matvec(1) choice", flush=True)
    for type_name in types:
        tid = TYPE_IDS[type_name]
        for n, k in shapes:
            raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n)).to(device)
            w = repack(raw, tid, n, k)
            rotation = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(copies_for(raw.numel()) - 1)]
            one = torch.randn(1, k, device=device)
            t_q1 = bench_graph([lambda: quantize_q8_1(one)] * len(rotation))
            label = f"{type_name} {n}x{k}"
            t_mv1, mv1 = tune._fastest(f"{label} M=1 matvec", [choose(w, 1, tuning)], one, rotation, t_q1, log)
            for m in ms:
                x = torch.randn(m, k, device=device)
                t_q = bench_graph([lambda: quantize_q8_1(x)] * len(rotation))
                choices = [Choice(KERNELS["lanes"], c) for c in lanes_configs(tid, n, k, sms, args.all_splits)]
                try:
                    t_lanes, lanes = tune._fastest(f"{label} M={m} lanes", choices, x, rotation, t_q, log)
                except RuntimeError as e:
                    log(str(e))
                    t_lanes, lanes = float("nan"), None
                xb = x.to(torch.bfloat16)
                gp = gemm_params(w, m, tuning, sms)
                ref = reference_matmul(xb.float(), w).float()
                err = float((quant_gemm(xb, w, **gp) - ref).norm() / ref.norm())
                if err <= GEMM_MAX_ERROR:
                    t_gemm = bench_graph([lambda wi=wi: quant_gemm(xb, wi, **gp) for wi in rotation])
                else:
                    log(f"{label} M={m} gemm {gp}: relative error {err:.2e}, not timed")
                    t_gemm = float("nan")
                print(f"{type_name:5s} {f'{n}x{k}':>11s} {m:3d} {t_mv1 * 1e3:12.1f} {t_lanes * 1e3:11.1f} "
                      f"{t_gemm * 1e3:10.1f} {t_lanes / t_mv1:9.2f} {t_gemm / t_mv1:8.2f}  "
                      f"{json.dumps(lanes.params if lanes else None, separators=(',', ':'))} | "
                      f"{json.dumps(gp, separators=(',', ':'))} | {mv1.kernel.name} "
                      f"{json.dumps(mv1.params, separators=(',', ':'))}", flush=True)
                row = {"type": type_name, "n": n, "k": k, "m": m, "matvec1_us": t_mv1 * 1e3,
                       "matvec1": {"kernel": mv1.kernel.name, **mv1.params}, "lanes_us": t_lanes * 1e3,
                       "lanes": lanes.params if lanes else None, "gemm_us": t_gemm * 1e3, "gemm": gp,
                       "quantize_us": t_q * 1e3}
                print("JSON " + json.dumps(row), file=sys.stderr, flush=True)
            del w, raw, rotation
            torch.cuda.empty_cache()
    print(f"total {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
