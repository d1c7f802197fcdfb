"""Perplexity of one GGUF on the CPU path (torch references) and the GPU path (Triton kernels), same text.

    python benchmarks/ppl_cpu_gpu.py -m FILE -f TEXT [-c 512] [--chunks 8]

Prints both estimates, their relative difference, and the GPU run with f32 GEMM operands too (the default
prefill GEMM feeds bf16 operands to the tensor cores).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.layers.linear import TritonMethod
from vegaserve.engine.perplexity import perplexity


def measure(path: str, device: str, text: str, n_ctx: int, chunks: int) -> tuple[float, float, float]:
    core = EngineCore(EngineConfig.from_dict({"model": {"path": path}, "cache": {"context_size": n_ctx}, "device": device}), show_progress=False)
    tokens = core.tokenizer.encode(text, add_special_tokens=False, parse_special=False)[: chunks * n_ctx]
    t0 = time.perf_counter()
    res = perplexity(core.forward_logits, tokens, n_ctx, None)
    return res.ppl, res.ppl_err, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-f", "--file", required=True)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    text = open(args.file, encoding="utf-8").read()
    cpu = measure(args.model, "cpu", text, args.ctx, args.chunks)
    gpu = measure(args.model, "cuda", text, args.ctx, args.chunks)
    orig = TritonMethod.__init__.__defaults__
    TritonMethod.__init__.__defaults__ = (True, torch.float32, None)  # f32 scratch and GEMM operands
    gpu32 = measure(args.model, "cuda", text, args.ctx, args.chunks)
    TritonMethod.__init__.__defaults__ = orig
    out = {
        "cpu_ppl": cpu[0], "cpu_err": cpu[1], "cpu_s": cpu[2], "gpu_bf16_ppl": gpu[0], "gpu_bf16_s": gpu[2],
        "gpu_f32_ppl": gpu32[0], "gpu_f32_s": gpu32[2],
        "rel_diff_bf16": abs(gpu[0] - cpu[0]) / cpu[0], "rel_diff_f32": abs(gpu32[0] - cpu[0]) / cpu[0],
    }
    print(f"CPU  PPL {cpu[0]:.4f} +/- {cpu[1]:.4f} ({cpu[2]:.1f} s)")
    print(f"GPU  PPL {gpu[0]:.4f} bf16 GEMM operands ({gpu[2]:.1f} s)  rel diff {out['rel_diff_bf16']:.2e}")
    print(f"GPU  PPL {gpu32[0]:.4f} f32 GEMM operands ({gpu32[2]:.1f} s)  rel diff {out['rel_diff_f32']:.2e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
