"""benchmarks/bench_load.py on the CPU: the read-rate pass reads every byte of the file once, and a tiny
model's load is timed against it, its weights counted from the file and its tokens served."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests import gguf_factory

BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load.py"


def load_bench() -> ModuleType:
    if "bench_load" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_load", BENCH_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_load"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_load"]


bench = load_bench()


@pytest.mark.parametrize("size", [3 * 65536, 3 * 65536 + 4096 + 77])
def test_the_read_rate_pass_reads_the_whole_file_in_order(tmp_path, monkeypatch, size):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    monkeypatch.setattr(bench, "CHUNK", 65536)
    offsets: list[int] = []
    preadv = os.preadv

    def counting(fd, buffers, offset):
        offsets.append(offset)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    rate, _ = bench.read_rate(path)
    assert rate > 0
    assert offsets == list(range(0, size, 65536))  # each read starts where the last one ended, to the end


def test_a_short_read_is_an_error_not_a_rate(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(200_000))
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0 if off >= 65536 else real(fd, bufs, off))
    monkeypatch.setattr(bench, "CHUNK", 65536)
    with pytest.raises(RuntimeError, match="read 65536 of 200000 bytes"):
        bench.read_rate(path)


def test_a_tiny_model_loads_serves_and_counts_its_weights_from_the_file(tmp_path):
    path = gguf_factory.write_tiny_gguf(tmp_path / "tiny.gguf", gguf_factory.TinySpec(n_layers=1))
    r = bench.measure(path, "dio", context=256, seqs=2, gen=5, device="cpu")
    tensors = bench.GGUFFile(path).tensors.values()
    assert r["weight_bytes"] == sum(t.n_bytes for t in tensors) > 0
    assert r["file_bytes"] == path.stat().st_size > r["weight_bytes"]
    assert r["served_tokens"] == 5
    assert r["weights_read_bytes"] == r["weight_bytes"]  # the loader's own record: every tensor, counted once
    assert r["kv_bytes"] > 0 and 0 < r["weights_load_s"] <= r["engine_start_s"]
    assert r["load_rate_gbs"] == pytest.approx(r["weights_read_bytes"] / r["weights_load_s"] / 1e9)
    assert "device_bytes_peak" not in r  # CPU: no device memory to report
