"""Run one decode mat-vec a few times on random weights, for a hardware profiler to read its counters:

    ncu --clock-control none --kernel-name regex:_q6_k --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python benchmarks/profile_matvec.py --type Q6_K --shape 128256x4096 --m 1 --kernel int8

Launch parameters: the shipped tuning file's (as the engine would take them), or --config as JSON. The
result is checked against the reference product first, so a profile is never of a wrong kernel.
"""

from __future__ import annotations

import argparse
import json

import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import matvec
from vegaserve.triton_kernels.matvec_flat import flat_params
from vegaserve.triton_kernels.matvec_int8 import matvec_int8, quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.tuning import load_tuning


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--shape", default="28672x4096", help="N x K")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--kernel", choices=("int8", "tiles"), default="int8")
    ap.add_argument("--config", default=None, help="launch parameters as JSON (default: the tuning file's)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: the same under TRITON_INTERPRET=1 (a check of the script)")
    args = ap.parse_args()
    tid = {s.name: t for t, s in GGML_TYPES.items()}[args.type]
    n, k = (int(v) for v in args.shape.split("x"))
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n + k)).to(args.device)
    w = repack(raw, tid, n, k)
    x = torch.randn(args.m, k, device=args.device)
    tuning = load_tuning()
    if args.kernel == "int8":
        cfg = json.loads(args.config) if args.config else flat_params(w, args.m, tuning, op="matvec_int8")
        q8 = quantize_q8_1(x)
        xq = (q8[0].float().view(args.m, -1, 32) * q8[1][..., None]).view(args.m, k)
        ref = xq @ dequantize(unpack_to_canonical(w).reshape(-1), tid, (n, k)).T

        def run() -> torch.Tensor:
            return matvec_int8(x, w, **cfg, q8_1=q8)
    else:
        cfg = json.loads(args.config) if args.config else tuning.matvec(args.type, n, k, args.m)
        ref = x @ dequantize(unpack_to_canonical(w).reshape(-1), tid, (n, k)).T

        def run() -> torch.Tensor:
            return matvec(x, w, **cfg)
    err = float((run() - ref).norm() / ref.norm())
    if not err <= 1e-4:
        raise SystemExit(f"{args.type} {args.shape} {cfg}: relative error {err:.2e}; not profiling a wrong kernel")
    for _ in range(args.calls):
        run()
    if args.device != "cpu":
        torch.cuda.synchronize()
    print(f"{args.kernel} {args.type} {args.shape} M={args.m} {cfg}: {args.calls} calls, relative error {err:.1e}")


if __name__ == "__main__":
    main()
