"""Timing kernels the way the decode graph runs them: calls on rotating copies of their inputs, captured
back to back in one CUDA/HIP graph and replayed, the median per call. No launch gaps and no cache flush
between calls (one-call event timing adds launch latency and noise of the size of a decode mat-vec),
and with copies_for(bytes) copies no call finds its weights in L2."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton

L2_ROTATION_BYTES = 256 * 2**20  # > 4x the H200's 50 MB L2 (and gfx906's 4 MB): every copy comes from DRAM


def copies_for(nbytes: int) -> int:
    """How many copies of an input of nbytes to rotate through so that none is in L2 when it is read."""
    return max(4, -(-L2_ROTATION_BYTES // max(nbytes, 1)))


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + written), the median of triton's do_bench: the
    ceiling the benchmarks quote their kernels' bandwidth against."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def bench_graph(calls: Sequence[Callable[[], object]], replays: int = 25) -> float:
    """Median milliseconds per call of `calls` (each on its own copy of the inputs), replayed as one graph."""
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return float(torch.tensor(times).median())
