"""Quantized matmul kernels on a GPU: time, weight bytes/s against copy bandwidth, TFLOP/s against the
vendor bf16 GEMM on the same shape, repacked against canonical. Prints a table and one JSON line per row.

    python benchmarks/bench_kernels.py --types Q4_K,Q8_0 --ms 1,8,256,2048 [--shapes 4096x4096,...] [--sweep]
        [--paths triton,dense] [--canonical]

Weights are random valid blocks (finite scales), activations random normal: never zeros. Ceilings are
measured in the same run: a 2 GiB device-to-device copy (bytes read + written) and torch.matmul in bf16.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import canonical, repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import dense_gemm, gemm, matvec
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for

LLAMA3_8B = ["4096x4096", "6144x4096", "28672x4096", "14336x4096", "4096x14336", "128256x4096"]
TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}


def bench(fn, ms: int = 200) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=ms, return_mode="median"))


def read_bandwidth(nbytes: int) -> float:
    """Bytes per second of torch's sum over nbytes, timed as bench_graph times the kernels: the read rate
    a one-pass kernel of this size reaches (launch ramp and tail included)."""
    bufs = [torch.randn(max(1, nbytes // 4), device="cuda") for _ in range(copies_for(nbytes))]
    out = torch.empty((), device="cuda")
    t = bench_graph([lambda b=b: torch.sum(b, dim=0, out=out) for b in bufs])
    return nbytes / (t * 1e-3)


def copy_bandwidth() -> float:
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (t * 1e-3)


def make_weight(type_name: str, n: int, k: int, layout):
    tid = TYPE_IDS[type_name]
    gen = torch.Generator().manual_seed(n * 31 + k)
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, gen).cuda()
    return layout(raw, tid, n, k), raw.numel()


def run_op(x, w, path, cfg, scratch=None):
    if path == "matvec":
        return lambda: matvec(x, w, **cfg)
    if path == "dense":  # dequantize into a scratch buffer, then the vendor GEMM
        return lambda: dense_gemm(x, w, scratch)
    return lambda: gemm(x, w, out_dtype=torch.bfloat16, **cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,IQ4_NL,MXFP4,Q4_0")
    ap.add_argument("--shapes", default=",".join(LLAMA3_8B))
    ap.add_argument("--ms", default="1,2,4,8,16,64,256,512,2048")
    ap.add_argument("--canonical", action="store_true", help="also time the canonical layout")
    ap.add_argument("--paths", default="triton,dense",
                    help="prefill paths for M > 8: triton (in-register GEMM), dense (dequantized scratch + vendor "
                         "GEMM, the engine's)")
    ap.add_argument("--sweep", default="", help="JSON list of launch configs to try per row; best is kept")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a GPU")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB, read + write)")
    sweep = json.loads(args.sweep) if args.sweep else None
    print(f"{'type':7s} {'shape':>12s} {'M':>5s} {'lay/path':10s} {'ms':>8s} {'GB/s':>7s} {'%bw':>5s} {'TFLOP/s':>8s} {'cuBLAS':>7s} {'%cb':>5s} {'relerr':>8s} cfg")
    for type_name in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            layouts = [("repack", repack)] + ([("canonical", canonical)] if args.canonical else [])
            for lname, layout in layouts:
                w, nbytes = make_weight(type_name, n, k, layout)
                w_dense = dequantize(unpack_to_canonical(w).reshape(-1), w.type_id, (n, k))
                scratch = torch.empty(n * k, dtype=torch.bfloat16, device="cuda")
                for m in (int(v) for v in args.ms.split(",")):
                    x = torch.randn(m, k, device="cuda", dtype=torch.float32 if m <= 8 else torch.bfloat16)
                    xb = x.to(torch.bfloat16)
                    t_cublas = bench(lambda: xb @ dense.T)
                    for path in (["matvec"] if m <= 8 else args.paths.split(",")):
                        configs = (sweep or [{}]) if path != "dense" else [{}]
                        ref = x[:8].float() @ w_dense.T  # f32 on the GPU (TF32 off): reference dequantizer

                        def error(c):
                            try:
                                y = run_op(x, w, path, c, scratch)()[:8].float()
                            except ValueError:  # a config the launcher refuses
                                return float("inf")
                            return float((y - ref).norm() / ref.norm())

                        # a config that computes the wrong thing is never the fastest one
                        valid = [c for c in configs if error(c) < 1e-2]
                        if not valid:
                            print(f"{type_name} {shape} M={m} {path}: no config computed the right result")
                            continue
                        t, cfg = min(((bench(run_op(x, w, path, c, scratch)), c) for c in valid), key=lambda r: r[0])
                        flops = 2 * m * n * k
                        err = error(cfg)
                        row = {
                            "type": type_name, "n": n, "k": k, "m": m, "layout": lname, "path": path, "ms": t,
                            "weight_GBps": nbytes / (t * 1e-3) / 1e9, "bw_frac": nbytes / (t * 1e-3) / bw,
                            "tflops": flops / (t * 1e-3) / 1e12, "cublas_tflops": flops / (t_cublas * 1e-3) / 1e12,
                            "cublas_frac": t_cublas / t, "rel_err": err, "cfg": cfg, "copy_TBps": bw / 1e12,
                        }
                        print(f"{type_name:7s} {shape:>12s} {m:5d} {lname[:3]}/{path:6s} {t:8.4f} {row['weight_GBps']:7.0f} "
                              f"{100 * row['bw_frac']:5.1f} {row['tflops']:8.1f} {row['cublas_tflops']:7.1f} "
                              f"{100 * row['cublas_frac']:5.1f} {err:8.1e} {cfg}")
                        print("JSON " + json.dumps(row), file=sys.stderr)
                del w, w_dense, scratch
            del dense
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
