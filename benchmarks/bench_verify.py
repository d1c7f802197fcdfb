"""Speculative decoding's verify step against a plain decode step, on one GPU, in one process.

One EngineCore with `--spec-type ngram --draft-max R-1` (so that its verify graphs hold R rows a sequence)
on the model; `--streams` sequences, each with a random `--ctx`-token prompt in the KV cache. Then, per
stream count, the time of one step of each kind, run straight through the worker as the engine runs it
(host staging, copy, replay or eager launches, logits on the device):

    decode         one token a sequence, the decode graphs
    verify         R tokens a sequence (its last and R - 1 guesses), every row's logits, the verify graphs
    verify eager   the same step with the verify graphs set aside

A step's time is the median over --rounds of (--steps steps back to back, then a synchronize) / --steps.
The acceptance figure of speculative decoding is verify / decode at 1 stream (R = 5: <= 1.3x).

    python benchmarks/bench_verify.py -m FILE [--rows 5] [--streams 1,16] [--ctx 512] [--steps 20] [--rounds 7]
        [--kernel-table FILE]

--kernel-table writes, for the first stream count, each kind of step's kernels under torch.profiler (--steps
steps, replayed), sorted by device time: where a verify step's extra time goes.

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vegaserve.engine.config import EngineConfig, merge_trees
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.env import config_from_env
from vegaserve.engine.forward_batch import StepPlan
from vegaserve.triton_kernels import pdl


def step_ms(worker, plan: StepPlan, steps: int, rounds: int) -> float:
    for _ in range(3):
        worker.run(plan)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            worker.run(plan)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def kernel_table(worker, plan: StepPlan, steps: int) -> str:
    """The kernels of `steps` replays of `plan` by total device time, with their counts."""
    from torch.profiler import ProfilerActivity, profile

    worker.run(plan)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            worker.run(plan)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rows", type=int, default=5, help="rows a sequence in a verify step (draft-max + 1)")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--ctx", type=int, default=512, help="tokens already in each sequence's cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernel-table", default=None, help="write the first stream count's kernel tables here")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    R = args.rows
    tree = {"model": {"path": args.model}, "cache": {"context_size": args.ctx + R + 16},
            "scheduler": {"max_num_seqs": max(streams)}, "device": "cuda",
            "speculative": {"type": "ngram", "draft_max": R - 1}}
    cfg = EngineConfig.from_dict(merge_trees(config_from_env(), tree))
    t0 = time.perf_counter()
    core = EngineCore(cfg, show_progress=False)
    worker = core.runner.executor.worker
    verify_graphs = worker.verify_graphs
    print(f"loaded in {time.perf_counter() - t0:.1f} s; verify graphs "
          f"{verify_graphs.buckets if verify_graphs is not None else None} x {R} rows")
    bs = cfg.cache.block_size
    g = torch.Generator().manual_seed(0)
    vocab = core.arch.vocab_size
    n = max(streams)
    blocks = [core.pool.allocate(-(-(args.ctx + R) // bs)) for _ in range(n)]
    for b in blocks:  # the prompts into the cache, one at a time
        worker.run(StepPlan([(b, 0, torch.randint(0, vocab, (args.ctx,), generator=g).tolist())], [False], bs))
    torch.cuda.synchronize()
    tokens = torch.randint(0, vocab, (n, R), generator=g).tolist()
    result: dict[str, object] = {"model": args.model, "rows": R, "ctx": args.ctx}
    print("| streams | decode ms | verify ms | verify eager ms | verify / decode |\n|---|---|---|---|---|")
    for s in streams:
        decode = StepPlan([(blocks[i], args.ctx, tokens[i][:1]) for i in range(s)], [False] * s, bs)
        verify = StepPlan([(blocks[i], args.ctx, tokens[i]) for i in range(s)], [True] * s, bs)
        d = step_ms(worker, decode, args.steps, args.rounds)
        v = step_ms(worker, verify, args.steps, args.rounds)
        worker.verify_graphs = None
        e = step_ms(worker, verify, args.steps, args.rounds)
        worker.verify_graphs = verify_graphs
        print(f"| {s} | {d:.3f} | {v:.3f} | {e:.3f} | {v / d:.2f}x |", flush=True)
        result[f"s{s}"] = {"decode_ms": d, "verify_ms": v, "verify_eager_ms": e}
        if args.kernel_table and s == streams[0]:
            with open(args.kernel_table, "w") as f:
                f.write(pdl.PROFILE_NOTE if pdl.enabled(worker.device) else "")
                for name, plan in (("decode", decode), ("verify", verify)):
                    f.write(f"{name} step, {s} streams, {args.steps} steps\n{kernel_table(worker, plan, args.steps)}\n")
    print(json.dumps(result))
    core.close()


if __name__ == "__main__":
    main()
