"""A split against one process on the same device(s): relative logits error and greedy tokens.

    python benchmarks/split_check.py -m FILE --device cuda --split tensor:2 --split layer:2 --split tensor:4:2

Each --split is MODE:N[:TPS]. On one GPU, N ranks share it over gloo (a test of the collective logic and of
each lane's sliced kernels, not of speed).
"""

from __future__ import annotations

import argparse
import json

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.request import GenerateRequest, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]


def run(path: str | None, device: str, parallel: dict, n_tokens: int) -> tuple[torch.Tensor, list[list[int]]]:
    cfg = EngineConfig.from_dict({"model": {"path": path}, "cache": {"context_size": 512},
                                  "scheduler": {"max_num_seqs": 4}, "parallel": parallel, "device": device})
    core = EngineCore(cfg, show_progress=False)
    try:
        logits = core.forward_logits(core.tokenizer.encode(PROMPTS[0])).cpu()
        tokens = []
        for p in PROMPTS:
            req = GenerateRequest(core.tokenizer.encode(p), SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
            tokens.append([t for o in core.generate_sync(req) for t in o.token_ids])
        return logits, tokens
    finally:
        core.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--split", action="append", default=[])
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    ref_logits, ref_tokens = run(a.model, a.device, {}, a.tokens)
    for spec in a.split:
        mode, n, *tps = spec.split(":")
        par = {"split_mode": mode, "n_devices": int(n), "tensor_parallel_group": int(tps[0]) if tps else 0}
        logits, tokens = run(a.model, a.device, par, a.tokens)
        err = float((logits - ref_logits).norm() / ref_logits.norm())
        same = [t == r for t, r in zip(tokens, ref_tokens, strict=True)]
        print(json.dumps({"split": spec, "logits_rel_err": err, "greedy_identical": same}))


if __name__ == "__main__":
    main()
