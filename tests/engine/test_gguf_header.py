"""engine/gguf_header.py: the header is read as gguf-py reads it, and a damaged or hostile header is refused
with one line naming the file and the field, in bounded time and memory.

The fuzz test mutates the header, metadata and tensor index of a tiny valid GGUF a thousand times (fixed
seed), in a child process whose address space is capped, so a loader that allocates without end fails the
case instead of taking the machine's memory. This module is that child's script too (`__main__` below).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest

from vegaserve.engine.config import ConfigError
from vegaserve.engine.gguf_file import GGUFFile, ModelLoadError, default_model_path

N_CASES = 1000
SEED = 33
CASE_LIMIT_S = 2.0
GROWTH_LIMIT = 200 * 2**20
# A file whose first array declares 2**62 uint32 elements: gguf-py's reader grew to 8 GB on it.
CRAFTED = b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 3) + b"abc" + struct.pack("<IIQ", 9, 4, 2**62)


def _load_test_gguf_file() -> ModuleType:
    """tests/engine/test_gguf_file.py: its small-vocabulary writer (loaded by path, as the suite does)."""
    name = "vegaserve_tests_engine_test_gguf_file"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_gguf_file.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def write_seed_file(path: Path) -> Path:
    """The valid file the mutations start from: one layer, hidden 64, 512 tokens: 87 KB."""
    files = _load_test_gguf_file()
    return files.write_tiny(path, files.factory.TinySpec(n_layers=1, hidden=64, n_heads=2, n_kv_heads=1, ffn=128,
                                                         context=64))


# -- the header as gguf-py reads it ---------------------------------------------------------------------


def gguf_py_view(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int, tuple[int, ...]]]]:
    """(metadata, {tensor: (absolute offset, bytes, shape)}) as gguf-py's own reader gives them."""
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (int(t.data_offset), int(t.n_bytes), tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    return metadata, tensors


def our_view(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, int, tuple[int, ...]]]]:
    f = GGUFFile(path)
    return f.metadata, {n: (i.offset, i.n_bytes, i.shape) for n, i in f.tensors.items()}


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_metadata_and_tensor_index_equal_gguf_py_reading(which: str, tmp_path: Path) -> None:
    path = write_seed_file(tmp_path / "seed.gguf") if which == "tiny" else default_model_path()
    ours, theirs = our_view(path), gguf_py_view(path)
    assert ours[0] == theirs[0]
    assert ours[1] == theirs[1]


def test_the_crafted_array_count_is_one_line_in_bounded_time_and_memory(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(CRAFTED)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ModelLoadError) as e:
            GGUFFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert message.startswith(f"{path}: metadata key 'abc': an array of {2**62} UINT32") and "\n" not in message
    assert time.perf_counter() - started < CASE_LIMIT_S and peak < 2**20


# -- mutations ------------------------------------------------------------------------------------------


def structure(path: Path) -> tuple[list[tuple[int, int, str]], int]:
    """([(offset, size, name)] of every count, length, type, dimension and offset in the header, the scalar
    values too), and where the tensor data starts: gguf-py's reading of the valid file, an independent map."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data
    slots: list[tuple[int, int, str]] = []

    def add(part: np.ndarray, name: str) -> None:
        if part.nbytes and part.nbytes <= 8:
            slots.append((part.ctypes.data - base, part.nbytes, name))

    for key, field in reader.fields.items():
        parts = field.parts
        if key.startswith("GGUF."):
            add(parts[0], key)
            continue
        add(parts[0], f"{key} key length")
        add(parts[2], f"{key} value type")
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.STRING:
            add(parts[3], f"{key} string length")
        elif vtype == gguf.GGUFValueType.ARRAY:
            add(parts[3], f"{key} item type")
            add(parts[4], f"{key} array length")
            if field.types[-1] == gguf.GGUFValueType.STRING:
                for i in range(5, min(len(parts), 25), 2):  # the first few elements' lengths
                    add(parts[i], f"{key} element length")
        else:
            add(parts[3], f"{key} value")
    for t in reader.tensors:
        name_len, _, n_dims, dims, raw_type, offset = t.field.parts
        add(name_len, f"{t.name} name length")
        add(n_dims, f"{t.name} n_dims")
        for d in range(len(dims)):
            add(dims[d : d + 1], f"{t.name} dim {d}")
        add(raw_type, f"{t.name} type")
        add(offset, f"{t.name} offset")
    return slots, reader.data_offset


INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**62, 2**63 - 1, 2**63, 2**64 - 1]


def mutate(data: bytes, slots: list[tuple[int, int, str]], header_end: int, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of the valid file, and what it was."""
    buf = bytearray(data)
    kind = rng.choices(["field", "field", "field", "bytes", "cut", "shift"], k=1)[0]
    if kind == "field":
        offset, size, name = rng.choice(slots)
        old = int.from_bytes(buf[offset : offset + size], "little")
        value = rng.choice([*INTERESTING, old + 1, old - 1, old * 2, old + rng.randrange(1, 1000), rng.getrandbits(64)])
        value %= 1 << (8 * size)
        buf[offset : offset + size] = value.to_bytes(size, "little")
        return bytes(buf), f"{name} {old} -> {value}"
    if kind == "bytes":
        spots = rng.sample(range(4, header_end), rng.randint(1, 8))
        for spot in spots:
            buf[spot] = rng.randrange(256)
        return bytes(buf), f"random bytes at {spots}"
    if kind == "cut":
        at = rng.randrange(4, len(buf)) if rng.random() < 0.2 else rng.randrange(4, header_end)
        return bytes(buf[:at]), f"cut at {at}"
    at, n = rng.randrange(4, header_end), rng.randint(1, 16)
    if rng.random() < 0.5:
        return bytes(buf[:at] + bytes(rng.randrange(256) for _ in range(n)) + buf[at:]), f"{n} bytes inserted at {at}"
    return bytes(buf[:at] + buf[at + n :]), f"{n} bytes deleted at {at}"


def cases(seed_file: Path) -> list[tuple[bytes, str]]:
    data = seed_file.read_bytes()
    slots, header_end = structure(seed_file)
    rng = random.Random(SEED)
    return [(CRAFTED, "crafted 2**62-element array")] + [mutate(data, slots, header_end, rng) for _ in range(N_CASES - 1)]


# -- the child: each case through the loader ------------------------------------------------------------


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_and_serve(path: Path) -> str:
    """'served', or raises: the model file through the engine's loader, then one greedy request."""
    from vegaserve.engine.config import EngineConfig
    from vegaserve.engine.request import GenerateRequest, SamplingParams
    from vegaserve.server.serve_cmd import load_core

    GGUFFile(path)  # the header alone first: most cases end here
    config = {"model": {"path": str(path)}, "device": "cpu", "cache": {"context_size": 64}}
    core = load_core(EngineConfig.from_dict(config), show_progress=False)  # as `vegaserve serve` loads it
    try:
        core.add_request(GenerateRequest(core.tokenizer.encode("Hello"), SamplingParams(max_tokens=2, temperature=0)))
        while core.has_work:
            core.step()
    finally:
        core.close()
    return "served"


def child(work_dir: Path) -> None:
    seed_file = write_seed_file(work_dir / "seed.gguf")
    load_and_serve(seed_file)  # imports and first-use costs out of the first case's time
    path = work_dir / "case.gguf"
    # The address space is capped a little above the allowed growth: an allocation without end fails here
    # with MemoryError (an "error" outcome) instead of growing until the machine stops.
    vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * GROWTH_LIMIT, resource.RLIM_INFINITY))

    def runaway(*_: object) -> None:
        raise TimeoutError(f"still loading after {10 * CASE_LIMIT_S:.0f} s")

    signal.signal(signal.SIGALRM, runaway)
    tracemalloc.start()
    for i, (data, what) in enumerate(cases(seed_file)):
        path.write_bytes(data)
        before = rss()
        tracemalloc.reset_peak()
        traced = tracemalloc.get_traced_memory()[0]
        signal.alarm(int(10 * CASE_LIMIT_S))
        started = time.perf_counter()
        try:
            outcome, message = load_and_serve(path), ""
        except (ModelLoadError, ConfigError) as e:  # what `vegaserve serve` prints as its one error line
            outcome, message = "refused", str(e)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test on it
            outcome, message = "error", f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - started
        signal.alarm(0)
        growth = max(tracemalloc.get_traced_memory()[1] - traced, rss() - before)
        print(json.dumps({"case": i, "what": what, "outcome": outcome, "message": message, "seconds": seconds,
                          "growth": growth}), flush=True)


def test_a_thousand_mutated_headers_are_refused_with_one_line_or_load_and_serve(tmp_path: Path) -> None:
    started = time.monotonic()
    run = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(results) == N_CASES, run.stderr[-3000:]
    path = str(tmp_path / "case.gguf")
    bad = [r for r in results if not (
        r["outcome"] == "served"
        or r["outcome"] == "refused" and r["message"].startswith(path + ": ") and "\n" not in r["message"]
    ) or r["seconds"] >= CASE_LIMIT_S or r["growth"] >= GROWTH_LIMIT]
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("refused", "served", "error")}
    slowest = max(results, key=lambda r: r["seconds"])
    print(f"\n{N_CASES} mutated GGUFs in {time.monotonic() - started:.0f} s: {counts}; slowest {slowest['seconds']:.2f} s "
          f"({slowest['what']}), most growth {max(r['growth'] for r in results) / 2**20:.1f} MiB")
    assert results[0]["outcome"] == "refused" and "abc" in results[0]["message"]
    assert not bad, "\n".join(json.dumps(r) for r in bad[:20])


if __name__ == "__main__":
    child(Path(sys.argv[1]))
