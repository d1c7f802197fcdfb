"""Writes a GGUF with a real model's shapes and random valid weights, so that GPU benchmarks run where the
real weights cannot be fetched. Speed depends on shapes and types, not on the values, so these files time
like the real ones (the text they generate is noise).

    python benchmarks/synth_gguf.py --preset llama3-8b --type Q4_K_M --out /tmp/x.gguf [--layers 2] [--seed 0]

Weight types: `Q4_K_M` is llama-quantize's mix (below); `MXFP4` puts token_embd and output in Q8_0, as
llama.cpp's MXFP4 models do; any other served type is used for every matrix. Norms are F32 around 1.

Tokenizer: SmolLM2's vocabulary and chat template (read from the embedded model), padded with control
tokens `<|pad_N|>` up to the preset's vocabulary size. tests/gguf_factory.py writes its tokenizer with the
same function (`add_smollm2_tokenizer`).

Memory and time: each matrix is generated and written row chunk by row chunk (about 64 MiB at a time), so
a model never sits in memory; one thread generates about 250 MB/s of blocks: llama3-8b Q4_K_M (4.92 GB,
65 F32 / 193 Q4_K / 33 Q6_K tensors, as llama.cpp lists the real one) took 40 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import torch
from tqdm import tqdm

from vegaserve.engine.gguf_file import GGUFFile, default_model_path
from vegaserve.triton_kernels.dequant import GGML_TYPES
from vegaserve.triton_kernels.quants.random_blocks import random_blocks

# -- tokenizer (shared with tests/gguf_factory.py) ------------------------------------------------------

_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)  # fmt: skip
_tokenizer_cache: dict[str, Any] = {}
CONTROL = int(gguf.TokenType.CONTROL)  # 3


def smollm2_tokenizer_metadata() -> dict[str, Any]:
    """The tokenizer keys of the embedded SmolLM2 (read once per process)."""
    if not _tokenizer_cache:
        md = GGUFFile(default_model_path()).metadata
        _tokenizer_cache.update({k: md[k] for k in _TOKENIZER_KEYS if k in md})
    return _tokenizer_cache


def add_smollm2_tokenizer(
    w: gguf.GGUFWriter, md: dict[str, Any], n_vocab: int | None = None, chat_template: str | None = None
) -> int:
    """Write the tokenizer `md` (smollm2_tokenizer_metadata's keys) into `w`, padded with control tokens
    `<|pad_0|>`, `<|pad_1|>`, ... up to `n_vocab` entries; returns the vocabulary size written.
    `chat_template` None: the one in `md`."""
    tokens = list(md["tokenizer.ggml.tokens"])
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]
    n_vocab = len(tokens) if n_vocab is None else n_vocab
    if n_vocab < len(tokens):
        raise ValueError(f"vocabulary of {n_vocab} tokens is smaller than SmolLM2's {len(tokens)}")
    n_pad = n_vocab - len(tokens)
    tokens += [f"<|pad_{i}|>" for i in range(n_pad)]
    types += [CONTROL] * n_pad
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(md["tokenizer.chat_template"] if chat_template is None else chat_template)
    return n_vocab


# -- shapes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    arch: str  # llama | qwen3 (qwen3: q/k RMSNorm per head)
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float = 1e-5
    head_dim_override: int = 0  # 0: hidden / n_heads
    tied: bool = False  # no output.weight: the embedding is the LM head

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.n_heads


PRESETS: dict[str, Preset] = {
    "llama3-8b": Preset("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    "qwen3-14b": Preset("qwen3", 40, 5120, 40, 8, 17408, 151936, 40960, 1e6, rms_eps=1e-6, head_dim_override=128),
    # Llama 3.2 1B ties its embedding; its rope scaling (llama3 type) is left out: it does not change speed
    "llama-1b": Preset("llama", 16, 2048, 32, 8, 8192, 128256, 8192, 500000.0, tied=True),
    # for tests: SmolLM2's 49152 tokens + 64 padded control tokens
    "tiny": Preset("llama", 2, 256, 4, 2, 512, 49152 + 64, 2048, 10000.0),
}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (n,)
    type_name: str


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp, llama_tensor_get_type_impl) for the layers whose attn_v and
    ffn_down Q4_K_M stores in Q6_K: the first and last eighth, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


_MIXES = ("Q4_K_M",)
TYPE_CHOICES = (*_MIXES, *(s.name for s in GGML_TYPES.values()))


def matrix_type(kind: str, i_layer: int, n_layers: int, type_name: str, tied: bool) -> str:
    """The weight type of matrix `kind` (token_embd, output, attn_q, ..., ffn_down) in layer `i_layer`."""
    if type_name == "Q4_K_M":
        # llama-quantize: output (and a tied embedding, which is the output) Q6_K; attn_v and ffn_down Q6_K
        # on the use-more-bits layers; Q4_K elsewhere, the untied token_embd included
        if kind == "output" or (kind == "token_embd" and tied):
            return "Q6_K"
        if kind in ("attn_v", "ffn_down") and use_more_bits(i_layer, n_layers):
            return "Q6_K"
        return "Q4_K"
    if type_name == "MXFP4" and kind in ("token_embd", "output"):
        return "Q8_0"
    return type_name


def tensor_plan(p: Preset, type_name: str) -> list[PlannedTensor]:
    """Every tensor of the model in file order, with its shape and type."""
    if type_name not in TYPE_CHOICES:
        raise ValueError(f"unknown weight type {type_name!r} (known: {', '.join(TYPE_CHOICES)})")
    plan: list[PlannedTensor] = []

    def matrix(name: str, kind: str, i: int, rows: int, cols: int) -> None:
        t = matrix_type(kind, i, p.n_layers, type_name, p.tied)
        block = next(s.block_size for s in GGML_TYPES.values() if s.name == t)
        if cols % block:
            raise ValueError(f"{name}: {cols} columns do not hold whole {t} blocks of {block}")
        plan.append(PlannedTensor(name, (rows, cols), t))

    def vector(name: str, n: int) -> None:
        plan.append(PlannedTensor(name, (n,), "F32"))

    q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    matrix("token_embd.weight", "token_embd", 0, p.vocab, p.hidden)
    for i in range(p.n_layers):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", p.hidden)
        matrix(b + "attn_q.weight", "attn_q", i, q, p.hidden)
        matrix(b + "attn_k.weight", "attn_k", i, kv, p.hidden)
        matrix(b + "attn_v.weight", "attn_v", i, kv, p.hidden)
        if p.arch == "qwen3":
            vector(b + "attn_q_norm.weight", p.head_dim)
            vector(b + "attn_k_norm.weight", p.head_dim)
        matrix(b + "attn_output.weight", "attn_output", i, p.hidden, q)
        vector(b + "ffn_norm.weight", p.hidden)
        matrix(b + "ffn_gate.weight", "ffn_gate", i, p.ffn, p.hidden)
        matrix(b + "ffn_up.weight", "ffn_up", i, p.ffn, p.hidden)
        matrix(b + "ffn_down.weight", "ffn_down", i, p.hidden, p.ffn)
    vector("output_norm.weight", p.hidden)
    if not p.tied:
        matrix("output.weight", "output", 0, p.vocab, p.hidden)
    return plan


# -- writing --------------------------------------------------------------------------------------------

_TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
_CHUNK_BYTES = 64 << 20


def _row_bytes(t: PlannedTensor) -> int:
    s = GGML_TYPES[_TYPE_IDS[t.type_name]]
    return t.shape[-1] // s.block_size * s.type_size


def _nbytes(t: PlannedTensor) -> int:
    return (t.shape[0] if len(t.shape) == 2 else 1) * _row_bytes(t)


class _StreamedTensor:
    """What GGUFWriter.write_tensor_data needs of an array (`nbytes`, `tofile`), generated chunk by chunk
    while it is written, so that only one chunk is in memory."""

    def __init__(self, t: PlannedTensor, gen: torch.Generator, bar: tqdm) -> None:
        self.t, self.gen, self.bar = t, gen, bar
        self.nbytes = _nbytes(t)

    def chunks(self) -> Iterator[np.ndarray]:
        t = self.t
        if len(t.shape) == 1:  # norm weights: F32 around 1
            yield (1.0 + 0.1 * torch.randn(t.shape[0], generator=self.gen)).numpy().astype(np.float32)
            return
        rows, cols = t.shape
        tid = _TYPE_IDS[t.type_name]
        step = max(1, _CHUNK_BYTES // _row_bytes(t))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            yield random_blocks(tid, n, cols // GGML_TYPES[tid].block_size, self.gen).numpy()

    def tofile(self, f: BinaryIO) -> None:
        for chunk in self.chunks():
            f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            self.bar.update(chunk.nbytes)


def _file_type(type_name: str) -> int | None:
    """general.file_type when a llama.cpp ftype names this choice (none for MXFP4 on dense layers)."""
    if type_name == "F32":
        return int(gguf.LlamaFileType.ALL_F32)
    ft = getattr(gguf.LlamaFileType, f"MOSTLY_{type_name}", None)
    return None if ft is None else int(ft)


def add_decoder_hparams(w: gguf.GGUFWriter, p: Preset) -> None:
    """The `{arch}.*` hyperparameter keys of a llama-family decoder (shared with tests/gguf_factory.py)."""
    w.add_block_count(p.n_layers)
    w.add_context_length(p.context)
    w.add_embedding_length(p.hidden)
    w.add_feed_forward_length(p.ffn)
    w.add_head_count(p.n_heads)
    w.add_head_count_kv(p.n_kv_heads)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_rope_freq_base(p.rope_theta)
    w.add_rope_dimension_count(p.head_dim)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_vocab_size(p.vocab)


def write_synth_gguf(
    path: Path, preset: str | Preset, type_name: str, n_layers: int | None = None, seed: int = 0,
    progress: bool = False,
) -> list[PlannedTensor]:  # fmt: skip
    """Write the model to `path`; returns its tensor plan. `n_layers` overrides the preset's layer count."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError(f"--layers must be >= 1, got {n_layers}")
        p = replace(p, n_layers=n_layers)
    plan = tensor_plan(p, type_name)
    name = preset if isinstance(preset, str) else p.arch

    w = gguf.GGUFWriter(str(path), p.arch)
    w.add_name(f"synthetic {name} {type_name}")
    ft = _file_type(type_name)
    if ft is not None:
        w.add_file_type(ft)
    add_decoder_hparams(w, p)
    add_smollm2_tokenizer(w, smollm2_tokenizer_metadata(), p.vocab)
    for t in plan:
        n = _nbytes(t)
        w.add_tensor_info(t.name, (t.shape[0], n // t.shape[0]) if len(t.shape) == 2 else t.shape,
                          np.dtype(np.uint8) if len(t.shape) == 2 else np.dtype(np.float32), n,
                          raw_dtype=gguf.GGMLQuantizationType(_TYPE_IDS[t.type_name]))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(seed)
    total = sum(_nbytes(t) for t in plan)
    with tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress, file=sys.stderr) as bar:
        for t in plan:
            w.write_tensor_data(_StreamedTensor(t, gen, bar))  # type: ignore[arg-type]
    w.close()
    return plan


def type_counts(plan: list[PlannedTensor]) -> dict[str, int]:
    return dict(sorted(Counter(t.type_name for t in plan).items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--type", required=True, choices=TYPE_CHOICES, metavar="TYPE", help=", ".join(TYPE_CHOICES))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, help="override the preset's layer count (quick runs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        plan = write_synth_gguf(args.out, args.preset, args.type, args.layers, args.seed, progress=True)
    except (ValueError, OSError) as e:
        print(f"synth_gguf: error: {e}", file=sys.stderr)
        return 2
    size = args.out.stat().st_size
    params = sum(int(np.prod(t.shape)) for t in plan)
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB ({size} bytes), {params / 1e9:.2f} B parameters")
    print("tensor types: " + ", ".join(f"{k} {v}" for k, v in type_counts(plan).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
