"""Paged-attention kernels on a GPU: decode (flash-decoding) over batch x context, prefill of one long
prompt and a chunk after a cached prefix. Every row is checked against the float64 reference before it is
timed. Prints a table and one JSON line per row.

    python benchmarks/bench_attention.py [--batches 1,4,16,64] [--contexts 512,2048,8192] [--prefill 2048]
        [--decode-configs '[{"block_n": 64, "split_keys": 1024}]'] [--prefill-configs '[{"block_m": 64}]']
    python benchmarks/bench_attention.py --tiny      # correctness only, tiny shapes; runs under the interpreter
    python benchmarks/bench_attention.py --graph 32 --batches 1 --contexts 176 --prefill ''
        # decode as the decode graph runs it: 32 calls (one per layer) captured back to back and replayed,
        # the median per call (no launch latency from the host; do_bench otherwise)
    python benchmarks/bench_attention.py --graph 32 --batches 64 --contexts 512 --max-seq-len 262144 --prefill ''
        # the decode graphs' grid: sized for max_model_len (262144 here), sequences far shorter

Shapes default to Llama-3-8B's attention (32 query heads over 8 kv heads, head_dim 128) with an f16 cache
of 16-slot pages, pages shuffled across the pool. Ceilings measured in the same run: decode reads K and V
once, against a 2 GiB device-to-device copy (bytes read + written); prefill counts 4 * H * D flops per
visible (query, key) pair, against torch's causal SDPA on the same contiguous tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads

import triton  # noqa: E402

from vegaserve.triton_kernels.attention_decode import decode_attention, reference_decode  # noqa: E402
from vegaserve.triton_kernels.attention_prefill import prefill_attention, reference_prefill  # noqa: E402
from vegaserve.triton_kernels.timing import bench_graph, copy_bandwidth  # noqa: E402

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def bench(fn, ms: int = 200) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=ms, return_mode="median"))


def paged_cache(lens: list[int], kv: int, d: int, page: int, dtype: torch.dtype, device: str):
    """Random k/v caches [slots, kv, d] and block tables [S, blocks] int32 over shuffled pages."""
    gen = torch.Generator().manual_seed(sum(lens) + len(lens))
    blocks = [-(-n // page) for n in lens]
    order = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for s, b in enumerate(blocks):
        tables[s, :b] = order[used : used + b]
        used += b
    shape = (sum(blocks) * page, kv, d)
    k = torch.randn(shape, device=device).to(dtype)
    v = torch.randn(shape, device=device).to(dtype)
    return k, v, tables.to(device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y.double() - ref).norm() / ref.norm())


def decode_row(args, dtype, batch: int, ctx: int, cfg: dict, timed: bool, bw: float) -> dict:
    device = "cuda" if timed else "cpu"
    lens = [ctx] * batch
    k, v, tables = paged_cache(lens, args.kv_heads, args.head_dim, args.page, dtype, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, device=device).to(dtype)
    scale = args.head_dim**-0.5
    max_len = args.max_seq_len or ctx
    run = lambda: decode_attention(q, k, v, tables, seq_lens, scale, args.page, max_len, **cfg)  # noqa: E731
    check = min(batch, 4)  # the reference is slow: its first sequences
    err = rel_err(run()[:check], reference_decode(q[:check], k, v, tables[:check], seq_lens[:check], scale, args.page))
    row = {"op": "decode", "batch": batch, "context": ctx, "max_seq_len": max_len, "relerr": err, "cfg": cfg}
    if timed:
        ms = bench_graph([run] * args.graph) if args.graph else bench(run)
        nbytes = 2 * batch * ctx * args.kv_heads * args.head_dim * k.element_size()
        row.update(ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9, pct_bw=100 * nbytes / (ms * 1e-3) / bw)
    return row


def prefill_row(args, dtype, cached: int, new: int, cfg: dict, timed: bool) -> dict:
    device = "cuda" if timed else "cpu"
    total = cached + new
    k, v, tables = paged_cache([total], args.kv_heads, args.head_dim, args.page, dtype, device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    qstart = torch.tensor([0, new], dtype=torch.int32, device=device)
    q = torch.randn(new, args.heads, args.head_dim, device=device).to(dtype)
    scale = args.head_dim**-0.5
    run = lambda: prefill_attention(q, k, v, tables, seq_lens, qstart, scale, args.page, new, **cfg)  # noqa: E731
    err = rel_err(run(), reference_prefill(q, k, v, tables, seq_lens, qstart, scale, args.page))
    row = {"op": "prefill", "cached": cached, "new": new, "relerr": err, "cfg": cfg}
    if timed:
        ms = bench(run)
        pairs = new * cached + new * (new + 1) / 2  # visible (query, key) pairs
        tflops = 4 * args.heads * args.head_dim * pairs / (ms * 1e-3) / 1e12
        row.update(ms=ms, tflops=tflops)
        if cached == 0:  # the same causal attention through torch on contiguous tensors
            pos = torch.arange(total, device=device)
            slots = tables[0].long()[pos // args.page] * args.page + pos % args.page
            qt, kt, vt = q.transpose(0, 1)[None], k[slots].transpose(0, 1)[None], v[slots].transpose(0, 1)[None]
            sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True))
            row.update(sdpa_ms=sdpa, pct_sdpa=100 * sdpa / ms)
    return row


def show(row: dict, tol: float) -> bool:
    """Print the row; whether its error is within tol."""
    if row["op"] == "decode":
        what = f"decode  B={row['batch']:<3d} ctx={row['context']:<6d} max={row['max_seq_len']:<6d}"
        perf = f"{row['ms']:8.4f} ms {row['gbps']:7.0f} GB/s {row['pct_bw']:5.1f}%bw" if "ms" in row else ""
    else:
        what = f"prefill cached={row['cached']:<5d} new={row['new']:<5d}"
        perf = f"{row['ms']:8.4f} ms {row['tflops']:7.1f} TFLOP/s" if "ms" in row else ""
        if "sdpa_ms" in row:
            perf += f"  SDPA {row['sdpa_ms']:.4f} ms ({row['pct_sdpa']:.0f}% of its speed)"
    ok = row["relerr"] < tol
    print(f"{what} {perf}  relerr {row['relerr']:.2e} {'ok' if ok else 'WRONG'}  {json.dumps(row['cfg'])}")
    print(json.dumps(row))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--prefill", default="2048", help="prompt lengths; each also as a chunk of 512 after the rest")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="f16", choices=sorted(DTYPES))
    ap.add_argument("--decode-configs", default="[{}]", help="JSON list of decode launch overrides; each is run")
    ap.add_argument("--prefill-configs", default="[{}]", help="JSON list of prefill launch overrides")
    ap.add_argument("--max-seq-len", type=int, default=0,
                    help="max_seq_len given to decode (0: the context; the decode graphs give max_model_len)")
    ap.add_argument("--graph", type=int, default=0,
                    help="time decode as N calls replayed in one graph (0: do_bench, one launch per call)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, correctness only (the interpreter on a CPU)")
    args = ap.parse_args()
    timed = torch.cuda.is_available()
    if args.tiny:
        args.batches, args.contexts, args.prefill = "1,3", "17,40", "24"
        args.heads, args.kv_heads, args.head_dim, args.page = 4, 2, 32, 8
        args.decode_configs = '[{"block_n": 16, "split_keys": 16}]'
        args.prefill_configs = '[{"block_m": 16, "block_n": 16}]'
        if args.dtype == "bf16" and not timed:
            args.dtype = "f16"  # the interpreter has no bf16
    elif not timed:
        sys.exit("bench_attention needs a GPU (or --tiny for the correctness part under the interpreter)")
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.max_seq_len and args.max_seq_len < max(contexts):
        sys.exit(f"--max-seq-len {args.max_seq_len} is below the longest context {max(contexts)}")
    dtype = DTYPES[args.dtype]
    bw = copy_bandwidth() if timed else 0.0
    if timed:
        print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB, read + write)")
    print(f"heads {args.heads}/{args.kv_heads} head_dim {args.head_dim} cache {args.dtype} page {args.page}")
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    wrong = 0
    for cfg in json.loads(args.decode_configs):
        for batch in (int(x) for x in args.batches.split(",")):
            for ctx in contexts:
                wrong += not show(decode_row(args, dtype, batch, ctx, cfg, timed, bw), tol)
    for cfg in json.loads(args.prefill_configs):
        for total in (int(x) for x in args.prefill.split(",") if x):
            chunk = min(512, total // 2)
            for cached, new in ((0, total), (total - chunk, chunk)):
                wrong += not show(prefill_row(args, dtype, cached, new, cfg, timed), tol)
    if wrong:
        sys.exit(f"{wrong} rows outside the tolerance")


if __name__ == "__main__":
    main()
