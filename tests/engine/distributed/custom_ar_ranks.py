"""One rank of the GPU tests of the custom AllReduce (test_custom_allreduce_gpu.py), run as a script:

    python custom_ar_ranks.py RANK WORLD PORT ITERS

Ranks share GPU `rank % device_count` (several processes on one GPU talk through CUDA / HIP IPC as ranks on
different GPUs do). Opens the peer buffers over a gloo group, then:
- sizes 4 KiB to 8 MiB, one-shot and two-shot: each rank's result equal, bit for bit, to the f32 sum in rank
  order of every rank's partial (each rank builds all partials from their seeds), within 1e-6 (relative
  norm) of the float64 sum, and the same bytes on every rank (digests gathered);
- ITERS AllReduces back to back with no host synchronization between them, one-shot and two-shot in turn
  (the epoch and the one-shot halves reused thousands of times), summed on the device and checked once;
- one AllReduce captured in a CUDA graph and replayed 100 times (the epoch lives on the device);
- the communicator's path: TorchCommunicator with the custom AllReduce asked for takes it below the gate
  and NCCL's / gloo's above it.
Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist

from vegaserve.engine.distributed.allreduce_policy import AllReduceSwitches
from vegaserve.engine.distributed.communicator import TorchCommunicator
from vegaserve.engine.distributed.custom_allreduce import open_custom_allreduce
from vegaserve.engine.distributed.topology import Topology
from vegaserve.triton_kernels.allreduce import reference_all_reduce

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20]  # bytes of f32


def partial(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)


def main() -> None:
    rank, world, port, iters = (int(a) for a in sys.argv[1:5])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    out: dict = {"rank": rank}
    comm = TorchCommunicator(Topology(world, 1), rank, f"tcp://127.0.0.1:{port}", device, gloo=True,
                             allreduce=AllReduceSwitches(custom=True))
    out["communicator_custom"] = comm.custom is not None
    custom, reason = open_custom_allreduce(list(range(world)), rank, device, SIZES[-1], 1024, 4, comm.control)
    out["reason"] = reason
    if custom is None:
        print(json.dumps(out))
        return
    checks = []
    for two_shot in (False, True):
        for size in SIZES:
            n = size // 4
            parts = [partial(r, n) for r in range(world)]
            x = parts[rank].to(device)
            custom.all_reduce(x, two_shot)
            got = x.cpu()
            exact = torch.stack([p.double() for p in parts]).sum(0)
            digests: list = [None] * world
            dist.all_gather_object(digests, hashlib.sha256(got.numpy().tobytes()).hexdigest(), group=comm.control)
            checks.append({"two_shot": two_shot, "bytes": size,
                           "bitwise_rank_order": torch.equal(got, reference_all_reduce(parts)),
                           "rel_err": float((got.double() - exact).norm() / exact.norm()),
                           "same_on_every_rank": len(set(digests)) == 1})
    out["checks"] = checks

    x = torch.empty(4096, device=device)  # 16 KiB: a decode step's hidden state
    acc = torch.zeros(4096, dtype=torch.float64, device=device)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(iters):
        x.fill_(rank + 1 + i % 3)
        custom.all_reduce(x, two_shot=bool(i % 2))
        acc += x
    torch.cuda.synchronize()
    out["back_to_back_us"] = (time.perf_counter() - t) / iters * 1e6
    want = sum(world * (world + 1) / 2 + world * (i % 3) for i in range(iters))
    out["back_to_back_ok"] = bool((acc == want).all())

    graph = torch.cuda.CUDAGraph()
    acc.zero_()
    with torch.cuda.graph(graph):
        x.fill_(rank + 1)
        custom.all_reduce(x, two_shot=False)
        acc += x
        x.fill_(rank + 1)
        custom.all_reduce(x, two_shot=True)
        acc += x
    dist.barrier(group=comm.control)
    acc.zero_()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    out["graph_ok"] = bool((acc == 200 * world * (world + 1) / 2).all())

    small = torch.full((1024,), float(rank + 1), device=device)
    big = torch.full((comm.custom.max_bytes // 4 + 1,), float(rank + 1), device=device) if comm.custom else small
    comm.all_reduce(small)
    comm.all_reduce(big)
    out["communicator_ok"] = bool((small == world * (world + 1) / 2).all() and (big == world * (world + 1) / 2).all())
    custom.close()
    comm.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
