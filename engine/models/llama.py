"""One decoder for the llama family: llama (Llama 2/3, SmolLM2, Mistral), qwen2 (q/k/v biases), qwen3
(per-head RMSNorm on q and k), and their mixture-of-experts forms: qwen3moe, qwen2moe (a shared expert) and
gpt-oss (biases on q/k/v/o and on the experts, a learned sink logit per head, sliding-window attention on
every other layer, the experts' clamped SwiGLU).

    h = embed(ids)
    for each layer:  h += o_proj(attn(rope(q), rope(k), v))   with q, k, v = qkv_proj(norm(h))
                     h += ffn(norm(h))                        dense (layers/mlp.py) or experts (layers/moe.py)
    logits = lm_head(norm(h))                                 lm_head reads token_embd when tied

Many devices (engine/distributed/): a model object holds one rank's share. Its stage's layers only (the
embedding on the first stage, norm and head on the last); inside a tensor-parallel group each lane holds a
slice: q/k/v and gate/up by output rows (heads, feed-forward columns), o_proj and down by input columns in
whole quantization blocks (down's dealt over the lanes, so a lane may hold a block more than its neighbour,
gate/up taking the same rows), the embedding and head by vocabulary rows. One AllReduce after attention, one
after the MLP, one after the embedding (rows a lane does not own are zero); the head's slices are gathered.
With one device every slice is the whole tensor and every collective the identity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vegaserve.engine.distributed.communicator import Communicator, LocalCommunicator
from vegaserve.engine.distributed.sharding import slice_cols, slice_rows, vocab_slice
from vegaserve.engine.distributed.topology import kv_heads_per_lane, lane_kv_head
from vegaserve.engine.forward_batch import ForwardBatch
from vegaserve.engine.layers.attention import KVCache, cached_attention, kv_store
from vegaserve.engine.layers.embedding import QuantEmbedding
from vegaserve.engine.layers.linear import QuantLinear, QuantMethod
from vegaserve.engine.layers.mlp import DenseMLP
from vegaserve.engine.layers.moe import MoE
from vegaserve.engine.layers.norm import RMSNorm, add_delta
from vegaserve.engine.layers.rotary import RotaryEmbedding
from vegaserve.engine.models.arch_config import ArchConfig
from vegaserve.engine.models.weights import WeightLoader
from vegaserve.triton_kernels.fused import HeadNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, index: int, method: QuantMethod, comm: Communicator, cache_layer: int,
                 shared_split: bool = True) -> None:
        super().__init__()
        self.index = index  # the GGUF layer (tensor names)
        self.cache_layer = cache_layer  # its place in this rank's KV cache
        self.comm = comm
        tp, lane = comm.tp, comm.lane
        self.head_dim = cfg.head_dim
        self.n_heads = cfg.n_heads // tp
        self.n_kv = kv_heads_per_lane(cfg.n_kv_heads, tp)
        self.kv0 = lane_kv_head(cfg.n_heads, cfg.n_kv_heads, tp, lane)
        self.lane = lane
        self.window = cfg.window(index)  # keys attended at most, 0: all
        self.sinks: torch.Tensor | None = None  # [heads] f32, gpt-oss
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.qkv = QuantLinear(cfg.hidden_size, [q_size, kv_size, kv_size], method)
        self.o_proj = QuantLinear(q_size, [cfg.hidden_size], method)
        # q/k norm weights [2, head_dim] (q's row, k's row), applied by the rotation (one launch for both)
        self.register_buffer("qk_norm", torch.ones(2, cfg.head_dim) if cfg.qk_norm else None, persistent=False)
        self.eps = cfg.rms_eps
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        if cfg.moe is not None:
            self.ffn: DenseMLP | MoE = MoE(cfg.hidden_size, cfg.moe, method, tp, lane, shared_split)
        else:
            self.ffn = DenseMLP(cfg.hidden_size, cfg.intermediate_size, method, tp, lane)
        self.split = [q_size, kv_size, kv_size]
        self.full_sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]  # before slicing
        self.hidden = cfg.hidden_size

    def load(self, w: WeightLoader) -> None:
        p = f"blk.{self.index}."
        hd = self.head_dim
        # this lane's rows of q, k, v: its query heads, and the KV heads they read
        q_rows = (self.lane * self.n_heads * hd, self.n_heads * hd)
        kv_rows = (self.kv0 * hd, self.n_kv * hd)
        rows = dict(zip("qkv", (q_rows, kv_rows, kv_rows), strict=True))
        self.attn_norm.weight.data = w.vector(p + "attn_norm.weight", self.attn_norm.weight.shape)
        biases = None
        if (p + "attn_q.bias") in w:
            biases = [
                w.vector(p + f"attn_{n}.bias", (full,))[rows[n][0] : sum(rows[n])]
                for n, full in zip("qkv", self.full_sizes, strict=True)
            ]
        hidden, full = self.hidden, dict(zip("qkv", self.full_sizes, strict=True))
        self.qkv.load(
            [slice_rows(w.source(p + f"attn_{n}.weight", (full[n], hidden)), *rows[n]) for n in "qkv"], w.device, biases
        )
        # a lane's share of the output bias: all of it on lane 0, whose partial sum the AllReduce adds once
        o_bias = None
        if (p + "attn_output.bias") in w:
            o_bias = [w.vector(p + "attn_output.bias", (hidden,)) * (1.0 if self.lane == 0 else 0.0)]
        self.o_proj.load([slice_cols(w.source(p + "attn_output.weight", (hidden, full["q"])), *q_rows)], w.device,
                         o_bias)
        if (p + "attn_sinks.weight") in w:
            heads = slice(self.lane * self.n_heads, (self.lane + 1) * self.n_heads)
            self.sinks = w.vector(p + "attn_sinks.weight", (self.n_heads * self.comm.tp,))[heads]
        if self.qk_norm is not None:
            self.qk_norm = torch.stack([w.vector(p + f"attn_{n}_norm.weight", (hd,)) for n in "qk"]).float()
        # gpt-oss names the feed-forward's norm after the attention it follows
        norm = "post_attention_norm.weight" if (p + "post_attention_norm.weight") in w else "ffn_norm.weight"
        self.ffn_norm.weight.data = w.vector(p + norm, self.ffn_norm.weight.shape)
        self.ffn.load(w, p)

    def forward(self, h: torch.Tensor, rope: RotaryEmbedding, cache: KVCache, batch: ForwardBatch,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta): the residual stream after attention and the MLP's output, not yet added to it (a
        mixture of experts' on one lane not yet summed either: moe_ops.ExpertSum). The layer before leaves
        its own delta the same way: its add (and sum) and this layer's norm are one launch."""
        T = h.shape[0]
        if delta is None:
            x, xq = self.attn_norm.forward_q8_1(h, self.qkv.wants_q8_1(T))
        else:
            h, x, xq = self.attn_norm.add_forward(h, delta, self.qkv.wants_q8_1(T))
        qkv = self.qkv(x, xq)
        v = qkv[:, self.split[0] + self.split[1] :].view(T, self.n_kv, self.head_dim)
        # on a GPU the rotation of the keys also writes them and the values to the cache (one launch fewer)
        want = self.o_proj.wants_q8_1(T)  # the attention's output in q8_1 too, written by its decode kernel
        # q's and k's heads are adjacent in qkv: one rotation (one launch, their norms in it) for both
        qk = qkv[:, : self.split[0] + self.split[1]].view(T, self.n_heads + self.n_kv, self.head_dim)
        store = kv_store(v, self.cache_layer, cache, batch, self.n_heads)
        norm = None if self.qk_norm is None else HeadNorm(self.qk_norm, self.n_heads, self.eps)
        qk = rope(qk, batch.positions, store, norm)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        a, aq = cached_attention(q, k, v, self.cache_layer, cache, batch, self.scale, stored=store is not None,
                                 want_q8_1=want, window=self.window, sinks=self.sinks)
        h, x, xq = self.ffn_norm.add_forward(h, self.comm.all_reduce(self.o_proj(a.reshape(T, -1), aq)),
                                             self.ffn.wants_q8_1(T))
        return h, self.ffn.delta(x, xq) if self.comm.tp == 1 else self.comm.all_reduce(self.ffn(x, xq))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, method: QuantMethod, max_positions: int, comm: Communicator | None = None,
                 layers: range | None = None, shared_split: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.method = method
        self.max_positions = max_positions
        self.comm = comm = comm or LocalCommunicator()
        self.layer_range = range(cfg.n_layers) if layers is None else layers
        self.layers = self._build_layers(shared_split)
        self.vocab0, vocab_rows, self.vocab_width = vocab_slice(cfg.vocab_size, comm.tp, comm.lane)
        self.embed = QuantEmbedding(vocab_rows, cfg.hidden_size) if comm.is_first_stage else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps) if comm.is_last_stage else None
        self.lm_head = QuantLinear(cfg.hidden_size, [vocab_rows], method) if comm.is_last_stage else None
        self.rope: RotaryEmbedding | None = None
        self.keep_hidden = False  # lane_logits keeps `hidden` (models/hybrid.py NextNHead)
        self.hidden: torch.Tensor | None = None

    def _build_layers(self, shared_split: bool) -> nn.ModuleList:
        """This rank's decoder layers, in order (models/hybrid.py builds its two kinds)."""
        return nn.ModuleList(DecoderLayer(self.cfg, i, self.method, self.comm, j, shared_split)
                             for j, i in enumerate(self.layer_range))

    @property
    def n_cache_layers(self) -> int:
        """Layers of this rank that keep k/v in the paged cache."""
        return len(self.layers)

    def recurrent_state(self, slots: int, device: torch.device, spare: int = 0, backups: bool = False,
                        snapshots: int = 0):
        """The per-sequence state of a hybrid model's linear-attention layers (models/hybrid.py); none here."""
        return None

    @property
    def kv_heads(self) -> int:
        """KV heads this rank caches per layer."""
        return kv_heads_per_lane(self.cfg.n_kv_heads, self.comm.tp)

    def load(self, w: WeightLoader) -> None:
        cfg = self.cfg
        if self.embed is not None:
            table = w.source("token_embd.weight", (cfg.vocab_size, cfg.hidden_size))
            self.embed.load(slice_rows(table, self.vocab0, self.embed.vocab), w.device)
        freq_factors = w.vector("rope_freqs.weight", (cfg.rope_dim // 2,)) if "rope_freqs.weight" in w else None
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_dim, cfg.rope_theta, self.max_positions, cfg.rope_scaling,
            neox=cfg.architecture != "llama", freq_factors=freq_factors,
        )
        for layer in w.progress(self.layers):
            layer.load(w)
        if self.lm_head is not None:
            self.norm.weight.data = w.vector("output_norm.weight", (cfg.hidden_size,))
            # a tied head multiplies by the embedding table itself
            head = w.source("token_embd.weight" if cfg.tied_embeddings else "output.weight", (cfg.vocab_size, cfg.hidden_size))
            self.lm_head.load([slice_rows(head, self.vocab0, self.lm_head.out_features)], w.device)
        # what other ranks load is not "unused"
        w.skip(n for n in w.names() if not self._owns(n))

    def _owns(self, name: str) -> bool:
        if name.startswith("blk."):
            return int(name.split(".")[1]) in self.layer_range
        if name == "token_embd.weight":
            return self.embed is not None or (self.lm_head is not None and self.cfg.tied_embeddings)
        if name.startswith("output"):
            return self.lm_head is not None
        return True

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """First stage: [T, hidden]; with vocabulary slices, each lane fills the rows it owns and the
        AllReduce completes them."""
        ids = batch.input_ids
        if self.comm.tp == 1:
            return self.embed(ids)
        local = ids - self.vocab0
        owned = (local >= 0) & (local < self.embed.vocab)
        h = self.embed(torch.where(owned, local, 0))
        return self.comm.all_reduce(h * owned[:, None])

    def run_layers(self, h: torch.Tensor, cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        delta = None
        for layer in self.layers:
            h, delta = layer(h, self.rope, cache, batch, delta)
        return h if delta is None else add_delta(h, delta)

    def head(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Last stage: logits [len(batch.logits_rows), vocab] in f32, gathered over the lanes."""
        return self.gather_logits(self.lane_logits(h, batch))

    def lane_logits(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """This lane's slice of the logits rows [len(batch.logits_rows), its vocabulary share], f32. With
        keep_hidden (an MTP head drafts from them), `hidden` becomes every row's output-normed state."""
        if self.keep_hidden:  # every row normed once; the head takes its rows of them (and quantizes them itself)
            self.hidden = self.norm(h)
            return self.lm_head(self.hidden[batch.logits_rows]).float()
        h = h[batch.logits_rows]
        return self.lm_head(*self.norm.forward_q8_1(h, self.lm_head.wants_q8_1(h.shape[0]))).float()

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every lane's lane_logits -> the whole vocabulary (collective over the tensor-parallel group)."""
        if self.comm.tp == 1:
            return logits
        pad = self.vocab_width - logits.shape[1]
        return self.comm.gather_vocab(F.pad(logits, (0, pad)) if pad else logits, self.cfg.vocab_size)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The whole model on one stage: logits [len(batch.logits_rows), vocab] in f32."""
        return self.head(self.run_layers(self.embed_tokens(batch), cache, batch), batch)

    def forward_lane(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """forward up to this lane's logits (gather_logits completes them): what a decode graph captures,
        its AllReduces inside, the vocabulary's gather after the replay."""
        return self.lane_logits(self.run_layers(self.embed_tokens(batch), cache, batch), batch)
