"""How fast a GPU reads a buffer of a decode mat-vec's size when reading is all a kernel does: the ceiling
that a mat-vec of that many weight bytes can reach in a graph, below the 2 GiB copy's bandwidth where the
buffer is small (the first bytes arrive after the memory's latency, the last programs run alone).

    python benchmarks/read_ceiling.py [--sizes-mb 9.44,14.16,33.03,48.17,66.06,430.9] [--pdl 1] [--json out.json]

For each size: a Triton kernel whose programs each read a run of 16-byte words and store one word (so the
loads are not removed), over a grid of chunk sizes x warps, graph-replay timed on rotating copies (the
decode graph's conditions, triton_kernels/timing.py); the best variant's time and its bytes per second
against the copy bandwidth measured in the same run. The default sizes are the Llama-3-8B Q4_K_M mix's
mat-vecs: Q4_K 4096x4096, 6144x4096, 4096x14336, Q6_K 4096x14336, Q4_K 28672x4096, Q6_K 128256x4096.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels import pdl
from vegaserve.triton_kernels.timing import bench_graph, copies_for

from bench_kernels import copy_bandwidth  # noqa: E402 - run from benchmarks/ or with it on sys.path


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, CHUNK: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr):
    """Program p: words [p * CHUNK, (p + 1) * CHUNK) of int32, VEC rows of 4 a step (16 bytes a lane).
    PDL as the mat-vecs use it: the next launch may start at once, the store waits for the last one."""
    pdl.let_next_start(PDL)
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    offs = tl.arange(0, VEC)[:, None] * 4 + tl.arange(0, 4)[None, :]
    acc = tl.zeros([VEC, 4], tl.int32)
    for start in range(0, CHUNK, VEC * 4):
        idx = base + start + offs
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    pdl.wait_for_inputs(PDL)
    tl.store(out_ptr + pid, tl.reduce(tl.reshape(acc, [VEC * 4]), 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_time(nbytes: int, chunk_bytes: int, num_warps: int, use_pdl: bool) -> float:
    """Median ms of one read of nbytes (rotating copies)."""
    words = nbytes // 4
    copies = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device="cuda")
              for _ in range(copies_for(nbytes))]
    chunk = chunk_bytes // 4
    grid = (triton.cdiv(words, chunk),)
    out = torch.empty(grid[0], dtype=torch.int32, device="cuda")
    vec = 32 * num_warps  # one 16-byte word per lane a step
    launch = pdl.launch_args(out.device) if use_pdl else {"PDL": False}
    calls = [lambda c=c: _read_kernel[grid](c, out, words, CHUNK=chunk, VEC=vec, num_warps=num_warps, **launch)
             for c in copies]
    ms = bench_graph(calls)
    calls[-1]()  # the last copy's result, checked against torch: the xor of each program's words
    rows = torch.nn.functional.pad(copies[-1], (0, grid[0] * chunk - words)).view(grid[0], chunk)
    while rows.shape[1] > 1:
        half = rows.shape[1] // 2
        rows = rows[:, :half] ^ rows[:, half:]
    if not torch.equal(out, rows[:, 0]):
        raise RuntimeError(f"read kernel: wrong result at {nbytes} bytes, chunk {chunk_bytes}, {num_warps} warps")
    del copies
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="9.44,14.16,33.03,48.17,66.06,430.9")
    ap.add_argument("--chunks-kb", default="8,16,32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--pdl", type=int, default=1,
                    help="1: launched with programmatic dependent launch, as the mat-vecs are (sm_90+)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB, read + write); "
          f"PDL {'on' if args.pdl and pdl.enabled(torch.device('cuda')) else 'off'}")
    print("| size | best read | chunk, warps | % copy bw | every variant (us) |\n|---|---|---|---|---|")
    rows = []
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        nbytes = int(mb * 1e6) // 16 * 16
        times = {(c, w): read_time(nbytes, c * 1024, w, bool(args.pdl)) for c in map(int, args.chunks_kb.split(","))
                 for w in map(int, args.warps.split(","))}
        (c, w), ms = min(times.items(), key=lambda kv: kv[1])
        pct = 100 * nbytes / (ms * 1e-3) / bw
        every = " ".join(f"{k[0]}K/{k[1]}w:{v * 1e3:.1f}" for k, v in times.items())
        print(f"| {mb:.2f} MB | {ms * 1e3:.1f} us | {c} KB, {w} | {pct:.1f}% | {every} |")
        rows.append({"mb": mb, "us": ms * 1e3, "chunk_kb": c, "warps": w, "pct_copy_bw": pct,
                     "variants": {f"{k[0]}K/{k[1]}w": v * 1e3 for k, v in times.items()}})
    print(json.dumps({"copy_bw": bw, "rows": rows}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
