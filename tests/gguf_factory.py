"""Writes tiny GGUF models with random weights for every architecture and weight type the tests need.

The vocabulary and chat template are SmolLM2's (read from the embedded model and written by
benchmarks/synth_gguf.py's `add_smollm2_tokenizer`), so the tokenizer path is the real one; the weights are
random valid blocks of the requested type (scales finite and moderate).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import torch

from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.quants.random_blocks import random_blocks


def _load_synth_gguf() -> ModuleType:
    """benchmarks/synth_gguf.py, loaded by path (benchmarks/ is no package): the tokenizer writer is shared."""
    key = "vegaserve_benchmarks_synth_gguf"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "synth_gguf.py"
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[key]


synth_gguf = _load_synth_gguf()
# a module attribute, so that tests can swap in a smaller vocabulary (tests/engine/test_gguf_file.py)
smollm2_tokenizer_metadata = synth_gguf.smollm2_tokenizer_metadata


@dataclass
class TinySpec:
    arch: str = "llama"  # llama | qwen2 | qwen3
    n_layers: int = 2
    hidden: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 512
    context: int = 512
    weight_type: str = "Q8_0"  # every 2-D matrix except the embedding
    embed_type: str = "Q8_0"
    tied: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict[str, float | str] = field(default_factory=dict)  # e.g. {"type": "linear", "factor": 2.0}
    seed: int = 0
    chat_template: str | None = None  # None: SmolLM2's
    # per-tensor types over weight_type / embed_type, as the mixed files (`Q2_K_XL`, `UD-Q4_K_XL`) have them:
    # a full name ("blk.1.ffn_down.weight") or a role for every layer ("ffn_down"), the full name first
    tensor_types: dict[str, str] = field(default_factory=dict)


def _type_id(name: str) -> int:
    return next(t for t, s in GGML_TYPES.items() if s.name == name)


def write_tiny_gguf(path: Path, spec: TinySpec) -> Path:
    md = smollm2_tokenizer_metadata()
    vocab = len(md["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(spec.seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    head_dim = spec.hidden // spec.n_heads
    synth_gguf.add_decoder_hparams(w, synth_gguf.Preset(
        spec.arch, spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.ffn, vocab, spec.context,
        spec.rope_theta,
    ))
    if spec.rope_scaling:
        w.add_string(f"{a}.rope.scaling.type", str(spec.rope_scaling["type"]))
        w.add_float32(f"{a}.rope.scaling.factor", float(spec.rope_scaling["factor"]))
        if "original_context_length" in spec.rope_scaling:
            w.add_uint32(f"{a}.rope.scaling.original_context_length", int(spec.rope_scaling["original_context_length"]))
    synth_gguf.add_smollm2_tokenizer(w, md, chat_template=spec.chat_template)

    def matrix(name: str, rows: int, cols: int, type_name: str) -> None:
        role = name.split(".")[-2]
        type_name = spec.tensor_types.get(name, spec.tensor_types.get(role, type_name))
        tid = _type_id(type_name)
        qs = GGML_TYPES[tid]
        if type_name == "F32":
            data = (torch.rand(rows, cols, generator=gen) * 2 - 1).numpy() * 0.5
            w.add_tensor(name, data.astype(np.float32))
            return
        raw = random_blocks(tid, rows, cols // qs.block_size, gen).numpy()
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(tid))

    def vector(name: str, n: int, around: float = 1.0) -> None:
        w.add_tensor(name, (around + 0.1 * torch.randn(n, generator=gen)).numpy().astype(np.float32))

    matrix("token_embd.weight", vocab, spec.hidden, spec.embed_type)
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", spec.hidden)
        matrix(p + "attn_q.weight", spec.n_heads * head_dim, spec.hidden, spec.weight_type)
        matrix(p + "attn_k.weight", spec.n_kv_heads * head_dim, spec.hidden, spec.weight_type)
        matrix(p + "attn_v.weight", spec.n_kv_heads * head_dim, spec.hidden, spec.weight_type)
        if a == "qwen2":
            for n, rows in (("q", spec.n_heads), ("k", spec.n_kv_heads), ("v", spec.n_kv_heads)):
                vector(p + f"attn_{n}.bias", rows * head_dim, around=0.0)
        if a == "qwen3":
            vector(p + "attn_q_norm.weight", head_dim)
            vector(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_output.weight", spec.hidden, spec.n_heads * head_dim, spec.weight_type)
        vector(p + "ffn_norm.weight", spec.hidden)
        matrix(p + "ffn_gate.weight", spec.ffn, spec.hidden, spec.weight_type)
        matrix(p + "ffn_up.weight", spec.ffn, spec.hidden, spec.weight_type)
        matrix(p + "ffn_down.weight", spec.hidden, spec.ffn, spec.weight_type)
    vector("output_norm.weight", spec.hidden)
    if not spec.tied:
        matrix("output.weight", vocab, spec.hidden, spec.weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
