"""GGUF metadata -> the typed shape of a decoder model.

Keys follow llama.cpp's naming (`{arch}.block_count`, `{arch}.rope.scaling.type`, ...). Llama-3 style rope
scaling does not appear here: converters store it as the per-dimension `rope_freqs.weight` tensor, which
the rotary layer reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vegaserve.engine.gguf_file import ModelLoadError
from vegaserve.engine.models.hybrid_config import HYBRID_ARCHITECTURES, HybridConfig, hybrid_config_from_gguf


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context_length: int = 0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # YaRN's correction range rounded out to whole dimensions (gpt-oss: not)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (every layer of the model): the router picks `used` of `experts`
    per token. gating "softmax": softmax over all experts, then the top `used` (their weights renormalized
    to sum 1 where norm_topk); "topk_softmax": the top `used` router logits, softmax over them (gpt-oss).
    act "silu": silu(gate) * up; "swiglu_oai": gpt-oss's clamped SwiGLU, min(g, limit) sigmoid(alpha
    min(g, limit)) (clamp(u, -limit, limit) + 1). shared_ff > 0: a shared expert beside them, its output
    scaled by sigmoid(x . w_gate) (the qwen2moe layout)."""

    experts: int
    used: int
    expert_ff: int
    gating: str = "softmax"
    norm_topk: bool = True
    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    shared_ff: int = 0
    biases: bool = False  # biases on the router and on every expert matrix (gpt-oss)


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    n_layers: int  # blocks in the file ({arch}.block_count): a hybrid model's trailing NextN blocks too
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
    moe: MoEConfig | None = None  # None: a dense feed-forward
    o_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    attn_sinks: bool = False  # one learned logit per head in every softmax's denominator (gpt-oss)
    sliding_window: int = 0  # > 0: the layers swa_layers(i) says attend to the last this many keys only
    swa_pattern: int = 0  # layer i slides where i % swa_pattern < swa_pattern - 1 (llama.cpp's rule)
    hybrid: HybridConfig | None = None  # gated DeltaNet layers beside gated full attention (models/hybrid.py)

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Keys a query of `layer` attends to at most (0: all)."""
        if not self.sliding_window or not self.swa_pattern:
            return 0
        return self.sliding_window if layer % self.swa_pattern < self.swa_pattern - 1 else 0


# Per-architecture facts the GGUF does not carry (llama.cpp fixes them in its graph for each architecture):
# the router's gating, whether the top-k weights are renormalized, the experts' activation, and which
# layers slide.
_MOE_RULES: dict[str, dict[str, Any]] = {
    "qwen3moe": {"gating": "softmax", "norm_topk": True},
    "qwen2moe": {"gating": "softmax", "norm_topk": False},
    "gpt-oss": {"gating": "topk_softmax", "norm_topk": False, "act": "swiglu_oai", "biases": True},
    "qwen35moe": {"gating": "softmax", "norm_topk": True},
    "qwen3next": {"gating": "softmax", "norm_topk": True},
}
_SWA_PATTERN = {"gpt-oss": 2}
_YARN_UNTRUNCATED = {"gpt-oss"}  # its reference implementation ramps between the exact correction dimensions


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
        truncate=arch not in _YARN_UNTRUNCATED,
    )
    moe = None
    if arch in _MOE_RULES:
        experts, used = int(get("expert_count")), int(get("expert_used_count"))
        if not 0 < used <= experts:
            raise ModelLoadError(f"{path}: {arch}.expert_used_count {used} must be in 1..{arch}.expert_count {experts}")
        moe = MoEConfig(experts=experts, used=used, expert_ff=int(get("expert_feed_forward_length")),
                        shared_ff=int(get("expert_shared_feed_forward_length", 0)), **_MOE_RULES[arch])
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
        # a hybrid model's first layer may be linear attention: any layer's q norm says
        qk_norm=any(n.startswith("blk.") and n.endswith(".attn_q_norm.weight") for n in tensor_names),
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        tied_embeddings="output.weight" not in tensor_names,
        moe=moe,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        attn_sinks="blk.0.attn_sinks.weight" in tensor_names,
        sliding_window=int(get("attention.sliding_window", 0)),
        swa_pattern=_SWA_PATTERN.get(arch, 0),
        hybrid=hybrid_config_from_gguf(arch, get, md, tensor_names, path) if arch in HYBRID_ARCHITECTURES else None,
    )
