"""Gated DeltaNet: the linear-attention token mixer of the hybrid models (qwen35, qwen35moe, qwen3next), and
the recurrent state each sequence keeps for it between steps.

    [qkv | z | beta | alpha] = x W_in^T                      one matmul (attn_qkv, attn_gate, ssm_beta/alpha or ssm_ba)
    qkv = silu(causal_conv1d(qkv))                           width K over time, per channel, with the last K - 1
                                                             inputs of the sequence kept in its state slot
    q, k = l2norm(q), l2norm(k);  q /= sqrt(D)               per key head; each value head reads its key head
    beta = sigmoid(beta);  g = ssm_a softplus(alpha + dt)   ssm_a = -exp(A_log) as converted: log decay <= 0
    o = gated_delta_rule(q, k, v, g, beta)                   triton_kernels/delta_rule.py, the state in its slot
    y = (rmsnorm(o) w_norm silu(z)) W_out^T                  per value head; ssm_out

On a CPU each sequence goes through the torch references (triton_kernels/conv1d.py, delta_rule.py) one after
another (the chunked rule for a prompt, the token-by-token one for a decode step); on a GPU, or for a decode
graph's static batch, the kernels take the whole flat batch: the one-step forms when every sequence brings one
token, else the prefill forms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vegaserve.engine.forward_batch import ForwardBatch
from vegaserve.engine.layers.linear import QuantLinear, QuantMethod
from vegaserve.engine.layers.norm import Q8_1
from vegaserve.engine.models.hybrid_config import HybridConfig
from vegaserve.triton_kernels.conv1d import causal_conv1d_ref
from vegaserve.triton_kernels.delta_rule import delta_rule_chunked_ref, delta_rule_recurrent_ref, expand_heads


class RecurrentState:
    """Per linear-attention layer of a rank and per sequence slot, f32: conv [layers, slots, K - 1, conv_dim]
    (the last inputs, oldest first) and ssm [layers, slots, v_heads, D, D] (the delta rule's state, index
    [key, value]). `spare` slots past `slots` belong to no sequence: a decode graph's padded rows use them."""

    def __init__(self, n_layers: int, slots: int, cfg: HybridConfig, device: torch.device, spare: int = 0) -> None:
        n = slots + spare
        self.conv = torch.zeros(n_layers, n, cfg.conv_kernel - 1, cfg.conv_dim, device=device)
        self.ssm = torch.zeros(n_layers, n, cfg.v_heads, cfg.head_dim, cfg.head_dim, device=device)
        self.slots = slots

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() + self.ssm.numel()) * 4


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, cfg: HybridConfig, eps: float, method: QuantMethod, state_layer: int) -> None:
        super().__init__()
        self.cfg, self.eps, self.hidden, self.method = cfg, eps, hidden, method
        self.state_layer = state_layer  # its place in this rank's RecurrentState
        hv = cfg.v_heads
        self.split = [cfg.conv_dim, cfg.value_dim, hv, hv]
        self.in_proj = QuantLinear(hidden, self.split, method)
        self.interleaved_ba = False  # qwen3next: one ssm_ba matrix, [beta, alpha] per key head's value heads
        self.out_proj = QuantLinear(cfg.value_dim, [hidden], method)
        self.conv_w = torch.empty(0)  # [conv_dim, K] f32
        self.ssm_a = torch.empty(0)  # [v_heads] f32, -exp(A_log)
        self.dt_bias = torch.empty(0)
        self.norm_w = torch.empty(0)  # [D]

    def load(self, w, prefix: str) -> None:
        """`w` a models.weights.WeightLoader; prefix "blk.N."."""
        cfg, hidden, hv = self.cfg, self.hidden, self.cfg.v_heads
        mats = [w.source(prefix + "attn_qkv.weight", (cfg.conv_dim, hidden)),
                w.source(prefix + "attn_gate.weight", (cfg.value_dim, hidden))]
        if (prefix + "ssm_ba.weight") in w:
            self.interleaved_ba = True
            self.in_proj = QuantLinear(hidden, [cfg.conv_dim, cfg.value_dim, 2 * hv], self.method)
            mats.append(w.source(prefix + "ssm_ba.weight", (2 * hv, hidden)))
        else:
            mats += [w.source(prefix + f"ssm_{n}.weight", (hv, hidden)) for n in ("beta", "alpha")]
        self.in_proj.load(mats, w.device)
        self.out_proj.load([w.source(prefix + "ssm_out.weight", (hidden, cfg.value_dim))], w.device)
        self.conv_w = w.vector(prefix + "ssm_conv1d.weight", (cfg.conv_dim, cfg.conv_kernel)).contiguous()
        self.ssm_a = w.vector(prefix + "ssm_a", (hv,))
        self.dt_bias = w.vector(prefix + "ssm_dt.bias", (hv,))
        self.norm_w = w.vector(prefix + "ssm_norm.weight", (cfg.head_dim,))

    def wants_q8_1(self, m: int) -> bool:
        return self.in_proj.wants_q8_1(m)

    def forward(self, x: torch.Tensor, xq: Q8_1 | None, state: RecurrentState, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] (the normed input; xq its q8_1 copy where wants_q8_1) -> [T, hidden]."""
        cfg, T, hv = self.cfg, x.shape[0], self.cfg.v_heads
        proj = self.in_proj(x, xq)
        if self.interleaved_ba:
            mixed, z, ba = proj.split([cfg.conv_dim, cfg.value_dim, 2 * hv], dim=-1)
            ba = ba.reshape(T, cfg.k_heads, 2, hv // cfg.k_heads)
            b, a = ba[:, :, 0].reshape(T, hv), ba[:, :, 1].reshape(T, hv)
        else:
            mixed, z, b, a = proj.split(self.split, dim=-1)
        beta = torch.sigmoid(b.float())
        g = self.ssm_a * F.softplus(a.float() + self.dt_bias)
        conv, ssm = state.conv[self.state_layer], state.ssm[self.state_layer]
        if x.is_cuda or not batch.seqs:
            o = self._kernels(mixed.contiguous(), g, beta, conv, ssm, batch)
        else:
            o = torch.empty(T, hv, cfg.head_dim, dtype=torch.float32, device=x.device)
            for s in batch.seqs:
                if s.state_slot < 0:  # -1 would index the last slot: another sequence's state
                    raise ValueError("a hybrid model's step needs every sequence's state slot (StepPlan.state_slots)")
                rows = slice(s.offset, s.offset + s.n)
                keep = s.start > 0
                y, conv[s.state_slot] = causal_conv1d_ref(mixed[rows], self.conv_w, conv[s.state_slot] if keep else None)
                q, k, v = self._qkv(y)
                q, k = (expand_heads(t, hv, cfg.tiled) for t in (q, k))
                rule = delta_rule_recurrent_ref if s.n == 1 else delta_rule_chunked_ref  # decode: no 64-row chunk
                o[rows], ssm[s.state_slot] = rule(q, k, v, g[rows], beta[rows], ssm[s.state_slot] if keep else None)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w
        o = (o * F.silu(z.float().view(T, hv, cfg.head_dim))).to(x.dtype)
        return self.out_proj(o.view(T, cfg.value_dim))

    def _qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [n, conv_dim] -> q, k [n, k_heads, D] (l2-normalized, q scaled by
        1 / sqrt(D)), v [n, v_heads, D], f32."""
        cfg, n = self.cfg, y.shape[0]
        q, k, v = y.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q, k = (t.reshape(n, cfg.k_heads, cfg.head_dim) for t in (q, k))
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + self.eps) * cfg.head_dim ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + self.eps)
        return q, k, v.reshape(n, cfg.v_heads, cfg.head_dim)

    def _kernels(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
        """The whole batch through the Triton kernels (a GPU, or a decode graph's static batch)."""
        from vegaserve.triton_kernels.conv1d import conv1d_prefill, conv1d_update
        from vegaserve.triton_kernels.delta_rule import delta_rule_recurrent
        from vegaserve.triton_kernels.delta_rule_chunked import delta_rule_chunked

        cfg, r = self.cfg, batch.recurrent
        decode = r.max_query_len == 1
        if decode:
            y = conv1d_update(mixed, self.conv_w, conv, r.slots, r.has_state)
        else:
            y = conv1d_prefill(mixed, self.conv_w, conv, r.slots, r.has_state, r.query_start)
        q, k, v = self._qkv(y)
        rule = delta_rule_recurrent if decode else delta_rule_chunked
        return rule(q, k, v, g, beta, ssm, r.slots, r.has_state, r.query_start, cfg.tiled)
