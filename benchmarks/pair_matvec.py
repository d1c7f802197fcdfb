"""A layer's two int8 matrices of different K-quant types at one row (the Q4_K_M mix's Q4_K q/k beside a
Q6_K v), one launch each (what the engine runs without the tuning file's `matvec_int8_pairs`) against one
launch for both (matvec_int8.matvec_int8_pair), graph-replay timed on rotating weight copies as the decode
graph runs them; each matrix alone beside them. The pair's output is checked bit for bit against the two
launches' before anything is timed.

    python benchmarks/pair_matvec.py [--a Q4_K:5120x4096] [--b Q6_K:1024x4096] [--rounds 5]
        [--b-extra '{"block_n": 16, "split_k": 8};...']   (the pair with other launch parameters for b)

Launch parameters: the tuning file's (as a linear layer takes them), variants over them for b. Rounds
alternate the variants; the medians of the rounds are printed, and % = both matrices' bytes per second
against the copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.layout import repack
from vegaserve.triton_kernels.matvec_flat import flat_params
from vegaserve.triton_kernels.matvec_int8 import matvec_int8, matvec_int8_pair, pairs, quantize_q8_1
from vegaserve.triton_kernels.quants.random_blocks import random_blocks
from vegaserve.triton_kernels.timing import bench_graph, copies_for

from bench_kernels import copy_bandwidth  # noqa: E402 - run from benchmarks/ or with it on sys.path

TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}


def weight(spec: str, seed: int):
    name, shape = spec.split(":")
    tid = TYPE_IDS[name]
    n, k = (int(v) for v in shape.split("x"))
    raw = random_blocks(tid, n, k // GGML_TYPES[tid].block_size, torch.Generator().manual_seed(seed)).cuda()
    return repack(raw, tid, n, k), raw.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", default="Q4_K:5120x4096", help="TYPE:NxK of the first matrix (q and k stacked)")
    ap.add_argument("--b", default="Q6_K:1024x4096", help="TYPE:NxK of the second (v)")
    ap.add_argument("--b-extra", default="", help="launch parameters over b's for more pair variants, ';'-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    wa, bytes_a = weight(args.a, 1)
    wb, bytes_b = weight(args.b, 2)
    if wa.k != wb.k:
        raise SystemExit("the two matrices multiply the same activation: their K must agree")
    pa, pb = flat_params(wa, 1, op="matvec_int8"), flat_params(wb, 1, op="matvec_int8")
    n = wa.n + wb.n
    copies = copies_for(bytes_a + bytes_b)
    rot = [(wa, wb)] + [(dataclasses.replace(wa, data=wa.data.clone()), dataclasses.replace(wb, data=wb.data.clone()))
                        for _ in range(copies - 1)]
    x = torch.randn(1, wa.k, device="cuda")
    q8 = quantize_q8_1(x)
    y = torch.empty(1, n, device="cuda")

    def two(a, b, pb=pb):
        matvec_int8(x, a, q8_1=q8, out=y[:, :wa.n], **pa)
        matvec_int8(x, b, q8_1=q8, out=y[:, wa.n:], **pb)

    def one(a, b, pb=pb):
        matvec_int8_pair(x, (a, pa), (b, pb), q8_1=q8, out=y)

    variants = {"two launches": two, "a alone": lambda a, b: matvec_int8(x, a, q8_1=q8, **pa),
                "b alone": lambda a, b: matvec_int8(x, b, q8_1=q8, **pb), "pair": one}
    for extra in filter(None, args.b_extra.split(";")):
        pbx = {**pb, **json.loads(extra)}
        if not pairs((wa, pa), (wb, pbx)):
            print(f"b {extra}: not a pair (pieces kernels on the same warps), skipped")
            continue
        variants[f"two launches, b {extra}"] = lambda a, b, pbx=pbx: two(a, b, pbx)
        variants[f"pair, b {extra}"] = lambda a, b, pbx=pbx: one(a, b, pbx)
    # the pair writes what the two launches write, bit for bit, before anything is timed
    for name, fn in variants.items():
        if name.startswith("two"):
            y.fill_(float("nan"))
            fn(wa, wb)
            expect = y.clone()
            y.fill_(float("nan"))
            variants["pair" + name[len("two launches"):]](wa, wb)
            if not torch.equal(y, expect):
                raise SystemExit(f"{name}: the pair's output differs from the two launches'")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; a {args.a} {json.dumps(pa)}, "
          f"b {args.b} {json.dumps(pb)}; {copies} copies")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(bench_graph([lambda a=a, b=b, fn=fn: fn(a, b) for a, b in rot]))
    print("| variant | us (median of rounds) | rounds | % copy bw (both matrices' bytes) |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        t = statistics.median(ts)
        size = bytes_a if name == "a alone" else bytes_b if name == "b alone" else bytes_a + bytes_b
        print(f"| {name} | {t * 1e3:.2f} | {' '.join(f'{v * 1e3:.2f}' for v in ts)} | {size / (t * 1e-3) / bw:.1%} |")


if __name__ == "__main__":
    main()
