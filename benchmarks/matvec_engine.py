"""The engine's int8 decode mat-vec as it runs: matvec_int8 with the tuning file's launch parameters (what a
linear layer picks), graph-replay timed on rotating weight copies, per type and shape of a model, with the
q8_1 quantize beside it, and the same calls on one copy (in L2 where it fits: how fast the kernel is when
memory is not what holds it back). No sweep, so it is quick, and it runs against whichever vegaserve is
importable: the same script times two trees in one call (PYTHONPATH), a change against its baseline.

    python benchmarks/matvec_engine.py [--shapes Q4_K:28672x4096,...] [--ms 1,8] [--label NAME] [--json out.json]
        [--extra '{"block_n": 32};{"pieces": 1}']   (variants: launch parameters over the tuning file's)
        [--lanes]   (and each shape's lanes-kernel configs, matvec_int8.lanes_candidates: mma 2)

Each result is checked against the product on the dequantized q8_1 activation (relative error < 1e-4)
before it is timed (the tuning file's own config must pass; a variant that does not is reported and not
timed). % = weight bytes per second against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES, dequantize
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec_int8 import lanes_candidates, matvec_int8, quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for

from bench_kernels import copy_bandwidth  # noqa: E402 - run from benchmarks/ or with it on sys.path

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
# Llama-3-8B's decode matrices in the Q4_K_M mix (synth_gguf.py): fused qkv and gate-up where the types
# match, q and k apart from a Q6_K v on the use-more-bits layers, down in either type, the output in Q6_K
LLAMA3_8B_Q4_K_M = ("Q4_K:28672x4096,Q4_K:4096x14336,Q4_K:6144x4096,Q4_K:4096x4096,Q4_K:1024x4096,"
                    "Q6_K:128256x4096,Q6_K:4096x14336,Q6_K:1024x4096")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=LLAMA3_8B_Q4_K_M, help="TYPE:NxK,...")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--extra", default=None,
                    help="variants: launch parameters over the tuning file's, JSON objects separated by ';' "
                         "(each timed on the same weights; {} is the tuning file's own)")
    ap.add_argument("--lanes", action="store_true", help="also each shape's lanes-kernel configs (mma 2)")
    args = ap.parse_args()
    variants = [json.loads(v) for v in args.extra.split(";")] if args.extra else [{}]
    bw = copy_bandwidth()
    print(f"{args.label}: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| type | shape | M | variant | int8 mat-vec | % copy bw | q8_1 quantize | same copy each call (L2) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for item in args.shapes.split(","):
        name, shape = item.split(":")
        tid = TYPE_IDS[name]
        n, k = (int(v) for v in shape.split("x"))
        raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(n + k)).cuda()
        dense = dequantize(raw.reshape(-1), tid, (n, k))
        w = repack(raw, tid, n, k)
        rotation = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(copies_for(raw.numel()) - 1)]
        shape_variants = variants
        if args.lanes:  # every int8 type has a lanes kernel
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            shape_variants = variants + lanes_candidates(tid, n, k, sms)
        for m, extra in ((int(v), e) for v in args.ms.split(",") for e in shape_variants):
            x = torch.randn(m, k, device="cuda")
            q8 = quantize_q8_1(x)
            xd = (q8[0].float().view(m, -1, 32) * q8[1][..., None]).view(m, k)
            ref = xd @ dense.T
            try:
                err = float((matvec_int8(x, w, q8_1=q8, **extra) - ref).norm() / ref.norm())
            except ValueError as e:  # a variant the launcher refuses at this M (pipe without mma 2, ...)
                if not extra:
                    raise
                print(f"| {name} | {shape} | {m} | {json.dumps(extra)} | refused: {e} |||||", flush=True)
                continue
            if not err < 1e-4:
                if not extra:
                    raise SystemExit(f"{name} {shape} M={m} (tuning file): relative error {err:.2e}")
                print(f"| {name} | {shape} | {m} | {json.dumps(extra)} | relative error {err:.2e}, not timed |||||")
                continue
            t = bench_graph([lambda wi=wi: matvec_int8(x, wi, q8_1=q8, **extra) for wi in rotation])
            t_q = bench_graph([lambda: quantize_q8_1(x)] * len(rotation))
            # one copy read again and again: from L2 where it fits (60 MB on an H200), the rate the kernel
            # reaches when memory is not what holds it back
            t_hot = bench_graph([lambda: matvec_int8(x, w, q8_1=q8, **extra)] * len(rotation))
            print(f"| {name} | {shape} | {m} | {json.dumps(extra)} | {t * 1e3:.1f} us | {raw.numel() / (t * 1e-3) / bw:.1%} | "
                  f"{t_q * 1e3:.1f} us | {t_hot * 1e3:.1f} us |", flush=True)
            rows.append({"label": args.label, "type": name, "n": n, "k": k, "m": m, "variant": extra,
                         "bytes": raw.numel(), "ms": t, "q8_1_ms": t_q, "hot_ms": t_hot, "copy_bw": bw, "err": err})
        del rotation, w
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
