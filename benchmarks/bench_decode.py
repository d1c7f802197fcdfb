"""Single-stream decode and prefill speed of the engine on any GGUF (default: the embedded SmolLM2).

Runs the EngineCore directly (no HTTP): a prompt of --prompt tokens, then --gen greedy tokens with EOS
ignored, --runs times; reports the median prefill and decode rates. Prints a table and one JSON line.

    python benchmarks/bench_decode.py [-m FILE] [--threads 2] [--prompt 32] [--gen 128] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig.from_dict(
        {"model": {"path": args.model}, "cache": {"context_size": args.prompt + args.gen + 8}, "device": args.device}
    )
    core = EngineCore(cfg, show_progress=False)
    gen = torch.Generator().manual_seed(0)
    vocab = core.arch.vocab_size
    prefill, decode = [], []
    for run in range(args.runs + 1):  # run 0 warms up
        ids = torch.randint(100, min(vocab, 30000), (args.prompt,), generator=gen).tolist()
        req = GenerateRequest(ids, SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True))
        core.add_request(req)
        t0 = time.perf_counter()
        first = None
        n = 0
        while core.has_work:
            for out in core.step():
                n += len(out.token_ids)
                if first is None and out.token_ids:
                    first = time.perf_counter()
        t1 = time.perf_counter()
        if run == 0:
            continue
        prefill.append(args.prompt / (first - t0))
        decode.append((n - 1) / (t1 - first))
    result = {
        "bench": "decode",
        "model": core.gguf.path.name,
        "device": str(core.device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "prompt": args.prompt,
        "gen": args.gen,
        "runs": args.runs,
        "prefill_tok_s_median": round(statistics.median(prefill), 1),
        "decode_tok_s_median": round(statistics.median(decode), 2),
        "decode_tok_s_all": [round(x, 2) for x in decode],
    }
    print(f"{'model':40s} {'device':8s} {'thr':>3s} {'pp t/s':>9s} {'tg t/s':>8s}")
    print(f"{result['model']:40s} {result['device']:8s} {result['threads']:3d} {result['prefill_tok_s_median']:9.1f} {result['decode_tok_s_median']:8.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
