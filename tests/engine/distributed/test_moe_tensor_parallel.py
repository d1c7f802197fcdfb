"""Mixture-of-experts models split over tensor-parallel lanes (CPU processes over gloo): every lane routes
alike and holds a slice of every expert (gate/up rows, down columns), the shared expert split the same way
or held whole (LLAMA_SHEXP_SPLIT=0), and the layer's one AllReduce completes the partial sums. Logits of
the converted tiny models (tests/data/moe) equal one process's within 1e-4, and a pipeline of two stages
serves them too."""

from __future__ import annotations

from pathlib import Path

import pytest

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore

DATA = Path(__file__).resolve().parents[2] / "data" / "moe"
PROMPT = [5, 17, 200, 33, 9, 41, 120, 7, 64, 250, 3, 88]  # ids of the tiny models' 320-token vocabulary


def _logits(name: str, parallel: dict | None = None, kernels: dict | None = None):
    cfg = {"model": {"path": str(DATA / f"{name}-f32.gguf")}, "cache": {"context_size": 128},
           "parallel": parallel or {}, "kernels": kernels or {}, "device": "cpu"}
    core = EngineCore(EngineConfig.from_dict(cfg), show_progress=False)
    try:
        return core.forward_logits(PROMPT)
    finally:
        core.close()


@pytest.mark.parametrize("name, parallel, kernels", [
    ("qwen3moe", {"split_mode": "tensor", "n_devices": 2}, {}),
    ("gpt-oss", {"split_mode": "tensor", "n_devices": 2}, {}),
    ("qwen2moe", {"split_mode": "tensor", "n_devices": 2}, {}),
    ("qwen2moe", {"split_mode": "tensor", "n_devices": 2}, {"shexp_split": False}),
    ("qwen3moe", {"split_mode": "layer", "n_devices": 2}, {}),
], ids=["qwen3moe-tp2", "gpt-oss-tp2", "qwen2moe-tp2-shared-split", "qwen2moe-tp2-shared-whole", "qwen3moe-pp2"])
def test_a_split_moe_model_gives_one_processs_logits(name, parallel, kernels):
    one = _logits(name)
    split = _logits(name, parallel, kernels)
    err = float((split - one).norm() / one.norm())
    assert err < 1e-4, f"{name} {parallel} {kernels}: {err:.2e}"
