"""benchmarks/ppl_ggml_rounding.py: the plain run is the engine's own perplexity, the rounded run differs from
it, and the engine's matmul is left as it was."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from tests import gguf_factory
from vegaserve.engine.layers import linear

BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ppl_ggml_rounding.py"
spec = importlib.util.spec_from_file_location("ppl_ggml_rounding", BENCH_PATH)
bench = importlib.util.module_from_spec(spec)
sys.modules["ppl_ggml_rounding"] = bench
spec.loader.exec_module(bench)

TEXT = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_rounding_moves_the_perplexity_and_is_undone_after(tmp_path, monkeypatch):
    monkeypatch.setenv("VEGASERVE_CPU_INT4", "0")
    path = str(gguf_factory.write_tiny_gguf(tmp_path / "t.gguf", gguf_factory.TinySpec(
        n_layers=1, weight_type="Q4_K", embed_type="Q4_K", context=128)))
    before = linear.ReferenceMethod.create, linear.ReferenceMethod.apply
    plain = bench.run(path, TEXT, 64, 2, rounded=False)
    rounded = bench.run(path, TEXT, 64, 2, rounded=True)
    assert (linear.ReferenceMethod.create, linear.ReferenceMethod.apply) == before
    again = bench.run(path, TEXT, 64, 2, rounded=False)
    assert again == plain  # nothing of the rounded run stayed behind
    # q8_K keeps about 2.5 significant digits of each activation: a small move of the mean log-loss, never
    # none (random weights: a perplexity far above the vocabulary's, so compared as log-loss)
    assert rounded != plain and math.log(rounded) == pytest.approx(math.log(plain), rel=0.01)
