"""Perplexity on the CPU path twice: as the engine computes it (f32 activations into every matmul), and with
each matmul's activations first rounded as llama.cpp's CPU backend rounds them for that weight type (q8_K
for the K-quants and the IQ types, q8_0 for Q8_0 / Q4_0 / IQ4_NL / MXFP4: benchmarks/ggml_numerics.py).

An analysis tool, not a serving path: it tells how much of a gap to llama-perplexity on the same file comes
from that rounding alone. The matrices are the f32 reference's (VEGASERVE_CPU_INT4=0 is set here).

    python benchmarks/ppl_ggml_rounding.py -m FILE -f TEXT [-c 512] [--chunks 8]

Prints one JSON line: both perplexities and the second's change over the first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def _ggml_numerics():
    path = Path(__file__).resolve().parent / "ggml_numerics.py"
    spec = importlib.util.spec_from_file_location("ggml_numerics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ggml_numerics"] = module  # before exec: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(path: str, text: str, n_ctx: int, chunks: int, rounded: bool) -> float:
    os.environ["VEGASERVE_CPU_INT4"] = "0"  # ReferenceMethod everywhere: dequantized f32 matrices
    from vegaserve.engine.config import EngineConfig, merge_trees
    from vegaserve.engine.engine_core import EngineCore
    from vegaserve.engine.env import config_from_env
    from vegaserve.engine.layers import linear
    from vegaserve.engine.perplexity import perplexity

    gn = _ggml_numerics()
    create, apply = linear.ReferenceMethod.create, linear.ReferenceMethod.apply

    def create_typed(self, layer, sources):
        types = {s.info.type_id for s in sources}
        if len(types) != 1:
            raise ValueError(f"a stacked matrix of several types {types}: its rounding is not one")
        layer.ggml_type = types.pop()
        create(self, layer, sources)

    def apply_rounded(self, layer, x, q8_1=None):
        return F.linear(gn.quantize_activation_like_ggml(x, layer.ggml_type), layer.weight, layer.bias)

    linear.ReferenceMethod.create = create_typed
    if rounded:
        linear.ReferenceMethod.apply = apply_rounded
    try:
        tree = {"model": {"path": path}, "cache": {"context_size": n_ctx}, "device": "cpu"}
        core = EngineCore(EngineConfig.from_dict(merge_trees(config_from_env(), tree)), show_progress=False)
        tok = core.tokenizer
        tokens = tok.encode(text, add_special_tokens=False, parse_special=False)[: chunks * n_ctx]
        bos = tok.bos_token_id if tok.add_bos_token else None
        with torch.inference_mode():
            return perplexity(core.forward_logits, tokens, n_ctx, bos).ppl
    finally:
        linear.ReferenceMethod.create, linear.ReferenceMethod.apply = create, apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-f", "--file", required=True, type=Path)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    args = ap.parse_args()
    text = args.file.read_text()
    plain = run(args.model, text, args.ctx_size, args.chunks, rounded=False)
    rounded = run(args.model, text, args.ctx_size, args.chunks, rounded=True)
    print(json.dumps({"model": args.model, "ppl_f32_activations": plain, "ppl_ggml_rounded_activations": rounded,
                      "change": rounded / plain - 1}))


if __name__ == "__main__":
    main()
