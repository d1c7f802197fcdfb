"""The serving engine's decode on one GPU: graphs against eager, single stream and many, in one process.

One EngineCore (no HTTP) on the model; for each mode (decode graphs replayed, then the same engine with
its graphs set aside, i.e. eager) and each stream count: --runs timed rounds after a warm-up round, every
stream a random prompt of --prompt tokens and --gen greedy tokens (EOS ignored; sampled at --temperature with
a seed a stream where given), all added at once.
Decode rate = tokens after each stream's first / time from the step where every stream has its first
token to the end. Also pp (one --pp-token prompt, time to its first token) and, per mode, the decode step
of one stream under torch.profiler: wall time per step and the share of it with no kernel running.
First, where graphs are captured, 32 greedy tokens of 3 streams four ways, in this order: plain eager,
replayed, the graphs' static batch (padded to its bucket) run eagerly, and plain eager again; each pair says
whether and where it parts (the two eager runs: whether a run depends on what ran before it). Each run
starts with an empty prefix cache, so each computes every prompt row. On a mixture of experts with random
weights a last-bit difference can choose another expert and then another token with a wide margin, so a
parting there is not by itself a fault: it says where to look.
--fill-uninitialized: every fresh allocation filled with NaN (torch's deterministic mode, warnings only),
so a kernel that reads memory nothing wrote shows it in the outputs; the greedy check only, nothing timed.

    python benchmarks/bench_engine.py -m FILE [--streams 1,64] [--prompt 32] [--gen 128] [--pp 2048] [--runs 3] \
        [--spec-type draft-mtp] [--temperature 1.0]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vegaserve.engine.config import EngineConfig, merge_trees
from vegaserve.engine.env import config_from_env
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams, TokenLogprob
from vegaserve.server.bench_cmd import _timed_request
from vegaserve.triton_kernels import pdl


def decode_round(core: EngineCore, streams: int, prompt: int, gen: int, g: torch.Generator,
                 temperature: float = 0.0) -> float:
    """Aggregate decode tokens/s of `streams` requests run together (sampled with a seed each where
    `temperature` > 0, else greedy)."""
    vocab = core.arch.vocab_size
    reqs = [GenerateRequest(torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                            SamplingParams(max_tokens=gen, temperature=temperature, seed=i if temperature else None,
                                           ignore_eos=True)) for i in range(streams)]
    for r in reqs:
        core.add_request(r)
    counts = {r.request_id: 0 for r in reqs}
    t_all_first = None
    while core.has_work:
        for out in core.step():
            counts[out.request_id] += len(out.token_ids)
        if t_all_first is None and all(counts.values()):
            t_all_first, at_first = time.perf_counter(), sum(counts.values())
    end = time.perf_counter()
    return (sum(counts.values()) - at_first) / (end - t_all_first)


def greedy_tokens(core: EngineCore, n_streams: int, n: int, seed: int) -> list[list[TokenLogprob]]:
    """`n` greedy tokens of each of `n_streams` random prompts, each with its two best logprobs. The prefix
    cache is emptied first: a run that found an earlier run's blocks of the same prompts would compute fewer
    prompt rows, in other launches, and so would not be the same computation."""
    core.pool.reset_prefix_cache()
    g = torch.Generator().manual_seed(seed)
    reqs = [GenerateRequest(torch.randint(0, core.arch.vocab_size, (8 + 13 * i,), generator=g).tolist(),
                            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2))
            for i in range(n_streams)]
    for r in reqs:
        core.add_request(r)
    out: dict[str, list[TokenLogprob]] = {r.request_id: [] for r in reqs}
    while core.has_work:
        for o in core.step():
            out[o.request_id].extend(o.logprobs or [])
    return [out[r.request_id] for r in reqs]


def first_difference(a: list[TokenLogprob], b: list[TokenLogprob]) -> str | None:
    """Where two greedy streams part, and how close a call it was there: each side's margin between its two
    best logprobs (a near-tie parts streams on rounding alone), and the largest difference in the chosen
    token's logprob before it (how far apart the two computations are while they agree)."""
    i = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x.token_id != y.token_id), None)
    if i is None:
        return None
    margin = [t[i].top[0][1] - t[i].top[1][1] for t in (a, b)]
    drift = max((abs(x.logprob - y.logprob) for x, y in zip(a[:i], b[:i], strict=True)), default=0.0)
    return (f"token {i}: top-2 margin {margin[0]:.4f} / {margin[1]:.4f}, "
            f"largest |d logprob| before it {drift:.2e}")


def step_profile(core: EngineCore, steps: int, g: torch.Generator, host_table: str | None = None) -> tuple[float, float]:
    """(wall ms per decode step of one stream, share of the step with no kernel running); `host_table`:
    write the host ops that took the most self CPU time there."""
    from torch.profiler import ProfilerActivity, profile

    vocab = core.arch.vocab_size
    req = GenerateRequest(torch.randint(0, vocab, (16,), generator=g).tolist(),
                          SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    core.add_request(req)
    for _ in range(4):  # prefill and a few decode steps outside the window
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while core.has_work:
        core.step()
    if host_table:
        with open(host_table, "w") as f:
            f.write(pdl.PROFILE_NOTE if pdl.enabled(torch.device("cuda")) else "")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n")
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    return wall / steps * 1e3, 1.0 - busy / (wall * 1e6)


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _row(cells: tuple[str, ...]) -> None:
    """One table row, printed as soon as it is measured (a run cut short keeps what it had)."""
    print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--pp", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--tuning", default=None, help="kernel tuning file (default: configs/kernels/<target>.json)")
    ap.add_argument("--modes", default="graphs,eager", help="which of graphs, eager to time")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="decode rounds sampled at this temperature, a seed a stream (default: greedy)")
    ap.add_argument("--spec-type", default="none",
                    help="speculative decoding while timing (e.g. draft-mtp: on a random model almost no guess is "
                    "kept, so the decode rate against --spec-type none is the speculation's overhead)")
    ap.add_argument("--pp-table", default=None,
                    help="profile one more --pp prompt and write its kernels by device time to this file")
    ap.add_argument("--fill-uninitialized", action="store_true",
                    help="fill every fresh allocation with NaN (torch's deterministic mode), to expose reads of "
                    "memory nothing wrote; runs the greedy check only (nothing timed)")
    ap.add_argument("--host-table", default=None,
                    help="write the profiled graph-mode step's top host ops (self CPU time) and kernels "
                         "(device time) to this file")
    args = ap.parse_args()
    if args.fill_uninitialized:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    streams = [int(s) for s in args.streams.split(",")]
    ctx = max(args.pp, args.prompt) + args.gen + 16
    tree = {"model": {"path": args.model}, "cache": {"context_size": ctx, "kv_dtype": args.kv_dtype},
            "scheduler": {"max_num_seqs": max(streams), "max_num_batched_tokens": max(args.pp, 2048)},
            "kernels": {"tuning_file": args.tuning}, "device": "cuda", "speculative": {"type": args.spec_type}}
    cfg = EngineConfig.from_dict(merge_trees(config_from_env(), tree))  # the switches, e.g. VEGASERVE_PDL=0
    t0 = time.perf_counter()
    core = EngineCore(cfg, show_progress=False)
    worker = core.runner.executor.worker
    graphs = worker.graphs
    print(f"loaded in {time.perf_counter() - t0:.1f} s; KV {worker.cache.k.dtype}; graphs {graphs.buckets if graphs else None}")
    g = torch.Generator().manual_seed(0)
    result: dict[str, object] = {"model": args.model, "kv_dtype": str(worker.cache.k.dtype), "spec_type": args.spec_type}
    print("| test | mode | median tok/s | runs |\n|---|---|---|---|")
    if graphs is not None:  # the two modes must agree before their speeds mean anything
        worker.graphs = None
        first = greedy_tokens(core, 3, 32, seed=1)
        worker.graphs = graphs
        replayed = greedy_tokens(core, 3, 32, seed=1)
        # the graphs' static batch (padded to its bucket) run eagerly, without replay: where graphs and eager
        # part, this says whether the padded batch or the replay itself does it
        copied, graphs.copied = graphs.copied, None
        static = greedy_tokens(core, 3, 32, seed=1)
        graphs.copied = copied
        worker.graphs = None
        eager = greedy_tokens(core, 3, 32, seed=1)
        for name, a_run, b_run in (("graphs vs eager", replayed, eager), ("graphs vs static batch", replayed, static),
                                   ("static batch vs eager", static, eager),
                                   ("eager before the graphs vs eager after", first, eager)):
            parted = [first_difference(a, b) for a, b in zip(a_run, b_run, strict=True)]
            same = parted.count(None)
            if name == "graphs vs eager":
                result["greedy_identical_streams"] = same
            _row(("32 greedy tokens x 3 streams", name, f"{same}/3 identical",
                  "; ".join(f"stream {i} parts at {p}" for i, p in enumerate(parted) if p)))
    if args.fill_uninitialized:  # the fills cost time: no rate measured with them is printed
        print(json.dumps(result))
        return
    for mode in args.modes.split(","):
        worker.graphs = graphs if mode == "graphs" else None
        if mode == "graphs" and graphs is None:
            continue
        for n in streams:
            rates = [decode_round(core, n, args.prompt, args.gen, g, args.temperature)
                     for _ in range(args.runs + 1)][1:]
            med = statistics.median(rates)
            result[f"tg{args.gen}_{mode}_x{n}"] = med
            _row((f"tg{args.gen} x{n} streams", mode, f"{med:.1f}", " ".join(f"{r:.1f}" for r in rates)))
        ms, outside = step_profile(core, args.profile_steps, g, args.host_table if mode == "graphs" else None)
        result[f"step_ms_{mode}"], result[f"outside_kernels_{mode}"] = ms, outside
        _row(("decode step, 1 stream", mode, f"{ms:.3f} ms", f"{100 * outside:.1f}% outside kernels"))
    worker.graphs = graphs
    if args.pp:
        pps = [args.pp / _timed_request(core, args.pp, 1, g)[0] for _ in range(args.runs + 1)][1:]
        result[f"pp{args.pp}"] = statistics.median(pps)
        _row((f"pp{args.pp}", "-", f"{statistics.median(pps):.0f}", " ".join(f"{r:.0f}" for r in pps)))
        if args.pp_table:  # one more prompt under the profiler: its kernels by device time
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _timed_request(core, args.pp, 1, g)
                torch.cuda.synchronize()
            with open(args.pp_table, "w") as f:
                f.write(pdl.PROFILE_NOTE if pdl.enabled(torch.device("cuda")) else "")
                f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
    if core.spec is not None:
        st = core.stats()
        result["spec"] = {"drafts": st.spec_num_drafts, "draft_tokens": st.spec_num_draft_tokens,
                          "accepted": st.spec_num_accepted_tokens}
    print(json.dumps(result))
    core.close()


if __name__ == "__main__":
    main()
