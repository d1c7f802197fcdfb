"""Tensor-parallel decode through graphs (issue 29's acceptance): with the peer-write AllReduce each rank
captures its decode step, AllReduces inside, and replays it per token. On one GPU the two ranks are two
processes sharing it (their AllReduce buffers opened through CUDA IPC, as between GPUs): the replayed
tensor-parallel engine gives the eager tensor-parallel engine's tokens, and one process's logits and tokens."""

from __future__ import annotations

import pytest
import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.forward_batch import StepPlan
from vegaserve.engine.request import GenerateRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs need a GPU")]

BLOCK = 16
PROMPTS = [[1, 17, 300, 4000, 512, 9], [5, 12, 99, 21000, 77, 640, 8, 8, 2, 31, 4, 6, 19], list(range(40, 80))]


def _run(path, parallel: dict, kernels: dict | None = None) -> dict:
    cfg = {"model": {"path": str(path)}, "cache": {"context_size": 256, "block_size": BLOCK},
           "scheduler": {"max_num_seqs": 4}, "device": "cuda", "parallel": parallel, "kernels": kernels or {}}
    core = EngineCore(EngineConfig.from_dict(cfg), show_progress=False)
    try:
        graphs = core.runner.executor.worker.graphs
        # one decode step's logits after the prompts (3 sequences in the bucket of 4: one padded row)
        blocks = [core.pool.allocate(-(-(len(p) + 1) // BLOCK)) for p in PROMPTS]
        ex = core.runner.executor
        ex.forward(StepPlan([(b, 0, p) for b, p in zip(blocks, PROMPTS, strict=True)], [False] * 3, BLOCK))
        logits = ex.forward(StepPlan([(b, len(p), [7]) for b, p in zip(blocks, PROMPTS, strict=True)], [False] * 3,
                                     BLOCK)).float().cpu()
        for b in blocks:
            core.pool.free(b)
        reqs = [GenerateRequest(p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
        for r in reqs:
            core.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while core.has_work:
            for o in core.step():
                out[o.request_id].extend(o.token_ids)
        return {"graphs": graphs.buckets if graphs is not None else None, "logits": logits,
                "tokens": [out[r.request_id] for r in reqs]}
    finally:
        core.close()


def test_tensor_parallel_decode_replayed_from_graphs_equals_eager_and_one_process(gguf_factory, tmp_path) -> None:
    path = gguf_factory.write_tiny_gguf(tmp_path / "tiny.gguf", gguf_factory.TinySpec())
    one = _run(path, {})
    tp = {"split_mode": "tensor", "n_devices": 2, "custom_allreduce": True}
    replayed = _run(path, tp)
    eager = _run(path, tp, {"token_graph": False})
    assert replayed["graphs"] == (1, 2, 4) and eager["graphs"] is None
    assert replayed["tokens"] == eager["tokens"]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(replayed["logits"], eager["logits"]) < 1e-4
    err = rel(replayed["logits"], one["logits"])
    print(f"tensor-parallel (2 lanes, replayed) against one process: {err:.2e}")
    assert err < 1e-4
    assert replayed["tokens"] == one["tokens"]
