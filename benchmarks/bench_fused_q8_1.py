"""The q8_1 copy of a decode activation written by the op that makes it (RMSNorm, the residual add with
RMSNorm, SiLU-mul: triton_kernels/fused.py with q8_1=True) against that op followed by quantize_q8_1, as a
decode step runs them: back to back in a CUDA graph (with PDL where the device has it), one token.

    python benchmarks/bench_fused_q8_1.py [--hidden 4096] [--ffn 14336] [--repeat 64]

Prints a table and one JSON line: microseconds per op (median of graph replays) both ways, and the saving.
"""

from __future__ import annotations

import argparse
import json

import torch

from vegaserve.triton_kernels.fused import add_rms_norm, rms_norm, silu_mul
from vegaserve.triton_kernels.q8_1 import quantize_q8_1
from vegaserve.triton_kernels.timing import bench_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--repeat", type=int, default=64, help="ops per captured graph")
    args = ap.parse_args()
    n, f = args.hidden, args.ffn
    x = torch.randn(1, n, device="cuda")
    delta = torch.randn(1, n, device="cuda")
    w = torch.randn(n, device="cuda")
    gate_up = torch.randn(1, 2 * f, device="cuda")
    cases = {
        "rms_norm": (lambda: quantize_q8_1(rms_norm(x, w, 1e-5)), lambda: rms_norm(x, w, 1e-5, q8_1=True)),
        "add_rms_norm": (lambda: quantize_q8_1(add_rms_norm(x, delta, w, 1e-5)[1]),
                         lambda: add_rms_norm(x, delta, w, 1e-5, q8_1=True)),
        "silu_mul": (lambda: quantize_q8_1(silu_mul(gate_up)), lambda: silu_mul(gate_up, q8_1=True)),
    }
    print(f"{torch.cuda.get_device_name()}: one token, hidden {n}, ffn {f}")
    print("| op | then quantize_q8_1 (2 launches) | fused (1 launch) | saved |")
    print("|---|---|---|---|")
    rows = {}
    for name, (apart, fused) in cases.items():
        t_apart = bench_graph([apart] * args.repeat) * 1e3
        t_fused = bench_graph([fused] * args.repeat) * 1e3
        rows[name] = {"apart_us": t_apart, "fused_us": t_fused}
        print(f"| {name} | {t_apart:.2f} us | {t_fused:.2f} us | {t_apart - t_fused:.2f} us |", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
