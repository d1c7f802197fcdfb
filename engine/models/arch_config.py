"""GGUF metadata -> the typed shape of a decoder model.

Keys follow llama.cpp's naming (`{arch}.block_count`, `{arch}.rope.scaling.type`, ...). Llama-3 style rope
scaling does not appear here: converters store it as the per-dimension `rope_freqs.weight` tensor, which
the rotary layer reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vegaserve.engine.gguf_file import ModelLoadError


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context_length: int = 0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_scaling: RopeScaling
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k
    qkv_bias: bool  # qwen2: biases on q, k, v
    tied_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


def arch_config_from_gguf(md: dict[str, Any], tensor_names: set[str], path: str) -> ArchConfig:
    arch = str(md.get("general.architecture", ""))

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in md:
            return md[full]
        if default is None:
            raise ModelLoadError(f"{path}: metadata key {full} is missing")
        return default

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer counts: one value for all layers is all this decoder takes
        if len(set(n_kv)) != 1:
            raise ModelLoadError(f"{path}: per-layer KV head counts are not supported")
        n_kv = n_kv[0]
    head_dim = int(get("attention.key_length", hidden // n_heads))
    vocab = int(get("vocab_size", len(md.get("tokenizer.ggml.tokens", [])) or -1))
    kind = str(get("rope.scaling.type", "none"))
    factor = float(get("rope.scaling.factor", 0.0) or 0.0)
    if kind == "none" and f"{arch}.rope.scale_linear" in md:
        kind, factor = "linear", float(get("rope.scale_linear"))
    if kind not in ("none", "linear", "yarn"):
        raise ModelLoadError(f"{path}: rope scaling type {kind!r} is not supported (none, linear, yarn)")
    if kind != "none" and factor <= 0:
        raise ModelLoadError(f"{path}: rope scaling {kind} needs {arch}.rope.scaling.factor > 0")
    scaling = RopeScaling(
        kind=kind,
        factor=factor if kind != "none" else 1.0,
        original_context_length=int(get("rope.scaling.original_context_length", 0) or 0),
        attn_factor=float(get("rope.scaling.attn_factor", 1.0) or 1.0),
        beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
    )
    return ArchConfig(
        architecture=arch,
        n_layers=int(get("block_count")),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=vocab,
        context_length=int(get("context_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rope_scaling=scaling,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        tied_embeddings="output.weight" not in tensor_names,
    )
