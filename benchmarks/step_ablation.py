"""Where a decode step's time goes inside its graph: the one-sequence decode graph captured again with one
class of kernels left out at a time, each replayed on its own; the difference to the whole graph is what
that class costs there, launches, waits and overlap included (a profiler's per-kernel durations under
programmatic dependent launch count the time a kernel waits for the one before it).

    python benchmarks/step_ablation.py -m FILE [--context 128] [--replays 50] [--rounds 15]

A left-out op returns an uninitialised tensor of its output's shape (torch.empty launches nothing), so the
logits of an ablated graph are garbage; only its time means anything. Also timed: the engine's whole
decode step (host plan, staging, replay, sampling), one stream, so the share outside the graph shows.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from vegaserve.engine.config import EngineConfig, merge_trees
from vegaserve.engine.cuda_graphs import DecodeGraphs
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.env import config_from_env
from vegaserve.engine.layers import linear, norm, rotary
from vegaserve.engine.models import llama
from vegaserve.engine.request import GenerateRequest, SamplingParams
from vegaserve.triton_kernels import attention, matvec_int8


@contextlib.contextmanager
def patched(obj: object, name: str, value: object) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _no_matmul(self, layer, x, q8_1=None):
    return torch.empty(x.shape[0], layer.out_features, device=x.device)


_q8_1_cache: dict[tuple, tuple] = {}
_real_quantize = matvec_int8.quantize_q8_1


def _cached_q8_1(x):
    """A q8_1 copy of x's shape: made in the eager warm-up runs, handed out with no launch in the capture."""
    key = tuple(x.shape)
    if torch.cuda.is_current_stream_capturing():
        return _q8_1_cache[key]
    _q8_1_cache[key] = out = _real_quantize(x.contiguous())
    return out


def _no_attend(q, *args, q8_1=False, **kwargs):
    out = torch.empty_like(q)
    return (out, _cached_q8_1(out.reshape(q.shape[0], -1))) if q8_1 else out


def _no_attend_rope(qk, v, rope, layer, cache, batch, scale, n_heads, want_q8_1=False):
    out = torch.empty(qk.shape[0], n_heads, qk.shape[2], device=qk.device, dtype=qk.dtype)
    return out, _cached_q8_1(out.reshape(qk.shape[0], -1)) if want_q8_1 else None


def _no_norm(self, x):
    return x


def _no_norm_q8_1(self, x, want):
    return x, _cached_q8_1(x) if want and x.is_cuda else None


def _no_add_norm(self, h, delta, want_q8_1=False):
    return h, h, _cached_q8_1(h) if want_q8_1 else None


def _no_rope(self, x, positions, store=None):
    return x


def _no_silu(gate_up, want):
    y = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, device=gate_up.device, dtype=gate_up.dtype)
    return y, _cached_q8_1(y) if want else None


def _split_cat(real: Callable) -> Callable:
    def cat(tensors, dim=0, **kw):  # the mixed-type outputs' cat, left out: the first part's storage
        if torch.cuda.is_current_stream_capturing() and len(tensors) > 1 and dim == -1:
            t = tensors[0]
            return torch.empty(*t.shape[:-1], sum(x.shape[-1] for x in tensors), device=t.device, dtype=t.dtype)
        return real(tensors, dim=dim, **kw)
    return cat


def ablations() -> dict[str, list[tuple[object, str, object]]]:
    quant = [(matvec_int8, "quantize_q8_1", _cached_q8_1)]
    attend = [(attention, "attend", _no_attend), (llama, "decode_attention_rope", _no_attend_rope)]
    write = [(attention, "write_kv", lambda *a, **k: None), (llama, "kv_store", lambda *a, **k: None)]
    norms = [(norm.RMSNorm, "forward", _no_norm), (norm.RMSNorm, "forward_q8_1", _no_norm_q8_1),
             (norm.RMSNorm, "add_forward", _no_add_norm)]
    rope = [(rotary.RotaryEmbedding, "forward", _no_rope)]
    silu = [(llama, "silu_mul_q8_1", _no_silu)]
    cat = [(linear.torch, "cat", _split_cat(torch.cat))]
    matmul = [(linear.TritonMethod, "apply", _no_matmul)]
    small = quant + attend + write + norms + rope + silu + cat
    return {
        "whole graph": [], "- q8_1 quantize launches": quant,
        "- attention (decode: with RoPE and the KV write)": attend, "- KV write (rope's store)": write,
        "- norms": norms, "- RoPE": rope, "- SiLU-mul": silu, "- cat of mixed types": cat,
        "- every mat-vec (and its quantize)": matmul, "mat-vecs and quantize only": small[1:],
        "mat-vecs only": small,
    }


def time_replays(graph: torch.cuda.CUDAGraph, replays: int, rounds: int) -> float:
    """Median ms per replay over rounds of `replays` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    out = []
    for _ in range(rounds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / replays)
    return statistics.median(out)


def step_ms(core: EngineCore, gen: int) -> float:
    """The engine's decode step of one stream, wall ms (the median over decode steps)."""
    req = GenerateRequest(list(range(1, 17)), SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    core.add_request(req)
    core.step()  # the prefill
    times = []
    while core.has_work:
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--context", type=int, default=128, help="keys each replay attends over")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", default=None, help="comma-separated ablation names to run (default: all)")
    args = ap.parse_args()
    ctx = args.context + 64
    tree = {"model": {"path": args.model}, "cache": {"context_size": ctx},
            "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 2048}, "device": "cuda"}
    core = EngineCore(EngineConfig.from_dict(merge_trees(config_from_env(), tree)), show_progress=False)
    worker = core.runner.executor.worker
    base = worker.graphs
    result = {"model": args.model, "context": args.context, "engine_step_ms": step_ms(core, 64)}
    bs = base.block_size
    seqs = [(list(range(-(-args.context // bs))), args.context - 1, [1])]
    rows = []
    wanted = None if args.only is None else set(args.only.split(","))
    for name, patches in ablations().items():
        if wanted is not None and name not in wanted and name != "whole graph":
            continue
        g = DecodeGraphs(base.model, base.cache, 1, base.max_model_len, bs, base.device)
        with contextlib.ExitStack() as stack:
            for obj, attr, value in patches:
                stack.enter_context(patched(obj, attr, value))
            g.capture()
        g.run(seqs)  # stages the sequence; the replays below reuse it
        torch.cuda.synchronize()
        ms = time_replays(g.graphs[1][0], args.replays, args.rounds)
        result[name] = ms
        rows.append((name, ms))
        del g
        torch.cuda.empty_cache()
    whole = result["whole graph"]
    print(f"engine decode step (host, staging, replay, sampling): {result['engine_step_ms']:.3f} ms; "
          f"graph replay alone {whole:.3f} ms")
    print("| graph | ms per replay | difference to the whole graph |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {ms - whole:+.3f} |")
    print(json.dumps(result))
    core.close()


if __name__ == "__main__":
    main()
