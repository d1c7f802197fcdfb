"""Writes a GGUF with a real model's shapes and random valid weights, so that GPU benchmarks run where the
real weights cannot be fetched. Speed depends on shapes and types, not on the values, so these files time
like the real ones (the text they generate is noise).

    python benchmarks/synth_gguf.py --preset llama3-8b --type Q4_K_M --out /tmp/x.gguf [--layers 2] [--seed 0]

Presets: dense llama3-8b, qwen3-14b, llama-1b; mixture-of-experts qwen3-30b-a3b (qwen3moe) and gpt-oss-20b,
gpt-oss-120b (gpt-oss); hybrid linear attention qwen3.6-27b (qwen35) and qwen3.6-35b-a3b (qwen35moe: experts and
a shared expert), each with its NextN (MTP) block after the trunk; with the tensor names, shapes and `{arch}.*`
keys llama.cpp's converter writes. `--layers N` keeps the first N layers (of a hybrid model, N trunk layers
and its NextN block: 4 shows both layer kinds).

Weight types: `Q4_K_M` is llama-quantize's mix (`matrix_type`); `MXFP4` on a dense model puts token_embd
and output in Q8_0, as llama.cpp's MXFP4 models do, and on a mixture of experts is llama-quantize's
MXFP4_MOE: the experts MXFP4, every other matrix Q8_0 (the published gpt-oss files); any other served type
is used for every matrix. Norms, biases, attention sinks and the experts' router stay F32 (llama-quantize
leaves 1-D tensors, biases and ffn_gate_inp alone); norms are drawn around 1, the rest around 0.

Tokenizer: SmolLM2's vocabulary and chat template (read from the embedded model), padded with control
tokens `<|pad_N|>` up to the preset's vocabulary size. tests/gguf_factory.py writes its tokenizer with the
same function (`add_smollm2_tokenizer`).

Memory and time: each matrix is generated and written row chunk by row chunk (about 64 MiB each), drawn
by one thread per core at most two chunks a thread ahead of the writer, so a model never sits in memory (2 GiB
at most on 16 cores); one thread generates 160-300 MB/s of blocks: llama3-8b Q4_K_M (4.92 GB, 65 F32 / 193
Q4_K / 33 Q6_K tensors, as llama.cpp lists the real one) took 40 s on a 2-core machine with one thread, and
qwen3-30b-a3b Q4_K_M 69 s on a 16-core GPU machine with a thread a core (one thread had written 95% of it in
90 s; three files written at once there, 31 GB, took about 65 s). Full sizes: qwen3-30b-a3b Q4_K_M 17.28
GiB, gpt-oss-20b MXFP4 11.27 GiB, gpt-oss-120b MXFP4 59.02 GiB (the tensor bytes llama.cpp reports for the
published files); gpt-oss-120b cut to 12 layers 20.44 GiB; qwen3.6-27b Q4_K_M 15.65 GiB (15.401 GiB without
its MTP block, as llama.cpp prints the published file), qwen3.6-35b-a3b 20.21 GiB (19.70).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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

_MOE_ARCHS = ("qwen3moe", "gpt-oss", "qwen35moe")
_HYBRID_ARCHS = ("qwen35", "qwen35moe")


@dataclass(frozen=True)
class Preset:
    """A decoder's shapes and the hyperparameters llama.cpp reads for its architecture. arch: llama | qwen3
    (q/k RMSNorm per head) | qwen3moe (qwen3 with experts) | gpt-oss (experts; biases on attention and experts,
    a sink logit per head, sliding-window attention on every other layer, YaRN)."""

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int  # dense feed-forward width (on a mixture of experts only the feed_forward_length key)
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float = 1e-5
    head_dim_override: int = 0  # 0: hidden / n_heads
    tied: bool = False  # no output.weight: the embedding is the LM head
    experts: int = 0  # > 0: every layer's feed-forward is this many experts of width expert_ff, a router
    experts_used: int = 0  # picking this many per token
    expert_ff: int = 0
    sliding_window: int = 0  # > 0: attention.sliding_window (gpt-oss: the even layers slide)
    yarn_factor: float = 0.0  # > 0: YaRN rope scaling of a model trained at yarn_context positions
    yarn_context: int = 0
    shared_ff: int = 0  # > 0: a shared expert of this width beside the experts (behind a sigmoid gate)
    # hybrid linear attention: every full_attention_interval-th layer is gated full attention (q's rows
    # doubled: a gate per head), the others gated DeltaNet with linear_heads (key, value) heads of
    # linear_head_dim and a causal convolution of conv_kernel; nextn NextN blocks follow the trunk
    linear_heads: tuple[int, int] = (0, 0)
    linear_head_dim: int = 0
    conv_kernel: int = 4
    full_attention_interval: int = 4
    nextn: int = 0
    rope_dim_override: int = 0  # 0: head_dim (partial rotary: fewer)
    rope_sections: tuple[int, ...] = ()  # M-RoPE sections (qwen35: text tokens rotate as plain rope)

    def __post_init__(self) -> None:
        if (self.arch in _MOE_ARCHS) != (self.experts > 0):
            raise ValueError(f"{self.arch}: experts={self.experts} (mixture-of-experts archs: {_MOE_ARCHS})")
        if self.experts and not 0 < self.experts_used <= self.experts:
            raise ValueError(f"experts_used {self.experts_used} must be in 1..{self.experts}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.n_heads

    @property
    def n_blocks(self) -> int:
        """Layers in the file: the trunk's and the NextN blocks."""
        return self.n_layers + self.nextn

    def linear(self, i: int) -> bool:
        """Whether block i is a gated DeltaNet layer (llama.cpp's rule for a file without the flags)."""
        return self.arch in _HYBRID_ARCHS and i < self.n_layers and (i + 1) % self.full_attention_interval != 0


# From each model's config.json (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b and -120b); gpt-oss's YaRN betas
# (32, 1) are llama.cpp's defaults and written explicitly, as its converter does
# Qwen/Qwen3.6-27B and Qwen/Qwen3.6-35B-A3B (the Qwen3.5 shapes): rope theta 1e7 on a quarter of each 256-wide
# head, M-RoPE sections (11, 11, 10), one MTP block
_QWEN36 = dict(rms_eps=1e-6, head_dim_override=256, rope_dim_override=64, rope_sections=(11, 11, 10, 0),
               linear_head_dim=128, conv_kernel=4, full_attention_interval=4, nextn=1)
_GPT_OSS_20B = Preset("gpt-oss", 24, 2880, 64, 8, 2880, 201088, 131072, 150000.0, head_dim_override=64,
                      experts=32, experts_used=4, expert_ff=2880, sliding_window=128, yarn_factor=32.0,
                      yarn_context=4096)  # fmt: skip
PRESETS: dict[str, Preset] = {
    "llama3-8b": Preset("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    "qwen3-14b": Preset("qwen3", 40, 5120, 40, 8, 17408, 151936, 40960, 1e6, rms_eps=1e-6, head_dim_override=128),
    # Llama 3.2 1B ties its embedding; its rope scaling (llama3 type) is left out: it does not change speed
    "llama-1b": Preset("llama", 16, 2048, 32, 8, 8192, 128256, 8192, 500000.0, tied=True),
    "qwen3-30b-a3b": Preset("qwen3moe", 48, 2048, 32, 4, 6144, 151936, 40960, 1e6, rms_eps=1e-6,
                            head_dim_override=128, experts=128, experts_used=8, expert_ff=768),
    "gpt-oss-20b": _GPT_OSS_20B,
    "gpt-oss-120b": replace(_GPT_OSS_20B, n_layers=36, experts=128),
    "qwen3.6-27b": Preset("qwen35", 64, 5120, 24, 4, 17408, 248320, 262144, 1e7, linear_heads=(16, 48), **_QWEN36),
    "qwen3.6-35b-a3b": Preset("qwen35moe", 40, 2048, 16, 2, 512, 248320, 262144, 1e7, linear_heads=(16, 32),
                              experts=256, experts_used=8, expert_ff=512, shared_ff=512, **_QWEN36),
    # for tests: SmolLM2's 49152 tokens + 64 padded control tokens
    "tiny": Preset("llama", 2, 256, 4, 2, 512, 49152 + 64, 2048, 10000.0),
}  # fmt: skip


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: (n,), (rows, cols) or (experts, rows, cols)
    type_name: str
    around: float | None = None  # F32 values drawn around this (norms 1, biases 0); None: random blocks


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp, llama_tensor_get_type_impl) for the layers whose attn_v and
    ffn_down Q4_K_M stores in Q6_K: the first and last eighth, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


_MIXES = ("Q4_K_M",)
TYPE_CHOICES = (*_MIXES, *(s.name for s in GGML_TYPES.values()))


def matrix_type(kind: str, i_layer: int, n_layers: int, type_name: str, tied: bool, moe: bool = False) -> str:
    """The weight type of matrix `kind` (token_embd, output, attn_q, ..., ffn_down, ffn_down_exps, ...) in
    layer `i_layer`, as src/llama-quant.cpp's llama_tensor_get_type_impl picks it. Its rules for models of
    exactly 8 experts (Mixtral) are left out: no preset has 8. A linear-attention layer's fused attn_qkv is
    an attn_v to llama-quant.cpp (category_is_attn_v): both count by block."""
    if type_name == "Q4_K_M":
        # output (and a tied embedding, which is the output) Q6_K; attn_v and ffn_down (the experts' down
        # matrices too: a tensor named ffn_down*) Q6_K on the use-more-bits layers; Q4_K elsewhere, the untied
        # token_embd included. attn_v counts its layer by the attn_v (and attn_qkv) tensors before it: one a
        # block, so = i_layer
        if kind == "output" or (kind == "token_embd" and tied):
            return "Q6_K"
        if kind in ("attn_v", "attn_qkv", "ffn_down", "ffn_down_exps", "ffn_down_shexp") and use_more_bits(i_layer, n_layers):
            return "Q6_K"
        return "Q4_K"
    if type_name == "MXFP4" and moe:  # MXFP4_MOE: 3-D tensors (the experts) MXFP4, other matrices Q8_0
        return "MXFP4" if kind.endswith("_exps") else "Q8_0"
    if type_name == "MXFP4" and kind in ("token_embd", "output"):
        return "Q8_0"
    return type_name


def tensor_plan(p: Preset, type_name: str) -> list[PlannedTensor]:
    """Every tensor of the model in file order, with its shape and type."""
    if type_name not in TYPE_CHOICES:
        raise ValueError(f"unknown weight type {type_name!r} (known: {', '.join(TYPE_CHOICES)})")
    plan: list[PlannedTensor] = []

    def matrix(name: str, kind: str, i: int, *shape: int) -> None:
        t = matrix_type(kind, i, p.n_blocks, type_name, p.tied, p.experts > 0)
        block = next(s.block_size for s in GGML_TYPES.values() if s.name == t)
        if shape[-1] % block:
            raise ValueError(f"{name}: {shape[-1]} columns do not hold whole {t} blocks of {block}")
        plan.append(PlannedTensor(name, shape, t))

    def f32(name: str, *shape: int, around: float = 0.0) -> None:
        plan.append(PlannedTensor(name, shape, "F32", around))

    q, kv, h, oai = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim, p.hidden, p.arch == "gpt-oss"
    matrix("token_embd.weight", "token_embd", 0, p.vocab, h)
    if p.arch in _HYBRID_ARCHS:  # two kinds of blocks, and NextN blocks
        _hybrid_blocks(p, matrix, f32)
    llama_layers = () if p.arch in _HYBRID_ARCHS else range(p.n_layers)
    for i in llama_layers:
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", h, around=1.0)
        for n, rows in (("q", q), ("k", kv), ("v", kv)):
            matrix(b + f"attn_{n}.weight", f"attn_{n}", i, rows, h)
            if oai:
                f32(b + f"attn_{n}.bias", rows)
        if p.arch in ("qwen3", "qwen3moe"):
            f32(b + "attn_q_norm.weight", p.head_dim, around=1.0)
            f32(b + "attn_k_norm.weight", p.head_dim, around=1.0)
        matrix(b + "attn_output.weight", "attn_output", i, h, q)
        if oai:
            f32(b + "attn_output.bias", h)
            f32(b + "attn_sinks.weight", p.n_heads)
        # gpt-oss names the feed-forward's norm after the attention it follows
        f32(b + ("post_attention_norm.weight" if oai else "ffn_norm.weight"), h, around=1.0)
        if p.experts:
            e, f = p.experts, p.expert_ff
            f32(b + "ffn_gate_inp.weight", e, h)  # the router
            if oai:
                f32(b + "ffn_gate_inp.bias", e)
            for n, rows, cols in (("gate", f, h), ("up", f, h), ("down", h, f)):
                matrix(b + f"ffn_{n}_exps.weight", f"ffn_{n}_exps", i, e, rows, cols)
                if oai:
                    f32(b + f"ffn_{n}_exps.bias", e, rows)
        else:
            for n, rows, cols in (("gate", p.ffn, h), ("up", p.ffn, h), ("down", h, p.ffn)):
                matrix(b + f"ffn_{n}.weight", f"ffn_{n}", i, rows, cols)
    f32("output_norm.weight", h, around=1.0)
    if not p.tied:
        matrix("output.weight", "output", 0, p.vocab, h)
    return plan


def _hybrid_blocks(p: Preset, matrix, f32) -> None:
    """The blocks of a qwen35 / qwen35moe model, NextN blocks last. Each block has one attn_v or attn_qkv, so
    llama-quant.cpp's count of them and its ffn_down's layer are the block's index among all blocks, NextN
    included (checked with llama-quantize Q4_K_M on an F32 file of each preset's layer count)."""
    h, hd, (hk, hv), d = p.hidden, p.head_dim, p.linear_heads, p.linear_head_dim
    conv_dim, value_dim = 2 * hk * d + hv * d, hv * d
    for i in range(p.n_blocks):
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", h, around=1.0)
        if p.linear(i):
            matrix(b + "attn_qkv.weight", "attn_qkv", i, conv_dim, h)
            matrix(b + "attn_gate.weight", "attn_gate", i, value_dim, h)
            f32(b + "ssm_conv1d.weight", conv_dim, p.conv_kernel)
            f32(b + "ssm_dt.bias", hv)
            f32(b + "ssm_a", hv, around=-1.0)  # -exp(A_log): negative
            for n in ("beta", "alpha"):
                matrix(b + f"ssm_{n}.weight", f"ssm_{n}", i, hv, h)
            f32(b + "ssm_norm.weight", d, around=1.0)
            matrix(b + "ssm_out.weight", "ssm_out", i, h, value_dim)
        else:
            matrix(b + "attn_q.weight", "attn_q", i, 2 * p.n_heads * hd, h)  # query and gate rows per head
            matrix(b + "attn_k.weight", "attn_k", i, p.n_kv_heads * hd, h)
            matrix(b + "attn_v.weight", "attn_v", i, p.n_kv_heads * hd, h)
            matrix(b + "attn_output.weight", "attn_output", i, h, p.n_heads * hd)
            f32(b + "attn_q_norm.weight", hd, around=1.0)
            f32(b + "attn_k_norm.weight", hd, around=1.0)
        f32(b + "post_attention_norm.weight", h, around=1.0)
        if p.experts:
            e, f, s = p.experts, p.expert_ff, p.shared_ff
            f32(b + "ffn_gate_inp.weight", e, h)
            for n, rows, cols in (("gate", f, h), ("up", f, h), ("down", h, f)):
                matrix(b + f"ffn_{n}_exps.weight", f"ffn_{n}_exps", i, e, rows, cols)
            f32(b + "ffn_gate_inp_shexp.weight", h)  # 1-D: llama-quantize drops the converter's [1, H]
            for n, rows, cols in (("gate", s, h), ("up", s, h), ("down", h, s)):
                matrix(b + f"ffn_{n}_shexp.weight", f"ffn_{n}_shexp", i, rows, cols)
        else:
            for n, rows, cols in (("gate", p.ffn, h), ("up", p.ffn, h), ("down", h, p.ffn)):
                matrix(b + f"ffn_{n}.weight", f"ffn_{n}", i, rows, cols)
        if i >= p.n_layers:
            matrix(b + "nextn.eh_proj.weight", "nextn_eh_proj", i, h, 2 * h)
            for n in ("enorm", "hnorm", "shared_head_norm"):
                f32(b + f"nextn.{n}.weight", h, around=1.0)


# -- writing --------------------------------------------------------------------------------------------

_TYPE_IDS = {s.name: t for t, s in GGML_TYPES.items()}
_CHUNK_BYTES = 64 << 20
_WORKERS = os.cpu_count() or 1
_AHEAD = 2 * _WORKERS  # chunks drawn ahead of the writer


def _row_bytes(t: PlannedTensor) -> int:
    s = GGML_TYPES[_TYPE_IDS[t.type_name]]
    return t.shape[-1] // s.block_size * s.type_size


def _nbytes(t: PlannedTensor) -> int:
    return math.prod(t.shape[:-1]) * _row_bytes(t)


class _StreamedTensor:
    """What GGUFWriter.write_tensor_data needs of an array (`nbytes`, `tofile`), generated chunk by chunk
    while it is written: chunks are drawn by the pool's threads (torch's generators release the GIL), each
    from its own seed (the file's seed, the tensor's index, the chunk's), at most `_AHEAD` chunks in memory."""

    def __init__(self, t: PlannedTensor, index: int, seed: int, pool: ThreadPoolExecutor, bar: tqdm) -> None:
        self.t, self.index, self.seed, self.pool, self.bar = t, index, seed, pool, bar
        self.nbytes = _nbytes(t)

    def _generator(self, chunk: int) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, self.index, chunk]).generate_state(2, np.uint64)
        return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))

    def _chunk(self, chunk: int, n: int) -> np.ndarray:
        t, gen = self.t, self._generator(chunk)
        if t.around is not None:  # norms, biases, sinks, routers: F32, at most a few MB
            return (t.around + 0.1 * torch.randn(math.prod(t.shape), generator=gen)).numpy().astype(np.float32)
        tid = _TYPE_IDS[t.type_name]
        return random_blocks(tid, n, t.shape[-1] // GGML_TYPES[tid].block_size, gen).numpy()

    def chunks(self) -> Iterator[np.ndarray]:
        t = self.t
        rows = 1 if t.around is not None else math.prod(t.shape[:-1])  # experts' matrices: E * rows rows
        step = rows if t.around is not None else max(1, _CHUNK_BYTES // _row_bytes(t))
        pending: deque[Future] = deque()
        for chunk, r0 in enumerate(range(0, rows, step)):
            pending.append(self.pool.submit(self._chunk, chunk, min(step, rows - r0)))
            if len(pending) >= _AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def tofile(self, f: BinaryIO) -> None:
        for chunk in self.chunks():
            f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
            self.bar.update(chunk.nbytes)


def _file_type(type_name: str, moe: bool) -> int | None:
    """general.file_type when a llama.cpp ftype names this choice (none for MXFP4 on dense layers)."""
    if type_name == "F32":
        return int(gguf.LlamaFileType.ALL_F32)
    if type_name == "MXFP4" and moe:
        return int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    ft = getattr(gguf.LlamaFileType, f"MOSTLY_{type_name}", None)
    return None if ft is None else int(ft)


def add_decoder_hparams(w: gguf.GGUFWriter, p: Preset) -> None:
    """The `{arch}.*` hyperparameter keys of a llama-family decoder, with the experts', sliding window's,
    YaRN's and a hybrid model's where the preset has them (shared with tests/gguf_factory.py)."""
    w.add_block_count(p.n_blocks)
    w.add_context_length(p.context)
    w.add_embedding_length(p.hidden)
    w.add_feed_forward_length(p.ffn)
    w.add_head_count(p.n_heads)
    w.add_head_count_kv(p.n_kv_heads)
    w.add_layer_norm_rms_eps(p.rms_eps)
    w.add_rope_freq_base(p.rope_theta)
    w.add_rope_dimension_count(p.rope_dim_override or p.head_dim)
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_vocab_size(p.vocab)
    if p.experts:
        w.add_expert_count(p.experts)
        w.add_expert_used_count(p.experts_used)
        w.add_expert_feed_forward_length(p.expert_ff)
    if p.shared_ff:
        w.add_expert_shared_feed_forward_length(p.shared_ff)
    if p.sliding_window:
        w.add_sliding_window(p.sliding_window)
    if p.arch in _HYBRID_ARCHS:
        hk, hv = p.linear_heads
        w.add_ssm_conv_kernel(p.conv_kernel)
        w.add_ssm_state_size(p.linear_head_dim)
        w.add_ssm_group_count(hk)
        w.add_ssm_time_step_rank(hv)
        w.add_ssm_inner_size(hv * p.linear_head_dim)
        w.add_full_attention_interval(p.full_attention_interval)
        w.add_array(f"{p.arch}.attention.recurrent_layers", [p.linear(i) for i in range(p.n_blocks)])
        w.add_rope_dimension_sections(list(p.rope_sections))
        if p.nextn:
            w.add_nextn_predict_layers(p.nextn)
    if p.yarn_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(p.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(p.yarn_context)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)


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
    ft = _file_type(type_name, p.experts > 0)
    if ft is not None:
        w.add_file_type(ft)
    add_decoder_hparams(w, p)
    add_smollm2_tokenizer(w, smollm2_tokenizer_metadata(), p.vocab)
    for t in plan:  # blocks as bytes per row (GGUFWriter turns them into elements), F32 as floats
        blocks = t.around is None
        w.add_tensor_info(t.name, (*t.shape[:-1], _row_bytes(t)) if blocks else t.shape,
                          np.dtype(np.uint8 if blocks else np.float32), _nbytes(t),
                          raw_dtype=gguf.GGMLQuantizationType(_TYPE_IDS[t.type_name]))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(_nbytes(t) for t in plan)
    with (tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress, file=sys.stderr) as bar,
          ThreadPoolExecutor(_WORKERS) as pool):
        for i, t in enumerate(plan):
            w.write_tensor_data(_StreamedTensor(t, i, seed, pool, bar))  # type: ignore[arg-type]
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
