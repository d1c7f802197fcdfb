"""`vegaserve bench -m FILE [-p 512,2048] [-n 128] [-r 3]`: llama-bench's pp/tg figures, measured on the
EngineCore (no HTTP).

- pp<N>: one prompt of N random token ids, from add_request to its first token: the prefill (and the one
  sample it ends with) at N / seconds tokens/s.
- tg<N>: after a one-token prompt, N + 1 greedy tokens with EOS ignored; the first one (the prefill) is
  timed apart, and the rate is N decode steps / their seconds.

Each test runs once to warm up, then r times with fresh random ids (so the prefix cache never hits); the
table gives median +- stddev, like llama-bench's `| model | size | params | backend | test | t/s |`, and
the last line of stdout is the same as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import gguf
import torch

from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams
from vegaserve.server.serve_cmd import load_core


@dataclass
class BenchResult:
    test: str  # pp512, tg128
    n_prompt: int
    n_gen: int
    samples: list[float]  # tokens/s of each repetition

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def stddev(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def _timed_request(core: EngineCore, n_prompt: int, max_tokens: int, gen: torch.Generator) -> tuple[float, float, int]:
    """Run one request alone: (seconds to the first token, seconds after it, tokens generated)."""
    ids = torch.randint(0, core.arch.vocab_size, (n_prompt,), generator=gen).tolist()
    req = GenerateRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    core.add_request(req)
    first = None
    n = 0
    while req.request_id in core.requests:
        for out in core.step():
            if out.request_id == req.request_id and out.token_ids:
                n += len(out.token_ids)
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"request {req.request_id} finished without a token")
    return first - t0, end - first, n


def run_test(core: EngineCore, kind: str, n: int, repetitions: int, gen: torch.Generator) -> BenchResult:
    samples: list[float] = []
    for rep in range(repetitions + 1):  # repetition 0 warms up
        if kind == "pp":
            t_first, _, _ = _timed_request(core, n, 1, gen)
            rate = n / t_first
        else:
            _, t_rest, produced = _timed_request(core, 1, n + 1, gen)
            rate = (produced - 1) / t_rest
        if rep:
            samples.append(rate)
    return BenchResult(f"{kind}{n}", n if kind == "pp" else 0, n if kind == "tg" else 0, samples)


def _describe(core: EngineCore) -> dict[str, object]:
    tensors = core.gguf.tensors.values()
    size = sum(t.n_bytes for t in tensors)
    params = sum(int(torch.Size(t.shape).numel()) for t in tensors)
    try:
        ft = gguf.LlamaFileType(int(core.gguf.metadata["general.file_type"]))
        type_label = ft.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (KeyError, ValueError):  # no known file type: the type holding the most bytes of the layers
        by_type: dict[str, int] = {}
        for t in (t for t in tensors if t.name.startswith("blk.")):
            by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
        type_label = max(by_type, key=by_type.__getitem__)
    dev = core.device
    backend = {"cpu": "CPU", "cuda": "ROCm" if torch.version.hip else "CUDA"}.get(dev.type, dev.type)
    return {
        "model": f"{core.arch.architecture} {type_label}",
        "file": core.gguf.path.name,
        "size_bytes": size,
        "params": params,
        "backend": backend,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "threads": torch.get_num_threads(),
    }


# llama-bench's columns: (title, width, alignment)
_COLS = (
    ("model", 30, "<"), ("size", 10, ">"), ("params", 10, ">"), ("backend", 10, "<"), ("test", 15, ">"),
    ("t/s", 20, ">"),
)  # fmt: skip


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, _COLS, strict=True)) + " |"


def run_bench(config: EngineConfig, n_prompt: list[int], n_gen: list[int], repetitions: int) -> int:
    if repetitions < 1:
        raise ConfigError(f"-r must be >= 1, got {repetitions}")
    if any(n < 0 for n in (*n_prompt, *n_gen)):
        raise ConfigError("-p and -n take token counts >= 0")
    tests = [("pp", n) for n in n_prompt if n] + [("tg", n) for n in n_gen if n]
    if not tests:
        raise ConfigError("nothing to measure: give -p or -n a count above 0")
    need = max(n_prompt, default=0) + max(n_gen, default=0) + 8
    if not config.cache.context_size:
        config = replace(config, cache=replace(config.cache, context_size=need))
    elif config.cache.context_size < need:
        raise ConfigError(f"-c {config.cache.context_size} is too small for these tests: they need {need} tokens")
    core = load_core(config)
    info = _describe(core)
    gen = torch.Generator().manual_seed(0 if config.seed is None else config.seed)
    print(_row([c for c, _, _ in _COLS]))
    print("| " + " | ".join(("-" * (w - 1) + ":") if a == ">" else "-" * w for _, w, a in _COLS) + " |")
    results = []
    for kind, n in tests:
        r = run_test(core, kind, n, repetitions, gen)
        results.append(r)
        cells = [
            str(info["model"]), f"{info['size_bytes'] / 2**30:.2f} GiB", f"{info['params'] / 1e9:.2f} B",
            str(info["backend"]), r.test, f"{r.median:.2f} ± {r.stddev:.2f}",
        ]  # fmt: skip
        print(_row(cells), flush=True)
    line = {
        **info,
        "repetitions": repetitions,
        "results": [{**asdict(r), "t_s_median": r.median, "t_s_stddev": r.stddev} for r in results],
    }
    print(json.dumps(line))
    sys.stdout.flush()
    return 0
