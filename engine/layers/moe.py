"""Mixture-of-experts feed-forward: a router picks k of E experts for each token, each expert a gated MLP,
the token's output their weighted sum; beside them, optionally, a shared expert scaled by a sigmoid gate
(the qwen2moe layout that qwen35moe and DeepSeek use too).

    logits = x W_r^T (+ b_r)                                              f32, [T, E]
    softmax gating:       p = softmax(logits), (w, ids) = top-k(p), w /= sum(w) where norm_topk
    topk_softmax gating:  (l, ids) = top-k(logits), w = softmax(l)                         (gpt-oss)
    y = sum_j w_j down_e(act(gate_e(x), up_e(x)))                         e = ids_j, [T, H]
    y += sigmoid(x . w_s) down_s(silu(gate_s(x)) up_s(x))                 shared expert
One token's k experts are k assignments, a = t * k + j: gate/up read x[a // k], down reads row a of the
activation, and the k rows of a token are summed with their weights. The expert matrices are ExpertLinear
layers; how they are stored and multiplied is the quant method's (engine/layers/linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vegaserve.engine.layers.linear import QuantLinear, QuantMethod, WeightSource, check_shape
from vegaserve.engine.models.arch_config import MoEConfig
from vegaserve.triton_kernels import moe_ops


class ExpertLinear(nn.Module):
    """E matrices [N, K] (the GGUF 3-D tensors [E, rows, K] of `load`, stacked along the rows: gate and up),
    y[a] = W[ids[a]] x[a // x_div] (+ b[ids[a]])."""

    def __init__(self, n_experts: int, in_features: int, output_sizes: list[int], method: QuantMethod) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.method = method
        self.weight: nn.Parameter | None = None  # ReferenceMethod: [E, N, K]
        self.packed: list = []  # TritonMethod: one stack of E experts per type (layout.stack_experts)
        self.tuned: list = []  # and the decode kernels of each (matvec.ExpertChoices)
        self.bias: torch.Tensor | None = None  # [E, N] f32
        self.device = torch.device("cpu")

    def load(self, sources: list[WeightSource], device: torch.device, biases: list[torch.Tensor] | None = None) -> None:
        self.device = device
        for src, rows in zip(sources, self.output_sizes, strict=True):
            check_shape(src, (self.n_experts, rows, self.in_features))
        self.method.create_experts(self, sources)
        if biases is not None:
            self.bias = torch.cat([b.float() for b in biases], dim=1).to(device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, x_div: int, tokens: int, add_bias: bool = True,
                q8_1=None, sorts: dict | None = None) -> torch.Tensor:
        """x [R, K], ids [A] (the expert of each assignment, int64), x_div: assignments a row of x serves,
        tokens: the step's tokens (which path the quant method takes) -> [A, N] f32; q8_1: x's q8_1 copy
        where wants_q8_1; add_bias False: the caller adds the experts' biases itself; sorts: a memo shared by
        the calls on one step's `ids` (the assignments sorted by expert once, moe.sorted_runs)."""
        y = self.method.apply_experts(self, x, ids, x_div, tokens, q8_1, sorts)
        return y if self.bias is None or not add_bias else y + self.bias[ids]

    def wants_q8_1(self, tokens: int) -> bool:
        """Whether forward for a step of `tokens` takes x's q8_1 copy (the op before may write it)."""
        return self.method.experts_want_q8_1(self, tokens)


def route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (f32) -> (weights [T, k] f32, expert ids [T, k] int64)."""
    if cfg.gating == "topk_softmax":
        top, ids = torch.topk(logits, cfg.used, dim=-1)
        return torch.softmax(top, dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), cfg.used, dim=-1)
    if cfg.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_act(gate_up: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """[A, 2F] (gate rows, then up rows) -> [A, F]."""
    g, u = gate_up.chunk(2, dim=-1)
    if cfg.act == "swiglu_oai":
        g = g.clamp(max=cfg.limit)
        return g * torch.sigmoid(cfg.alpha * g) * (u.clamp(-cfg.limit, cfg.limit) + 1.0)
    return F.silu(g) * u


class MoE(nn.Module):
    """The feed-forward of one layer: router, E experts, and the shared expert where cfg.shared_ff.

    Under tensor parallelism (tp lanes) every lane routes alike (the router is whole on each) and holds a
    slice of every expert's intermediate size: down by input columns in whole blocks (sharding.block_split: a
    lane may hold a block more than its neighbour), gate and up by the same range of rows, so each lane's
    output is a partial sum that the layer's one AllReduce completes. The shared expert is split
    the same way (shared_split), its partial folded into that AllReduce, or held whole by every lane and
    added by lane 0 alone. Expert biases: gate and up sliced, down's added by lane 0.

    A shared expert of the experts' size and tensor types on a lane joins their stacks as expert E
    (`joined`): every token's choice k + 1, weighted by its gate, through the experts' own launches."""

    def __init__(self, hidden: int, cfg: MoEConfig, method: QuantMethod, tp: int = 1, lane: int = 0,
                 shared_split: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden = hidden
        self.tp, self.lane = tp, lane
        self.method = method
        self.shared_tp = tp if shared_split else 1
        self.router = torch.empty(0)  # [E, H] f32, and the shared expert's gate as one more row where there is one
        self.router_tickets = torch.empty(0)  # the fused router launch's (moe_ops.router_counters)
        self.router_bias: torch.Tensor | None = None
        self.joined = False  # the shared expert is expert E of the stacks (load says where it can be)
        # the even shares until load reads the down projections' blocks
        self._experts(cfg.expert_ff // tp)
        self._shared(cfg.shared_ff // self.shared_tp)
        # lane 0 alone adds what is not split: the down bias, and a shared expert held whole
        self.shared_scale = 1.0 if shared_split or lane == 0 else 0.0

    def _experts(self, ff: int, stacked: int = 0) -> None:
        """The expert stacks at `ff` rows a lane: the routed experts, and the shared one where it joins them."""
        self.ff = ff
        n = stacked or self.cfg.experts
        self.gate_up = ExpertLinear(n, self.hidden, [ff] * 2, self.method)
        self.down = ExpertLinear(n, ff, [self.hidden], self.method)

    def _shared(self, ff: int) -> None:
        self.shared_ff = ff
        self.shared_gate_up = QuantLinear(self.hidden, [ff] * 2, self.method) if self.cfg.shared_ff else None
        self.shared_down = QuantLinear(ff, [self.hidden], self.method) if self.cfg.shared_ff else None

    def load(self, w, prefix: str) -> None:
        """`w` a models.weights.WeightLoader; prefix "blk.N."."""
        from vegaserve.engine.distributed.sharding import (
            append_expert, lane_block_split, slice_cols, slice_expert_cols, slice_expert_rows, slice_rows,
        )

        cfg, hidden, e, f = self.cfg, self.hidden, self.cfg.experts, self.cfg.expert_ff
        self.router = w.vector(prefix + "ffn_gate_inp.weight", (e, hidden)).float().contiguous()
        self.router_tickets = moe_ops.router_counters(self.router.device)
        bias = cfg.biases
        if bias:
            self.router_bias = w.vector(prefix + "ffn_gate_inp.bias", (e,))
        down = w.source(prefix + "ffn_down_exps.weight", (e, hidden, f))
        rows = lane_block_split(down, self.tp, self.lane)  # this lane's rows of every expert: whole blocks of down
        gate_up = [slice_expert_rows(w.source(prefix + f"ffn_{n}_exps.weight", (e, f, hidden)), *rows)
                   for n in ("gate", "up")]
        down = slice_expert_cols(down, *rows)
        if cfg.shared_ff:
            s, lane = cfg.shared_ff, self.lane if self.shared_tp > 1 else 0
            shared_down = w.source(prefix + "ffn_down_shexp.weight", (hidden, s))
            srows = lane_block_split(shared_down, self.shared_tp, lane)
            shared_gate_up = [slice_rows(w.source(prefix + f"ffn_{n}_shexp.weight", (s, hidden)), *srows)
                              for n in ("gate", "up")]
            shared_down = slice_cols(shared_down, *srows)
            # the shared expert runs as expert E of the stacks where it is one: the experts' shape and types
            # on this lane, added by every lane (so not LLAMA_SHEXP_SPLIT=0 under tensor parallelism)
            parts = list(zip([*gate_up, down], [*shared_gate_up, shared_down], strict=True))
            self.joined = (not bias and self.shared_tp == self.tp and srows[1] == rows[1] and
                           all(a.info.type_id == b.info.type_id for a, b in parts))
            if self.joined:
                gate_up, down = [append_expert(a, b) for a, b in parts[:2]], append_expert(*parts[2])
                self.shared_gate_up = self.shared_down = None
            else:
                if srows[1] != self.shared_ff:
                    self._shared(srows[1])
                self.shared_gate_up.load(shared_gate_up, w.device)
                self.shared_down.load([shared_down], w.device)
            name = prefix + "ffn_gate_inp_shexp.weight"  # [1, H] as converted, [H] once llama-quantize wrote it
            shape = (1, hidden) if w.gguf.info(name).shape == (1, hidden) else (hidden,)
            # the router's last row: its logit comes out of the router's launch (moe_ops.router)
            gate = w.vector(name, shape).reshape(1, hidden).to(self.router)
            self.router = torch.cat([self.router, gate]).contiguous()
            if self.router_bias is not None:
                self.router_bias = torch.cat([self.router_bias, self.router_bias.new_zeros(1)])
        if rows[1] != self.ff or self.joined:
            self._experts(rows[1], e + self.joined)
        self.gate_up.load(gate_up, w.device,
                          [w.vector(prefix + f"ffn_{n}_exps.bias", (e, f))[:, rows[0] : sum(rows)] for n in ("gate", "up")]
                          if bias else None)
        down_bias = None
        if bias:
            down_bias = [w.vector(prefix + "ffn_down_exps.bias", (e, hidden)) * (1.0 if self.lane == 0 else 0.0)]
        self.down.load([down], w.device, down_bias)

    def wants_q8_1(self, m: int) -> bool:
        return self.gate_up.wants_q8_1(m)

    def forward(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        """x [T, H] (the normed input; xq its q8_1 copy where wants_q8_1) -> [T, H], this lane's partial sum
        under tensor parallelism."""
        if x.is_cuda:
            return moe_ops.combine(*self._forward_kernels(x, xq))
        T, E = x.shape[0], self.cfg.experts
        logits = F.linear(x.float(), self.router, self.router_bias)
        weights, ids = route(logits[:, :E], self.cfg)
        if self.joined:  # the shared expert: expert E of every token, weighted by its gate
            weights, ids = moe_ops.with_shared_expert(weights, ids, logits[:, E:], E)
        k, a = ids.shape[1], ids.reshape(-1)
        h = expert_act(self.gate_up(x, a, k, T), self.cfg)
        y = self.down(h, a, 1, T).view(T, k, self.hidden)
        out = (y * weights[..., None]).sum(dim=1)
        if self.shared_gate_up is not None and self.shared_scale:
            shared = self.shared_down(expert_act(self.shared_gate_up(x), self.cfg))
            out = out + torch.sigmoid(logits[:, E])[:, None] * shared
        return out

    def delta(self, x: torch.Tensor, xq=None) -> torch.Tensor | moe_ops.ExpertSum:
        """forward as a decoder layer on one lane hands it on (no AllReduce after it): on a GPU the experts'
        outputs not yet summed, which the next residual add's norm sums in its own launch."""
        return self._forward_kernels(x, xq) if x.is_cuda else self.forward(x, xq)

    def _forward_kernels(self, x: torch.Tensor, xq) -> moe_ops.ExpertSum:
        """forward on a GPU up to the weighted sum: the router (its logits and the shared expert's gate too,
        for a decode step's rows) and the experts' activation one launch each (triton_kernels/moe_ops.py),
        the activation writing the down projection's q8_1 input. A shared expert that joined the stacks is
        one more assignment of every token, chosen by the router's launch with its gate as its weight."""
        from vegaserve.engine.layers.norm import silu_mul_q8_1

        cfg, T = self.cfg, x.shape[0]
        has_shared = self.shared_gate_up is not None
        gate = moe_ops.GATE_EXPERT if self.joined else moe_ops.GATE_LOGIT if has_shared else 0
        weights, ids, *logit = moe_ops.router(x, self.router, self.router_bias, cfg.used, cfg.gating == "softmax",
                                              cfg.norm_topk, self.router_tickets, shared_gate=gate)
        k, a = ids.shape[1], ids.reshape(-1)
        sorts: dict = {}  # gate/up's and down's grouped launches sort the assignments once
        gate_up = self.gate_up(x, a, k, T, add_bias=False, q8_1=xq, sorts=sorts)
        want = self.down.wants_q8_1(T)
        h = moe_ops.expert_act(gate_up, cfg.act == "swiglu_oai", cfg.alpha, cfg.limit, self.gate_up.bias, a, want)
        h, hq = h if want else (h, None)
        y = self.down(h, a, 1, T, add_bias=False, q8_1=hq, sorts=sorts)
        if not (has_shared and self.shared_scale):
            return moe_ops.ExpertSum(y, weights, ids, self.down.bias)
        shared = self.shared_down(*silu_mul_q8_1(self.shared_gate_up(x), self.shared_down.wants_q8_1(T)))
        return moe_ops.ExpertSum(y, weights, ids, self.down.bias, shared, logit[0])
