"""Quantized matmul kernels on a GPU: time, weight bytes/s against copy bandwidth, TFLOP/s against the
vendor bf16 GEMM on the same shape, repacked against canonical. Prints a table and one JSON line per row.

    python benchmarks/bench_kernels.py --types Q4_K,Q8_0 --ms 1,8,256,2048 [--shapes 4096x4096,...]
        [--sweep '[{"kernel": "int8", "block_n": 32}, ...]'] [--canonical] [--tuning FILE]
        [--gemm-sweep '[{"block_m": 64, "block_n": 64, "nb": 8, "split_k": 2}, ...]']

Up to 8 rows: the decode mat-vec (triton_kernels/matvec.py) with the kernel and launch parameters the
tuning file gives that type, shape and row count (as a model load picks them), timed as the decode graph
runs it: calls on rotating weight copies captured in one CUDA graph and replayed (timing.py), x's q8_1
copy made once outside the timed calls (in a decode step the op before writes it). --sweep: entries over
the file's (each may name another kernel); the fastest right one is reported. Above 8 rows: the quantized
GEMM (gemm.quant_gemm: tiles dequantized in registers) with the launch a model load picks (the file's
`gemm` entry over gemm.gemm_rule) and each --gemm-sweep entry on top of it, timed in graphs as the mat-vec, and the prefill path (the weight dequantized into a scratch copy, then the vendor GEMM), timed
with triton.testing.do_bench. Every result is checked against the reference dequantizer's
product before it is timed. Weights are random valid blocks (finite scales), activations random normal:
never zeros. Ceilings are measured in the same run: a 2 GiB device-to-device copy (bytes read + written)
and torch.matmul in bf16.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

import dataclasses

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import canonical, repack, unpack_to_canonical
from vegaserve.triton_kernels.gemm import gemm_params, quant_gemm
from vegaserve.triton_kernels.matmul import dense_gemm
from vegaserve.triton_kernels.matvec import Choice, choose, device_shape, matvec
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for, copy_bandwidth
from vegaserve.triton_kernels.tuning import Tuning, load_tuning

LLAMA3_8B = ["4096x4096", "6144x4096", "28672x4096", "14336x4096", "4096x14336", "128256x4096"]
TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}


def bench(fn, ms: int = 200) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=ms, return_mode="median"))


def make_weight(type_name: str, n: int, k: int, layout):
    tid = TYPE_IDS[type_name]
    gen = torch.Generator().manual_seed(n * 31 + k)
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, gen).cuda()
    return layout(raw, tid, n, k), raw.numel()


def matvec_choice(w, m: int, tuning: Tuning, cfg: dict, base: Choice | None = None) -> Choice:
    """The file's choice for w at m rows (or `base`), with a --sweep entry on top; one that names another
    kernel starts from that kernel's rule."""
    base = base or choose(w, m, tuning)
    if cfg.get("kernel", base.kernel.name) != base.kernel.name:
        table = "matvec" if w.repacked else "matvec_canonical"
        base = choose(w, m, Tuning(tuning.target, {table: {w.type_name: {"any": {"1": {"kernel": cfg["kernel"]}}}}}))
    return Choice(base.kernel, {**base.params, **{k: v for k, v in cfg.items() if k != "kernel"}})


def run_op(x, w, path, cfg, scratch=None):
    """The prefill path: dequantize into a scratch buffer, then the vendor GEMM."""
    return lambda: dense_gemm(x, w, scratch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,IQ4_NL,MXFP4,Q4_0")
    ap.add_argument("--shapes", default=",".join(LLAMA3_8B))
    ap.add_argument("--ms", default="1,2,4,8,16,64,256,512,2048")
    ap.add_argument("--canonical", action="store_true", help="also time the canonical layout")
    ap.add_argument("--sweep", default="", help="JSON list of launch configs to try per row; best is kept")
    ap.add_argument("--gemm-sweep", default='[{}]',
                    help="JSON list of quant_gemm launch configs above 8 rows, each over the file's / the rule's")
    ap.add_argument("--tuning", default=None, help="tuning file (default: configs/kernels/<target>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a GPU")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB, read + write)")
    sweep = json.loads(args.sweep) if args.sweep else None
    gemm_sweep = json.loads(args.gemm_sweep)
    tuning = load_tuning(path=args.tuning)
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
                rotation = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(copies_for(nbytes) - 1)]
                for m in (int(v) for v in args.ms.split(",")):
                    x = torch.randn(m, k, device="cuda", dtype=torch.float32 if m <= 8 else torch.bfloat16)
                    xb = x.to(torch.bfloat16)
                    t_cublas = bench(lambda xb=xb, dense=dense: xb @ dense.T)
                    ref = x.float() @ w_dense.T  # f32 on the GPU (TF32 off): reference dequantizer
                    for path in (["matvec"] if m <= 8 else ["gemm", "dense"]):
                        configs = {"matvec": sweep or [{}], "gemm": gemm_sweep, "dense": [{}]}[path]
                        if path == "matvec":
                            q8 = quantize_q8_1(x)
                            ops = []
                            for c in configs:
                                try:
                                    ch = matvec_choice(w, m, tuning, c)
                                except (KeyError, ValueError) as e:
                                    print(f"{type_name} {shape} M={m} {c}: {e}")
                                    continue
                                ops.append((ch, [lambda wi=wi, ch=ch: matvec(x, wi, ch, q8_1=q8 if ch.kernel.int8 else None)
                                                 for wi in rotation]))
                        elif path == "gemm":
                            base = gemm_params(w, m, tuning, device_shape(w.data.device)[0])
                            ops = [({**base, **c}, [lambda wi=wi, p={**base, **c}: quant_gemm(xb, wi, **p)
                                                    for wi in rotation]) for c in configs]
                        else:
                            ops = [(c, [run_op(x, w, path, c, scratch)]) for c in configs]

                        def error(calls):
                            try:
                                y = calls[0]().float()
                            except Exception as e:  # a config the launcher or the compiler refuses
                                print(f"  refused: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                                return float("inf")
                            return float((y - ref).norm() / ref.norm())

                        # a config that computes the wrong thing is never the fastest one (the int8 kernels
                        # multiply x's q8_1 form: about 1e-2 from the f32 product)
                        valid = [(c, calls) for c, calls in ops if error(calls) < 2e-2]
                        if not valid:
                            print(f"{type_name} {shape} M={m} {path}: no config computed the right result")
                            continue
                        timed = [(bench_graph(calls) if path != "dense" else bench(calls[0]), c, calls)
                                 for c, calls in valid]
                        if len(timed) > 1:
                            print("  sweep " + " ".join(f"{t * 1e3:.1f}us{json.dumps(c if isinstance(c, dict) else c.params, separators=(',', ':'))}"
                                                        for t, c, _ in sorted(timed, key=lambda r: r[0])[:6]))
                        t, cfg, calls = min(timed, key=lambda r: r[0])
                        shown = {"kernel": cfg.kernel.name, **cfg.params} if path == "matvec" else cfg
                        flops = 2 * m * n * k
                        err = error(calls)
                        row = {
                            "type": type_name, "n": n, "k": k, "m": m, "layout": lname, "path": path, "ms": t,
                            "weight_GBps": nbytes / (t * 1e-3) / 1e9, "bw_frac": nbytes / (t * 1e-3) / bw,
                            "tflops": flops / (t * 1e-3) / 1e12, "cublas_tflops": flops / (t_cublas * 1e-3) / 1e12,
                            "cublas_frac": t_cublas / t, "rel_err": err, "cfg": shown, "copy_TBps": bw / 1e12,
                        }
                        print(f"{type_name:7s} {shape:>12s} {m:5d} {lname[:3]}/{path:6s} {t:8.4f} {row['weight_GBps']:7.0f} "
                              f"{100 * row['bw_frac']:5.1f} {row['tflops']:8.1f} {row['cublas_tflops']:7.1f} "
                              f"{100 * row['cublas_frac']:5.1f} {err:8.1e} {shown}")
                        print("JSON " + json.dumps(row), file=sys.stderr)
                del w, w_dense, scratch, rotation
            del dense
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
