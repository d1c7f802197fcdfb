"""Experiment: a mat-vec formulation without 2-D weight tiles, against the production kernel.

Hypothesis (docs/PERF.md): the production mat-vec spends its time converting layouts, because each type's
tile is built as [rows, blocks, 32] and then reshaped (and, for 4-bit types, joined and permuted) into a
2-D [rows, k] tile. Here each block's dot product is taken in the 3-D shape it is loaded in, the
activation is read in the weights' nibble order instead of reordering the weights, and the per-block
scale multiplies one partial sum per block. Prediction: Q8_0 and Q4_0 at M=1 move from ~25-40% to
>= 60% of copy bandwidth if the hypothesis holds.

    python benchmarks/matvec_variants.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from vegaserve.triton_kernels.dequant import dequantize
from vegaserve.triton_kernels.layout import repack, unpack_to_canonical
from vegaserve.triton_kernels.matmul import matvec
from vegaserve.triton_kernels.quants.random_blocks import random_blocks


@triton.jit
def _mv_block_dot(x_ptr, part_ptr, base, d_off, d_rs, q_off, q_rs, N, K, blocks_per_split,
                  FOUR_BIT: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r64 = tl.where(rmask, rows, 0).to(tl.int64)
    first = pid_k * blocks_per_split
    n_iter = blocks_per_split // NB
    acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    WIDTH: tl.constexpr = 16 if FOUR_BIT else 32
    j = tl.arange(0, WIDTH)
    for i in range(0, n_iter):
        blk = first + i * NB + tl.arange(0, NB)
        q = tl.load(base + q_off + r64[:, None, None] * q_rs + blk[None, :, None] * WIDTH + j[None, None, :],
                    mask=rmask[:, None, None], other=0)
        xk = blk[:, None] * 32 + j[None, :]
        if FOUR_BIT:
            x_lo = tl.load(x_ptr + xk)
            x_hi = tl.load(x_ptr + xk + 16)
            lo = (q & 15).to(tl.float32) - 8.0
            hi = (q >> 4).to(tl.float32) - 8.0
            s = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)
        else:
            x = tl.load(x_ptr + xk)
            s = tl.sum(q.to(tl.int8, bitcast=True).to(tl.float32) * x[None, :, :], axis=2)
        d = tl.load((base + d_off + r64[:, None] * d_rs + blk[None, :] * 2).to(tl.pointer_type(tl.float16)),
                    mask=rmask[:, None], other=0.0).to(tl.float32)
        acc += s * d
    tl.store(part_ptr + pid_k * N + rows, tl.sum(acc, axis=1), mask=rmask)


def mv_block_dot(x, w, block_n, nb, split_k, num_warps=4):
    n_blocks = w.k // 32
    per_split = n_blocks // split_k
    part = torch.empty(split_k, w.n, dtype=torch.float32, device=x.device)
    d, q = w.fields[0], w.fields[-1]
    _mv_block_dot[(triton.cdiv(w.n, block_n), split_k)](
        x, part, w.data, d.offset, d.row_stride, q.offset, q.row_stride, w.n, w.k, per_split,
        FOUR_BIT=w.type_id == 2, BLOCK_N=block_n, NB=nb, num_warps=num_warps)
    return part.sum(0) if split_k > 1 else part[0]


def main() -> None:
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
    del src, dst
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for tid, name in ((8, "Q8_0"), (2, "Q4_0")):
        for n, k in ((14336, 4096), (4096, 14336)):
            raw = random_blocks(tid, n, k // 32, torch.Generator().manual_seed(n)).cuda()
            w = repack(raw, tid, n, k)
            dense = dequantize(unpack_to_canonical(w).reshape(-1), tid, (n, k))
            x = torch.randn(1, k, device="cuda")
            ref = (x @ dense.T)[0]
            t_prod = triton.testing.do_bench(lambda: matvec(x, w, block_n=16, nb=16), return_mode="median")
            best = None
            for bn, nb, sk, nw in itertools.product((8, 16, 32), (8, 16), (1, 2, 4), (4, 8)):
                if (k // 32) % (nb * sk):
                    continue
                y = mv_block_dot(x[0], w, bn, nb, sk, nw)
                if float((y - ref).norm() / ref.norm()) > 1e-5:
                    continue
                t = triton.testing.do_bench(lambda: mv_block_dot(x[0], w, bn, nb, sk, nw), return_mode="median")
                if best is None or t < best[0]:
                    best = (t, (bn, nb, sk, nw))
            nbytes = raw.numel()
            print(f"{name} {n}x{k}: production {t_prod * 1e3:6.1f} us ({nbytes / (t_prod * 1e-3) / bw:5.1%})  "
                  f"block-dot {best[0] * 1e3:6.1f} us ({nbytes / (best[0] * 1e-3) / bw:5.1%}) cfg {best[1]}")


if __name__ == "__main__":
    main()
