"""What rank 0 pays per step to tell the other ranks what to compute: the step plan's broadcast.

Two processes over gloo on this host (the plans always travel over gloo, also beside NCCL), decode plans of
B sequences with L tokens of context each; the median of many broadcasts, after a warm-up.

    python benchmarks/bench_step_overhead.py --batch 1,8,64 --context 512,4096
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from vegaserve.engine.distributed.worker import StepPlan


def plan(batch: int, context: int) -> StepPlan:
    n_blocks = -(-context // 16)
    return StepPlan([(list(range(i * n_blocks, (i + 1) * n_blocks)), context - 1, [i]) for i in range(batch)],
                    [False] * batch, 16)


def run(rank: int, port: int, cases: list[tuple[int, int]], reps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for batch, context in cases:
        times = []
        p = plan(batch, context) if rank == 0 else None
        for i in range(reps + 5):
            box = [p]
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast_object_list(box, src=0)
            dist.barrier()  # the receiver has it: the time a step waits before rank 1 can start
            if i >= 5:
                times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"batch {batch:4d}  context {context:6d}  plan broadcast {statistics.median(times) * 1e3:8.3f} ms")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--context", default="512,4096")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    cases = [(int(b), int(c)) for b in a.batch.split(",") for c in a.context.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(run, args=(port, cases, a.reps), nprocs=2)


if __name__ == "__main__":
    main()
