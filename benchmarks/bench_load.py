"""Loading a model: how fast, against the file's own read rate, and how much device memory it takes.

1. The file's read rate: the whole file read once in order with O_DIRECT (the page cache bypassed, as `-lm
   dio` reads it), in 64 MiB reads; plain reads where the file system refuses O_DIRECT (said in the output).
2. The engine built on the file with `--load-mode`: the weights' part (read, repacked and placed on the
   device, as the loader logs it) and the whole start (with the KV cache and the decode graphs), each timed;
   the load rate is the weights' bytes over the weights' time.
3. Device memory (CUDA): the most in use while loading and once loaded, read with cudaMemGetInfo by a thread
   every 10 ms and less what was in use before (the CUDA context), against the file's tensor bytes (the
   weights) plus the KV cache's bytes.
4. Serving: --gen greedy tokens for a short prompt, so a load that leaves the model unusable does not count.

    python benchmarks/bench_load.py -m FILE [--load-mode dio] [--context 8192] [--seqs 4] [--device cuda]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import mmap
import os
import threading
import time
from pathlib import Path

import torch

from vegaserve.engine.config import EngineConfig, merge_trees
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.env import config_from_env
from vegaserve.engine.gguf_file import GGUFFile
from vegaserve.engine.request import GenerateRequest, SamplingParams

CHUNK = 64 << 20


def read_rate(path: Path) -> tuple[float, bool]:
    """(bytes per second of one ordered pass over the file, whether O_DIRECT was used)."""
    size = path.stat().st_size
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDONLY | direct)
    except OSError:
        fd, direct = os.open(path, os.O_RDONLY), 0
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    try:
        with memoryview(buf) as view:
            t0 = time.perf_counter()
            got = 0
            while got < size:
                try:
                    n = os.preadv(fd, [view], got)
                except OSError:
                    if not direct:
                        raise
                    os.close(fd)  # refused at the first read (some file systems open, then fail)
                    fd, direct = os.open(path, os.O_RDONLY), 0
                    continue
                if not n:
                    break
                got += n
            elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    if got != size:
        raise RuntimeError(f"{path}: read {got} of {size} bytes")
    return size / elapsed, bool(direct)


class DeviceMemory:
    """The most device memory in use (by anything) while running, sampled every `every` seconds."""

    def __init__(self, device: torch.device, every: float = 0.01) -> None:
        self.device, self.every = device, every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            self._stop.wait(self.every)

    def __enter__(self) -> DeviceMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())


class WeightLoad(logging.Handler):
    """The loader's own figures for the weights (models/registry.load_model's log record)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.bytes, self.seconds = 0, 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "weight_seconds"):
            self.bytes += record.weight_bytes
            self.seconds += record.weight_seconds

    def __enter__(self) -> WeightLoad:
        logger = logging.getLogger("vegaserve.engine.models.registry")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("vegaserve.engine.models.registry")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def serve(core: EngineCore, n: int) -> list[int]:
    req = GenerateRequest(core.tokenizer.encode("The capital of France is"),
                          SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    core.add_request(req)
    out: list[int] = []
    while core.has_work:
        for o in core.step():
            out.extend(o.token_ids)
    return out


def measure(path: Path, load_mode: str, context: int, seqs: int, gen: int, device: str) -> dict[str, object]:
    rate, direct = read_rate(path)
    weights = sum(t.n_bytes for t in GGUFFile(path).tensors.values())
    tree = {"model": {"path": str(path), "load_mode": load_mode}, "cache": {"context_size": context},
            "scheduler": {"max_num_seqs": seqs}, "device": device}
    cfg = EngineConfig.from_dict(merge_trees(config_from_env(), tree))
    cuda = device.startswith("cuda")
    if cuda:
        dev = torch.device(device)
        torch.zeros(1, device=dev)  # the context, counted in the baseline
        torch.cuda.synchronize(dev)
        mem = DeviceMemory(dev)
        before = mem.used()
    with WeightLoad() as wl, (mem if cuda else contextlib.nullcontext()):
        t0 = time.perf_counter()
        core = EngineCore(cfg, show_progress=True)
        if cuda:
            torch.cuda.synchronize(dev)
        start_s = time.perf_counter() - t0
    if not wl.seconds:
        raise RuntimeError("the loader logged no weight load (models/registry.load_model's record)")
    if cuda:
        loaded, peak = mem.used() - before, mem.peak - before  # before serving: what the load left in use
    kv = core.runner.cache.nbytes
    tokens = serve(core, gen)
    core.close()
    result: dict[str, object] = {
        "file": str(path), "file_bytes": path.stat().st_size, "load_mode": load_mode, "read_rate_gbs": rate / 1e9,
        "o_direct": direct, "weights_read_bytes": wl.bytes, "weights_load_s": wl.seconds,
        "load_rate_gbs": wl.bytes / wl.seconds / 1e9, "load_share_of_read_rate": wl.bytes / wl.seconds / rate,
        "engine_start_s": start_s, "weight_bytes": weights, "kv_bytes": kv, "served_tokens": len(tokens),
    }
    if cuda:
        result |= {"device_bytes_loaded": loaded, "device_bytes_peak": peak,
                   "peak_over_weights_kv": peak / (weights + kv), "loaded_over_weights_kv": loaded / (weights + kv)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True, type=Path)
    ap.add_argument("--load-mode", default="dio", choices=["mmap", "read", "dio"])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    r = measure(args.model, args.load_mode, args.context, args.seqs, args.gen, args.device)
    gb = 1e9
    rows = [
        ("file", f"{r['file_bytes'] / gb:.2f} GB"),
        ("read rate" + ("" if r["o_direct"] else " (plain reads: O_DIRECT refused)"), f"{r['read_rate_gbs']:.2f} GB/s"),
        (f"weights read (-lm {r['load_mode']}) and placed", f"{r['weights_read_bytes'] / gb:.2f} GB in "
         f"{r['weights_load_s']:.1f} s, {r['load_rate_gbs']:.2f} GB/s, {100 * r['load_share_of_read_rate']:.0f}% "
         "of the read rate"),
        ("engine start (weights, KV cache, decode graphs)", f"{r['engine_start_s']:.1f} s"),
        ("weights + KV cache", f"{r['weight_bytes'] / gb:.2f} + {r['kv_bytes'] / gb:.2f} GB"),
    ]
    if "device_bytes_peak" in r:
        rows += [("device memory, loaded", f"{r['device_bytes_loaded'] / gb:.2f} GB "
                                           f"({100 * r['loaded_over_weights_kv']:.1f}% of weights + KV)"),
                 ("device memory, most while loading", f"{r['device_bytes_peak'] / gb:.2f} GB "
                                                       f"({100 * r['peak_over_weights_kv']:.1f}% of weights + KV)")]
    rows.append(("served", f"{r['served_tokens']} of {args.gen} greedy tokens"))
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
