"""The L2 weight prefetch (triton_kernels/prefetch.py) on the half of a decode layer it is for, alone.

One call is the attention half of a Llama-3-8B Q4_K layer with one token: RMSNorm, q8_1, the fused q/k/v
mat-vec (6144x4096), three short kernels in place of RoPE, the KV write and attention (RMSNorms of a
4096 row), q8_1, the o_proj mat-vec (4096x4096), the residual add with the next RMSNorm. Calls run on
rotating copies of both weights (none in L2 when its call starts) and are graph-replayed as the decode
graph runs them (with PDL where the device has it). Variants: no prefetch; a prefetch launch of the
call's two weights at its top in each MODE of prefetch.py; and the same chain on one copy read every time
(the weights stay in L2), the ceiling a prefetch can reach.

    python benchmarks/l2_prefetch.py [--modes line,sectors,loads,bulk]

Prints microseconds per call, the ratio to no prefetch, and one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.fused import add_rms_norm, rms_norm
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec_int8 import matvec_int8, quantize_q8_1
from vegaserve.triton_kernels.prefetch import MODES, LayerPrefetch
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for

Q4_K = next(t for t, s in GGML_TYPES.items() if s.name == "Q4_K")


def weight(n: int, k: int, seed: int):
    raw = random_blocks(Q4_K, n, k // 256, torch.Generator().manual_seed(seed)).cuda()
    return repack(raw, Q4_K, n, k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--qkv", type=int, default=6144)
    args = ap.parse_args()
    d = args.hidden
    one = [weight(args.qkv, d, 1), weight(d, d, 2)]
    nbytes = sum(w.data.numel() for w in one)
    pairs = [one] + [[weight(args.qkv, d, 3 + 2 * i), weight(d, d, 4 + 2 * i)] for i in range(copies_for(nbytes) - 1)]
    ahead = [LayerPrefetch([w.data for w in p]) for p in pairs]
    norm_w = torch.rand(d, device="cuda") + 0.5
    h = torch.randn(1, d, device="cuda")

    def call(p, pre: LayerPrefetch | None, mode: int):
        if pre is not None:
            pre.launch(1 << 30, mode=mode)
        y = rms_norm(h, norm_w, 1e-5)
        qkv = matvec_int8(y, p[0], q8_1=quantize_q8_1(y))
        a = qkv[:, :d].contiguous()
        for _ in range(3):
            a = rms_norm(a, norm_w, 1e-5)
        o = matvec_int8(a, p[1], q8_1=quantize_q8_1(a))
        return add_rms_norm(h, o, norm_w, 1e-5)

    print(f"{torch.cuda.get_device_name()}, PDL {pdl.enabled(h.device)}, {len(pairs)} copies of "
          f"{nbytes / 2**20:.1f} MiB (q/k/v {args.qkv}x{d} + o {d}x{d}, Q4_K)")
    variants = [("no prefetch", [lambda p=p: call(p, None, 0) for p in pairs])]
    variants += [(f"prefetch {m}", [lambda p=p, a=a, m=MODES[m]: call(p, a, m) for p, a in zip(pairs, ahead)])
                 for m in args.modes.split(",")]
    variants.append(("one copy (in L2)", [lambda: call(one, None, 0)] * len(pairs)))
    result, base = {}, None
    print("| variant | us per call | vs no prefetch |\n|---|---|---|")
    for _round in range(2):  # twice, interleaved: drift shows as a difference between the rounds
        for name, calls in variants:
            us = bench_graph(calls) * 1e3
            base = us if name == "no prefetch" else base
            result.setdefault(name, []).append(us)
            print(f"| {name} | {us:.1f} | {base / us:.2f}x |", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
