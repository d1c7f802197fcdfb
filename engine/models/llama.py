"""One decoder for the llama family: llama (Llama 2/3, SmolLM2, Mistral), qwen2 (q/k/v biases) and qwen3
(per-head RMSNorm on q and k).

    h = embed(ids)
    for each layer:  h += o_proj(attn(rope(q), rope(k), v))   with q, k, v = qkv_proj(norm(h))
                     h += down(silu(gate(x)) * up(x))         with x = norm(h)
    logits = lm_head(norm(h))                                 lm_head reads token_embd when tied
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vegaserve.engine.forward_batch import ForwardBatch
from vegaserve.engine.layers.attention import KVCache, cached_attention
from vegaserve.engine.layers.embedding import QuantEmbedding
from vegaserve.engine.layers.linear import QuantLinear, QuantMethod
from vegaserve.engine.layers.norm import RMSNorm
from vegaserve.engine.layers.rotary import RotaryEmbedding
from vegaserve.engine.models.arch_config import ArchConfig
from vegaserve.engine.models.weights import WeightLoader


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, index: int, method: QuantMethod) -> None:
        super().__init__()
        self.index = index
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.qkv = QuantLinear(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], method)
        self.o_proj = QuantLinear(cfg.q_size, [cfg.hidden_size], method)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.gate_up = QuantLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, method)
        self.down = QuantLinear(cfg.intermediate_size, [cfg.hidden_size], method)
        self.split = [cfg.q_size, cfg.kv_size, cfg.kv_size]

    def load(self, w: WeightLoader) -> None:
        p = f"blk.{self.index}."
        self.attn_norm.weight.data = w.vector(p + "attn_norm.weight", self.attn_norm.weight.shape)
        biases = None
        if (p + "attn_q.bias") in w:
            biases = [w.vector(p + f"attn_{n}.bias", (size,)) for n, size in zip("qkv", self.split, strict=True)]
        self.qkv.load([w.source(p + f"attn_{n}.weight") for n in "qkv"], w.device, biases)
        self.o_proj.load([w.source(p + "attn_output.weight")], w.device)
        if self.q_norm is not None:
            self.q_norm.weight.data = w.vector(p + "attn_q_norm.weight", (self.head_dim,))
            self.k_norm.weight.data = w.vector(p + "attn_k_norm.weight", (self.head_dim,))
        self.ffn_norm.weight.data = w.vector(p + "ffn_norm.weight", self.ffn_norm.weight.shape)
        self.gate_up.load([w.source(p + "ffn_gate.weight"), w.source(p + "ffn_up.weight")], w.device)
        self.down.load([w.source(p + "ffn_down.weight")], w.device)

    def forward(self, h: torch.Tensor, rope: RotaryEmbedding, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        T = h.shape[0]
        q, k, v = self.qkv(self.attn_norm(h)).split(self.split, dim=-1)
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv, self.head_dim)
        v = v.view(T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, batch.positions), rope(k, batch.positions)
        a = cached_attention(q, k, v, self.index, cache, batch, self.scale)
        h = h + self.o_proj(a.reshape(T, -1))
        gate, up = self.gate_up(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, method: QuantMethod, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.method = method
        self.max_positions = max_positions
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, method) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.embed = QuantEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = QuantLinear(cfg.hidden_size, [cfg.vocab_size], method)
        self.rope: RotaryEmbedding | None = None

    def load(self, w: WeightLoader) -> None:
        cfg = self.cfg
        self.embed.load(w.source("token_embd.weight"), w.device)
        freq_factors = w.vector("rope_freqs.weight", (cfg.rope_dim // 2,)) if "rope_freqs.weight" in w else None
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_dim, cfg.rope_theta, self.max_positions, cfg.rope_scaling,
            neox=cfg.architecture != "llama", freq_factors=freq_factors,
        )
        for layer in w.progress(self.layers):
            layer.load(w)
        self.norm.weight.data = w.vector("output_norm.weight", (cfg.hidden_size,))
        # a tied head multiplies by the embedding table itself
        self.lm_head.load([w.source("token_embd.weight" if cfg.tied_embeddings else "output.weight")], w.device)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits [len(batch.logits_rows), vocab] in f32."""
        h = self.embed(batch.input_ids)
        for layer in self.layers:
            h = layer(h, self.rope, cache, batch)
        h = self.norm(h[batch.logits_rows])
        return self.lm_head(h).float()
