"""The step plan's hand-off from rank 0 to the other ranks: the shared-memory ring (engine/distributed/
plan_ring.py) against the gloo broadcast it replaces, with reader processes on this host.

Two measurements per transport:
- step latency: rank 0 sends a plan `--gap-us` after every reader holds the previous one (as in serving,
  where the workers wait a step's time for the next plan); the latency of a step is the time from encoding
  it until the last reader has decoded it (clock: CLOCK_MONOTONIC, one clock for every process). Reported:
  median, p90, p99.
- throughput: plans sent back to back; plans per second until every reader has the last one.
Every reader checks that it got every plan, in order, and equal to what was sent.

The plans are a decode step's StepPlans (`--seqs` sequences, each `--blocks` KV blocks at first and a token
more every step), keyed and sent as their changes as the executor sends them (`--whole`: whole, as plans
without keys go); `--big` sends a prefill-sized plan that spans several ring slots.

    python benchmarks/bench_plan_ring.py [--readers 4] [--plans 100000] [--seqs 16] [--blocks 64] [--gloo]
                                         [--whole] [--gap-us 1000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from dataclasses import replace

import numpy as np

from vegaserve.engine.distributed.plan_codec import PlanDecoder, PlanEncoder
from vegaserve.engine.distributed.plan_ring import PlanRing
from vegaserve.engine.forward_batch import StepPlan


def make_plan(seqs: int, blocks: int, tokens: int = 1, step: int = 0) -> StepPlan:
    """Step `step` of `seqs` sequences decoding side by side, each `blocks` KV blocks of 16 at step 0 and a
    token more every step (a block more every 16), a key a sequence as the engine gives each block table."""
    plan = []
    for i in range(seqs):
        start = blocks * 16 - 5 + step
        n = (start + tokens + 15) // 16
        plan.append((list(range(i * 1_000_000, i * 1_000_000 + n)), start, list(range(7, 7 + tokens))))
    return StepPlan(plan, [False] * seqs, 16, keys=tuple(f"req-{i}" for i in range(seqs)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Gloo:
    """The transport the ring replaces: broadcast_object_list over a gloo group."""

    def __init__(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def put(self, obj: object) -> None:
        self.dist.broadcast_object_list([obj], src=0)

    def get(self) -> object:
        box = [None]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


def reader_main(transport: str, where: str | int, reader: int, world: int, n_steps: int, shape: tuple, whole: bool,
                out, acks) -> None:
    if transport == "ring":
        end = PlanRing.attach(where, reader)  # type: ignore[arg-type]
        acks.put(reader)
    else:
        end = _Gloo(reader + 1, world, where)  # type: ignore[arg-type]
    arrived, expect = [], 0
    ok = True
    plans = PlanDecoder()
    while True:
        msg = end.get()
        if msg is None:
            break
        i, _sent, wire = msg  # type: ignore[misc]
        p = plans.decode(wire)
        now = time.monotonic_ns()
        want = make_plan(*shape, step=i)
        ok &= i == expect and p == (replace(want, keys=()) if whole else want)
        expect += 1
        arrived.append(now)
        if transport == "gloo" and i < n_steps:
            end.dist.barrier()  # type: ignore[attr-defined]
    out.send((ok, expect, np.asarray(arrived, dtype=np.int64)))
    if transport == "ring":
        end.close()


def run(transport: str, readers: int, n_steps: int, n_stream: int, shape: tuple, whole: bool,
        gap_s: float) -> dict:
    ctx = mp.get_context("fork")  # fast start; the readers import nothing new
    acks = ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(readers)]
    if transport == "ring":
        ring = PlanRing.create(readers)
        where: str | int = ring.name
    else:
        where = _free_port()
    procs = [ctx.Process(target=reader_main, args=(transport, where, r, readers + 1, n_steps, shape, whole, pipes[r][1],
                                                        acks))
             for r in range(readers)]
    for p in procs:
        p.start()
    if transport == "ring":
        for _ in range(readers):
            acks.get(timeout=60)
        ring.unlink()
        ring.check_peers()
        end = ring
    else:
        end = _Gloo(0, readers + 1, where)  # type: ignore[arg-type]

    plans = [make_plan(*shape, step=i) for i in range(n_steps + n_stream)]
    if whole:  # every plan whole, as before plans went as changes
        plans = [replace(p, keys=()) for p in plans]
    codec = PlanEncoder()
    sent = np.zeros(n_steps + n_stream, dtype=np.int64)
    for i in range(n_steps):  # step latency: the next plan a step's time after every reader holds this one
        sent[i] = time.monotonic_ns()
        end.put((i, sent[i], codec.encode(plans[i])))
        if transport == "ring":
            while ring.consumed() < ring.written:
                time.sleep(20e-6)
        else:
            end.dist.barrier()  # type: ignore[attr-defined]
        pause = time.perf_counter() + gap_s  # rank 0 busy with the step (sampling, scheduling), not asleep
        while time.perf_counter() < pause:
            pass
    t0 = time.monotonic_ns()
    for i in range(n_steps, n_steps + n_stream):
        sent[i] = time.monotonic_ns()
        end.put((i, sent[i], codec.encode(plans[i])))
    end.put(None)
    results = [pipes[r][0].recv() for r in range(readers)]
    for p in procs:
        p.join(timeout=60)
    if transport == "ring":
        ring.close()
    else:
        end.dist.destroy_process_group()  # type: ignore[attr-defined]
    ok = all(r[0] and r[1] == n_steps + n_stream for r in results)
    arrived = np.stack([r[2] for r in results])
    last = np.max(arrived, axis=0)  # when the last reader had each plan
    lat = (last[:n_steps] - sent[:n_steps]) / 1e3
    first = (np.min(arrived, axis=0)[:n_steps] - sent[:n_steps]) / 1e3
    wall = (last[-1] - t0) / 1e9 if n_stream else float("nan")
    return {"transport": transport, "readers": readers, "in_order": ok, "steps": n_steps,
            "median_us": float(np.median(lat)), "p90_us": float(np.percentile(lat, 90)),
            "p99_us": float(np.percentile(lat, 99)), "first_reader_median_us": float(np.median(first)),
            "stream_plans": n_stream,
            "plans_per_s": n_stream / wall if n_stream else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--plans", type=int, default=100_000, help="plans in all, half step-timed, half streamed")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--big", action="store_true", help="a prefill plan of 8 x 256 tokens at 64k context (spans several slots)")
    ap.add_argument("--gloo", action="store_true", help="also time the gloo broadcast (fewer plans: it is slow)")
    ap.add_argument("--whole", action="store_true", help="send every plan whole, not as its changes")
    ap.add_argument("--gap-us", type=float, default=1000.0,
                    help="the step-timed plans' pause after every reader has the last one (a decode step)")
    args = ap.parse_args()
    shape = (8, 4096, 256) if args.big else (args.seqs, args.blocks)
    import pickle

    codec = PlanEncoder()
    first = make_plan(*shape)
    sizes = [len(pickle.dumps((0, 0, codec.encode(p if not args.whole else replace(p, keys=()))),
                              protocol=pickle.HIGHEST_PROTOCOL)) for p in (first, make_plan(*shape, step=1))]
    print(f"plan: {sizes[0]} bytes pickled, the next {sizes[1]}{' (whole)' if args.whole else ''}; "
          f"{args.readers} readers; {os.cpu_count()} cores", file=sys.stderr)
    size = sizes[1]
    gap = args.gap_us * 1e-6
    rows = [run("ring", args.readers, args.plans // 2, args.plans - args.plans // 2, shape, args.whole, gap)]
    if args.gloo:
        n = min(args.plans, 4000)
        rows.append(run("gloo", args.readers, n // 2, n - n // 2, shape, args.whole, gap))
    print(f"{'transport':>9} {'in order':>8} {'median us':>9} {'p90 us':>8} {'p99 us':>8} {'first us':>8} "
          f"{'plans/s':>9}")
    for r in rows:
        print(f"{r['transport']:>9} {str(r['in_order']):>8} {r['median_us']:9.1f} {r['p90_us']:8.1f} "
              f"{r['p99_us']:8.1f} {r['first_reader_median_us']:8.1f} {r['plans_per_s']:9.0f}")
    for r in rows:
        print(json.dumps({"bench": "plan_ring", "plan_bytes": size, **r}))
    if not all(r["in_order"] for r in rows):
        raise SystemExit("a reader missed a plan or got one out of order")


if __name__ == "__main__":
    main()
