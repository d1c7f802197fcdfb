"""Conversations on a hybrid model: each turn's time to its first token with prefix caching at saved states
(the default --prefix-states) and without it (--prefix-states 0), one engine after the other in one process.

A conversation is --turns requests: the first a --first-token prompt, each later one the previous prompt,
its reply (--gen greedy tokens, EOS ignored) and --user new tokens, as a chat client sends them. --convs
conversations run one after another, each with its own random tokens and the same --system-token head (a
shared system prompt), after one warm-up conversation. Prints the median time to first token of each turn
for both engines, their ratio, and one JSON line.

    python benchmarks/bench_turns.py -m FILE [--first 2048] [--user 128] [--gen 64] [--turns 4] [--convs 3] \
        [--system 512] [-c 16384] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams


def _request(core: EngineCore, prompt: list[int], gen: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the reply) of one request run alone."""
    req = GenerateRequest(list(prompt), SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    core.add_request(req)
    first, reply = None, []
    while req.request_id in core.requests:
        for out in core.step():
            if out.request_id == req.request_id and out.token_ids:
                first = first or time.perf_counter()
                reply.extend(out.token_ids)
    return first - t0, reply


def conversations(core: EngineCore, args, seed: int) -> list[list[float]]:
    """Each conversation's time to first token per turn."""
    g = torch.Generator().manual_seed(seed)
    vocab = core.arch.vocab_size
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = rand(args.system)
    times = []
    for _ in range(args.convs):
        prompt, mine = system + rand(args.first - args.system), []
        for _ in range(args.turns):
            t, reply = _request(core, prompt, args.gen)
            mine.append(t)
            prompt = prompt + reply + rand(args.user)
        times.append(mine)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--first", type=int, default=2048)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--convs", type=int, default=3)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("-c", "--ctx-size", type=int, default=16384)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if not 0 <= args.system <= args.first:
        ap.error("--system must be between 0 and --first")
    result = {}
    for name, saved in (("saved states", None), ("recomputed", 0)):
        cfg = EngineConfig.from_dict({"model": {"path": args.model}, "device": args.device,
                                      "cache": {"context_size": args.ctx_size, "prefix_states": saved}})
        core = EngineCore(cfg, show_progress=False)
        try:
            if core.arch.hybrid is None:
                ap.error(f"{args.model} is not a hybrid model ({core.arch.architecture}): its prefix cache needs no "
                         "saved states")
            conversations(core, argparse.Namespace(**{**vars(args), "convs": 1}), seed=1)  # warm-up
            times = conversations(core, args, seed=2)
        finally:
            core.close()
        result[name] = [statistics.median(t[i] for t in times) for i in range(args.turns)]
    print(f"{'turn':>4} {'prompt':>7} {'saved states (s)':>17} {'recomputed (s)':>15} {'ratio':>6}")
    for i, (a, b) in enumerate(zip(result["saved states"], result["recomputed"], strict=True)):
        n = args.first + i * (args.gen + args.user)
        print(f"{i + 1:>4} {n:>7} {a:>17.4f} {b:>15.4f} {b / a:>6.2f}")
    print(json.dumps({"model": args.model, "ttft_s": result, **vars(args)}))


if __name__ == "__main__":
    main()
