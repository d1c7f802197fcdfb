"""Hybrid linear-attention decoders: qwen35 (dense feed-forward), qwen35moe and qwen3next (mixture of experts
with a shared expert). Most layers are gated DeltaNet (engine/layers/delta_net.py), the rest gated full
attention; which is which comes from the GGUF (models/hybrid_config.py).

    h = embed(ids)
    for each layer:  h += mixer(norm(h))       DeltaNet over the sequence's recurrent state, or attention:
                                               [q | gate] per head, k, v = x W^T; q, k = rmsnorm per head,
                                               partial rotary on both; o = attn(q, k, v) * sigmoid(gate)
                     h += ffn(norm(h))         dense (layers/mlp.py) or experts + gated shared expert (layers/moe.py)
    logits = lm_head(norm(h))

The norms' weights are used as stored: the converter already wrote Qwen3-Next's (1 + w). Qwen3.5's
interleaved M-RoPE sections are not read: a text token has the same position in every section, where it is
the plain rotation.

The NextN (MTP) blocks the file may end with are loaded and kept on the model (`nextn`) for speculative
decoding; the trunk does not run them. Under tensor parallelism each lane holds its share of the attention
heads, of the linear-attention key heads and the value heads that read them (HybridConfig.lane_heads), and
of the feed-forward; the mixer's and the feed-forward's partial sums meet in the layer's AllReduces.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vegaserve.engine.distributed.communicator import Communicator, LocalCommunicator
from vegaserve.engine.distributed.sharding import slice_cols, slice_rows
from vegaserve.engine.distributed.topology import kv_heads_per_lane, lane_kv_head
from vegaserve.engine.forward_batch import ForwardBatch
from vegaserve.engine.layers.attention import KVCache, cached_attention, kv_store
from vegaserve.engine.layers.delta_net import GatedDeltaNet, RecurrentState
from vegaserve.engine.layers.embedding import QuantEmbedding
from vegaserve.engine.layers.linear import QuantLinear, QuantMethod
from vegaserve.engine.layers.mlp import DenseMLP
from vegaserve.engine.layers.moe import MoE
from vegaserve.engine.layers.norm import Q8_1, RMSNorm, add_delta
from vegaserve.engine.layers.rotary import RotaryEmbedding
from vegaserve.engine.models.arch_config import ArchConfig
from vegaserve.engine.models.llama import LlamaModel
from vegaserve.engine.models.weights import WeightLoader
from vegaserve.triton_kernels.fused import HeadNorm, gate_heads


class GatedAttention(nn.Module):
    """Full attention whose output is gated per element by sigmoid of a second half of each q head's rows.
    A tensor-parallel lane holds its share of the query heads and the KV heads they read (models/llama.py's
    split); its o_proj output is a partial sum."""

    def __init__(self, cfg: ArchConfig, method: QuantMethod, cache_layer: int, tp: int = 1, lane: int = 0) -> None:
        super().__init__()
        self.cache_layer = cache_layer
        self.n_heads, self.n_kv = cfg.n_heads // tp, kv_heads_per_lane(cfg.n_kv_heads, tp)
        self.head_dim, self.hidden = cfg.head_dim, cfg.hidden_size
        self.q0, self.kv0 = lane * self.n_heads, lane_kv_head(cfg.n_heads, cfg.n_kv_heads, tp, lane)
        self.full = [2 * cfg.q_size, cfg.kv_size, cfg.kv_size]  # the GGUF's rows
        q, kv = self.n_heads * cfg.head_dim, self.n_kv * cfg.head_dim
        self.split = [2 * q, kv, kv]  # q rows: per head, D of query then D of gate
        self.qkv = QuantLinear(cfg.hidden_size, self.split, method)
        self.o_proj = QuantLinear(q, [cfg.hidden_size], method)
        # q/k norm weights [2, head_dim] (q's row, k's row), applied by the rotations
        self.register_buffer("qk_norm", torch.ones(2, cfg.head_dim), persistent=False)
        self.eps = cfg.rms_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def load(self, w: WeightLoader, p: str) -> None:
        D = self.head_dim
        first = (2 * self.q0 * D, self.kv0 * D, self.kv0 * D)
        self.qkv.load([slice_rows(w.source(p + f"attn_{n}.weight", (rows, self.hidden)), a, k)
                       for n, rows, a, k in zip("qkv", self.full, first, self.split, strict=True)], w.device)
        self.o_proj.load([slice_cols(w.source(p + "attn_output.weight", (self.hidden, self.full[0] // 2)),
                                     self.q0 * D, self.split[0] // 2)], w.device)
        self.qk_norm = torch.stack([w.vector(p + f"attn_{n}_norm.weight", (D,)) for n in "qk"]).float()

    def wants_q8_1(self, m: int) -> bool:
        return self.qkv.wants_q8_1(m)

    def forward(self, x: torch.Tensor, xq: Q8_1 | None, rope: RotaryEmbedding, cache: KVCache,
                batch: ForwardBatch) -> torch.Tensor:
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        qg, k, v = self.qkv(x, xq).split(self.split, dim=-1)
        qg = qg.view(T, H, 2, D)
        v = v.reshape(T, self.n_kv, D)
        store = kv_store(v, self.cache_layer, cache, batch, 0)
        # q's heads are apart from k's (a gate between them): a rotation each, the norm in it (weight row 0 for
        # every q head, row 1 for every k head)
        q = rope(qg[:, :, 0], batch.positions, None, HeadNorm(self.qk_norm, H, self.eps))
        k = rope(k.reshape(T, self.n_kv, D), batch.positions, store, HeadNorm(self.qk_norm, 0, self.eps))
        # the gate comes between the attention and o_proj: the gate's launch writes o_proj's q8_1 copy
        a, _ = cached_attention(q, k, v, self.cache_layer, cache, batch, self.scale, stored=store is not None)
        if a.is_cuda:
            return self.o_proj(*gate_heads(a.view(T, H, D), qg[:, :, 1], self.o_proj.wants_q8_1(T)))
        return self.o_proj(a.reshape(T, H * D) * torch.sigmoid(qg[:, :, 1].reshape(T, H * D).float()).to(a.dtype))


class HybridLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, index: int, method: QuantMethod, cache_layer: int, state_layer: int,
                 shared_split: bool = True, comm: Communicator | None = None) -> None:
        super().__init__()
        self.index = index
        self.comm = comm = comm or LocalCommunicator()
        tp, lane = comm.tp, comm.lane
        self.linear = cfg.hybrid.recurrent[index]
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mixer: GatedDeltaNet | GatedAttention = (
            GatedDeltaNet(cfg.hidden_size, cfg.hybrid, cfg.rms_eps, method, state_layer, tp, lane) if self.linear
            else GatedAttention(cfg, method, cache_layer, tp, lane))
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.ffn: DenseMLP | MoE = (MoE(cfg.hidden_size, cfg.moe, method, tp, lane, shared_split) if cfg.moe is not None
                                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, method, tp, lane))

    def load(self, w: WeightLoader) -> None:
        p = f"blk.{self.index}."
        self.attn_norm.weight.data = w.vector(p + "attn_norm.weight", self.attn_norm.weight.shape)
        self.ffn_norm.weight.data = w.vector(p + "post_attention_norm.weight", self.ffn_norm.weight.shape)
        self.mixer.load(w, p)
        self.ffn.load(w, p)

    def forward(self, h: torch.Tensor, rope: RotaryEmbedding, cache: KVCache, batch: ForwardBatch,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) as models/llama.py's DecoderLayer: the residual add is the next norm's launch."""
        T = h.shape[0]
        want = self.mixer.wants_q8_1(T)
        if delta is None:
            x, xq = self.attn_norm.forward_q8_1(h, want)
        else:
            h, x, xq = self.attn_norm.add_forward(h, delta, want)
        if self.linear:
            out = self.mixer(x, xq, cache.state, batch)
        else:
            out = self.mixer(x, xq, rope, cache, batch)
        h, x, xq = self.ffn_norm.add_forward(h, self.comm.all_reduce(out), self.ffn.wants_q8_1(T))
        return h, self.ffn.delta(x, xq) if self.comm.tp == 1 else self.comm.all_reduce(self.ffn(x, xq))


class NextNHead(nn.Module):
    """One MTP block (speculative decoding's draft-mtp), as llama.cpp's qwen35 MTP graph: at position p it
    reads token p and the trunk's output-normed hidden state of position p - 1 (or, drafting further, its
    own output of the row before): e = enorm(embed(token)), x = hnorm(h), h = eh_proj([e; x]), then a
    full-attention block over its own KV cache layer (`cache_layer`, beside the trunk's), then
    shared_head_norm (or the model's output norm): the hidden state it passes on, and through the head (its
    own, or the model's) the logits of token p + 1."""

    def __init__(self, cfg: ArchConfig, index: int, method: QuantMethod, shared_split: bool = True,
                 cache_layer: int = -1, comm: Communicator | None = None) -> None:
        super().__init__()
        self.index, self.cfg = index, cfg
        hidden = cfg.hidden_size
        if cfg.hybrid.recurrent[index]:
            raise ValueError(f"MTP block {index} is a linear-attention layer; llama.cpp's MTP graph takes full attention")
        self.block = HybridLayer(cfg, index, method, cache_layer, -1, shared_split, comm)
        self.eh_proj = QuantLinear(2 * hidden, [hidden], method)
        self.enorm = RMSNorm(hidden, cfg.rms_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_eps)
        self.head_norm: RMSNorm | None = None  # None: the model's output norm
        self.embed: QuantEmbedding | None = None  # None: the model's token embedding
        self.head: QuantLinear | None = None  # None: the model's LM head
        self.method = method

    def load(self, w: WeightLoader) -> None:
        p, hidden, vocab = f"blk.{self.index}.nextn.", self.cfg.hidden_size, self.cfg.vocab_size
        self.block.load(w)
        self.eh_proj.load([w.source(p + "eh_proj.weight", (hidden, 2 * hidden))], w.device)
        self.enorm.weight.data = w.vector(p + "enorm.weight", (hidden,))
        self.hnorm.weight.data = w.vector(p + "hnorm.weight", (hidden,))
        if (p + "shared_head_norm.weight") in w:
            self.head_norm = RMSNorm(hidden, self.cfg.rms_eps)
            self.head_norm.weight.data = w.vector(p + "shared_head_norm.weight", (hidden,))
        if (p + "embed_tokens.weight") in w:
            self.embed = QuantEmbedding(vocab, hidden)
            self.embed.load(w.source(p + "embed_tokens.weight", (vocab, hidden)), w.device)
        if (p + "shared_head_head.weight") in w:
            self.head = QuantLinear(hidden, [vocab], self.method)
            self.head.load([w.source(p + "shared_head_head.weight", (vocab, hidden))], w.device)

    def forward(self, model: HybridModel, h_in: torch.Tensor, cache: KVCache,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """batch's tokens, h_in [T, hidden] (the hidden state each row pairs with) -> (its output hidden
        state [T, hidden], normed, and the logits [len(batch.logits_rows), vocab] f32)."""
        out, logits = self.forward_lane(model, h_in, cache, batch)
        return out, self.gather(model, logits)

    def forward_lane(self, model: HybridModel, h_in: torch.Tensor, cache: KVCache,
                     batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """forward up to this lane's logits (`gather` completes them): what an MTP graph captures."""
        # the model's embedding and head are vocabulary slices under tensor parallelism: its own lookup and
        # gather complete them; the block's own (whole) ones need neither
        e = self.enorm(self.embed(batch.input_ids) if self.embed is not None else model.embed_tokens(batch))
        x = self.eh_proj(torch.cat([e, self.hnorm(h_in.to(e.dtype))], dim=-1))
        h, delta = self.block(x, model.rope, cache, batch)
        out = (self.head_norm if self.head_norm is not None else model.norm)(add_delta(h, delta))
        head = self.head if self.head is not None else model.lm_head
        return out, head(out[batch.logits_rows]).float()

    def gather(self, model: HybridModel, logits: torch.Tensor) -> torch.Tensor:
        """A lane's logits -> the whole vocabulary's (the block's own head is whole already)."""
        return logits if self.head is not None else model.gather_logits(logits)


class HybridModel(LlamaModel):
    def _build_layers(self, shared_split: bool) -> nn.ModuleList:
        hy, layers = self.cfg.hybrid, []
        cache_layer = state_layer = 0
        for i in self.layer_range:
            if i >= hy.trunk:
                continue
            layers.append(HybridLayer(self.cfg, i, self.method, cache_layer, state_layer, shared_split, self.comm))
            cache_layer += not hy.recurrent[i]
            state_layer += hy.recurrent[i]
        # each MTP block's KV cache layer follows the trunk's (allocated only while it drafts: use_mtp)
        self.nextn = nn.ModuleList(NextNHead(self.cfg, i, self.method, shared_split, cache_layer + j, self.comm)
                                   for j, i in enumerate(i for i in self.layer_range if i >= hy.trunk))
        self.mtp = False
        return nn.ModuleList(layers)

    def use_mtp(self) -> None:
        """draft-mtp: the KV cache gets the MTP blocks' layers, and every step keeps its output-normed hidden
        states (`hidden`) for them."""
        if not self.nextn:
            raise ValueError("this model has no MTP block")
        self.mtp = self.keep_hidden = True

    @property
    def n_cache_layers(self) -> int:
        return sum(not layer.linear for layer in self.layers) + (len(self.nextn) if self.mtp else 0)

    @property
    def n_state_layers(self) -> int:
        return sum(layer.linear for layer in self.layers)

    def recurrent_state(self, slots: int, device: torch.device, spare: int = 0, backups: bool = False,
                        snapshots: int = 0) -> RecurrentState:
        return RecurrentState(self.n_state_layers, slots, self.cfg.hybrid.lane(self.comm.tp), device, spare, backups,
                              snapshots)

    def load(self, w: WeightLoader) -> None:
        super().load(w)
        for head in self.nextn:
            head.load(w)
