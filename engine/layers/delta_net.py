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
graph's static batch, the kernels take the whole flat batch: the convolution's one-step form when every
sequence brings one token, else its prefill form; the delta rule token by token for decode and verify
steps, in chunks of 64 tokens for a step with prompts. The normalizations and gates around the rule are one
launch before it and one after it (triton_kernels/delta_io.py), whose torch references are the CPU path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vegaserve.engine.forward_batch import ForwardBatch, HostStaging
from vegaserve.engine.layers.linear import QuantLinear, QuantMethod
from vegaserve.engine.layers.norm import Q8_1
from vegaserve.engine.models.hybrid_config import HybridConfig
from vegaserve.triton_kernels import delta_io
from vegaserve.triton_kernels.conv1d import causal_conv1d_ref
from vegaserve.triton_kernels.delta_rule import delta_rule_chunked_ref, delta_rule_recurrent_ref, expand_heads



class RecurrentState:
    """Per linear-attention layer of a rank and per sequence slot, f32: conv [layers, slots, K - 1, conv_dim]
    (the last inputs, oldest first) and ssm [layers, slots, v_heads, D, D] (the delta rule's state, index
    [key, value]). With `backups` (speculative decoding), slot s + slots holds slot s's state from before
    its last verify step (`back_up`). Then come `snapshots`, the states prefix caching saved (snapshot j at
    `snapshot_slot(j)`: engine/state_pool.py). `spare` slots past those belong to no sequence: a decode
    graph's padded rows use them (the first is `spare_slot`)."""

    def __init__(self, n_layers: int, slots: int, cfg: HybridConfig, device: torch.device, spare: int = 0,
                 backups: bool = False, snapshots: int = 0) -> None:
        n = slots * (1 + backups) + snapshots + spare
        self.conv = torch.zeros(n_layers, n, cfg.conv_kernel - 1, cfg.conv_dim, device=device)
        self.ssm = torch.zeros(n_layers, n, cfg.v_heads, cfg.head_dim, cfg.head_dim, device=device)
        self.slots = slots
        self.backups = backups
        self.snapshots = snapshots
        self.tiled = cfg.tiled
        # back_up's (and restore's and save's) and roll_back's slot and row numbers, each call's in one copy that
        # does not wait on the GPU
        self._staging = (HostStaging(device), HostStaging(device))

    @property
    def spare_slot(self) -> int:
        return self.snapshot_slot(self.snapshots)

    def snapshot_slot(self, j: int) -> int:
        return self.slots * (1 + self.backups) + j

    def restore(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Each (snapshot, slot): the snapshot's state, every layer's, into the sequence slot."""
        self._copy([(self.snapshot_slot(j), s) for j, s in pairs])

    def save(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Each (slot, snapshot): the sequence slot's state, every layer's, into the snapshot."""
        self._copy([(s, self.snapshot_slot(j)) for s, j in pairs])

    def _copy(self, moves: list[tuple[int, int]]) -> None:
        if any(not 0 <= i < self.spare_slot for m in moves for i in m):
            raise ValueError(f"state copies {moves} reach past the {self.spare_slot} slots and snapshots")
        src, dst = self._staging[0].upload([[a for a, _ in moves], [b for _, b in moves]])
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() + self.ssm.numel()) * 4

    def back_up(self, slots: list[int], fresh: list[bool] | None = None) -> None:
        """Every layer's state of `slots` into their backups (before a verify step); a `fresh` one (a
        sequence at its first token: no state before it) backs up zeros, whatever its slot holds."""
        if not self.backups:
            raise ValueError("this recurrent state keeps no backups (speculative decoding is off)")
        zeros = [s + self.slots for s, f in zip(slots, fresh or [False] * len(slots), strict=True) if f]
        own, backup, zero = self._staging[0].upload([slots, np.asarray(slots) + self.slots, zeros])
        self.conv[:, backup] = self.conv[:, own]
        self.ssm[:, backup] = self.ssm[:, own]
        if zeros:
            self.conv[:, zero] = 0.0
            self.ssm[:, zero] = 0.0

    def roll_back(self, saved: SavedRows, keep: list[tuple[int, int]], kernel: bool | None = None) -> None:
        """After a verify step that computed rows past those kept (rejected guesses, a replayed step's
        padding): each (slot, m) of `keep` goes back to its backup advanced by its first m rows of that
        step, from the rows' inputs `saved` kept (every layer at once): the conv rows are the last K - 1 of
        [backup rows; the m rows' inputs], the delta rule's state the recurrence over the m rows from the
        backup's (as a decode step computes it).
        kernel: through delta_rule_recurrent (None: on a GPU), else the torch reference."""
        slots = [s for s, _ in keep]
        where = {slot: (at, n) for slot, at, n in saved.seqs}
        if any(s not in where or not 0 < m <= where[s][1] for s, m in keep):
            raise ValueError(f"roll back {keep}: the last verify step kept rows of {saved.seqs}")
        L, K1 = self.conv.shape[0], self.conv.shape[2]
        dev = self.conv.device
        # the conv rows: index into [backups of the slots (K - 1 rows each); the saved rows], per layer
        idx = []
        for i, (s, m) in enumerate(keep):
            at = where[s][0]
            ext = [i * K1 + j for j in range(K1)] + [len(keep) * K1 + at + r for r in range(m)]
            idx.extend(ext[len(ext) - K1 :])
        kept = [where[s][0] + r for s, m in keep for r in range(m)]
        # the kernel's flat batch: every (layer, sequence) a sequence over the layers' stacked states
        lens = np.tile([m for _, m in keep], L)
        lanes = (np.arange(L)[:, None] * self.ssm.shape[1] + np.asarray(slots)[None, :]).reshape(-1)
        own, backup, idx, rows, lanes, qstart = self._staging[1].upload(
            [slots, np.asarray(slots) + self.slots, idx, kept, lanes, np.concatenate([[0], np.cumsum(lens)])])
        src = torch.cat([self.conv[:, backup].reshape(L, -1, self.conv.shape[3]), saved.mixed.float()], dim=1)
        self.conv[:, own] = src[:, idx].view(L, len(keep), K1, -1)
        self.ssm[:, own] = self.ssm[:, backup]
        k, v, g, beta = (t[:, rows] for t in (saved.k, saved.v, saved.g, saved.beta))  # [L, rows, ...]
        if kernel if kernel is not None else dev.type == "cuda":
            from vegaserve.triton_kernels.delta_rule import delta_rule_recurrent

            flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
            lanes = lanes.to(torch.int32)
            delta_rule_recurrent(flat(k), flat(k), flat(v), flat(g), flat(beta), self.ssm.view(-1, *self.ssm.shape[2:]),
                                 lanes, torch.ones_like(lanes), qstart.to(torch.int32), self.tiled)
            return
        at = 0
        for s, m in keep:
            for layer in range(L):
                kl = expand_heads(k[layer, at : at + m], v.shape[2], self.tiled)
                _, self.ssm[layer, s] = delta_rule_recurrent_ref(kl, kl, v[layer, at : at + m], g[layer, at : at + m],
                                                                 beta[layer, at : at + m], self.ssm[layer, s])
            at += m


@dataclass
class SavedRows:
    """A verify step's rows of the sequences it snapshotted, every linear-attention layer's inputs to the
    state (stacked over layers): mixed [L, rows, conv_dim] (the conv's input), k [L, rows, HK, D]
    (normalized), v [L, rows, HV, D], g, beta [L, rows, HV]; seqs: (slot, first row, rows) of each."""

    seqs: list[tuple[int, int, int]]
    mixed: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def of_layers(cls, seqs: list[tuple[int, int, int]], saved: dict[int, tuple[torch.Tensor, ...]]) -> SavedRows:
        """From ForwardBatch.saved: each state layer's (mixed, k, v, g, beta), stacked in layer order."""
        layers = [saved[i] for i in sorted(saved)]
        return cls(seqs, *(torch.stack(parts) for parts in zip(*layers, strict=True)))

    def rows_of(self, slot: int) -> int:
        """How many rows the step advanced the slot's state by."""
        return next(n for s, _, n in self.seqs if s == slot)


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism (tp lanes) a lane holds its share of the key heads and the value heads that
    read them (HybridConfig.lane_heads): their rows of the input projections and the convolution, their
    decay and dt entries, their columns of ssm_out; its output is a partial sum the layer's AllReduce adds."""

    def __init__(self, hidden: int, cfg: HybridConfig, eps: float, method: QuantMethod, state_layer: int,
                 tp: int = 1, lane: int = 0) -> None:
        super().__init__()
        self.full = cfg  # the whole model's heads (the GGUF's shapes)
        self.keys, self.values = cfg.lane_heads(tp, lane)
        cfg = cfg.lane(tp)
        self.cfg, self.eps, self.hidden, self.method = cfg, eps, hidden, method
        self.state_layer = state_layer  # its place in this rank's RecurrentState
        hv = cfg.v_heads
        self.in_proj = QuantLinear(hidden, [cfg.conv_dim, cfg.value_dim, hv, hv], method)
        self.interleaved_ba = False  # qwen3next: one ssm_ba matrix, [beta, alpha] per key head's value heads
        self.gate_cols = self._gate_columns()
        self.out_proj = QuantLinear(cfg.value_dim, [hidden], method)
        self.conv_w = torch.empty(0)  # [conv_dim, K] f32
        self.ssm_a = torch.empty(0)  # [v_heads] f32, -exp(A_log)
        self.dt_bias = torch.empty(0)
        self.norm_w = torch.empty(0)  # [D]

    def load(self, w, prefix: str) -> None:
        """`w` a models.weights.WeightLoader; prefix "blk.N."."""
        from vegaserve.engine.distributed.sharding import gather_cols, gather_rows, head_ranges

        full, cfg, hidden, hv = self.full, self.cfg, self.hidden, self.cfg.v_heads
        D, keys, values = full.head_dim, self.keys, self.values
        # the lane's channels of q | k | v (the projection's rows and the convolution's channels alike)
        channels = (head_ranges(keys, D) + head_ranges(keys, D, full.key_dim)
                    + head_ranges(values, D, 2 * full.key_dim))
        mats = [gather_rows(w.source(prefix + "attn_qkv.weight", (full.conv_dim, hidden)), channels),
                gather_rows(w.source(prefix + "attn_gate.weight", (full.value_dim, hidden)), head_ranges(values, D))]
        if (prefix + "ssm_ba.weight") in w:  # [beta, alpha] for each key head's value heads, key head by key head
            self.interleaved_ba = True
            self.in_proj = QuantLinear(hidden, [cfg.conv_dim, cfg.value_dim, 2 * hv], self.method)
            r = full.v_heads // full.k_heads
            ba = w.source(prefix + "ssm_ba.weight", (2 * full.v_heads, hidden))
            mats.append(gather_rows(ba, head_ranges(keys, 2 * r)))
        else:
            mats += [gather_rows(w.source(prefix + f"ssm_{n}.weight", (full.v_heads, hidden)), head_ranges(values, 1))
                     for n in ("beta", "alpha")]
        self.in_proj.load(mats, w.device)
        self.out_proj.load([gather_cols(w.source(prefix + "ssm_out.weight", (hidden, full.value_dim)),
                                        head_ranges(values, D))], w.device)
        rows = torch.cat([torch.arange(a, a + n) for a, n in channels])
        conv_w = w.vector(prefix + "ssm_conv1d.weight", (full.conv_dim, cfg.conv_kernel))
        self.conv_w = conv_w[rows.to(w.device)].contiguous()
        picked = torch.tensor(values, device=w.device)
        self.ssm_a = w.vector(prefix + "ssm_a", (full.v_heads,))[picked]
        self.dt_bias = w.vector(prefix + "ssm_dt.bias", (full.v_heads,))[picked]
        self.norm_w = w.vector(prefix + "ssm_norm.weight", (cfg.head_dim,))
        self.gate_cols = self._gate_columns().to(w.device)

    def _gate_columns(self) -> torch.Tensor:
        """[2, HV] int32: the in-projection's output column of each value head's beta, then of its alpha."""
        cfg, hv = self.cfg, self.cfg.v_heads
        base, h = cfg.conv_dim + cfg.value_dim, torch.arange(hv)
        if self.interleaved_ba:  # [beta x r, alpha x r] for each key head's r value heads
            r = hv // cfg.k_heads
            b = base + h // r * 2 * r + h % r
            return torch.stack([b, b + r]).to(torch.int32)
        return torch.stack([base + h, base + hv + h]).to(torch.int32)

    def wants_q8_1(self, m: int) -> bool:
        return self.in_proj.wants_q8_1(m)

    @staticmethod
    def on_kernels(x: torch.Tensor, batch: ForwardBatch) -> bool:
        """Whether a step runs the Triton kernels: on a GPU, or a decode graph's static batch (no sequence list)."""
        return x.is_cuda or not batch.seqs

    def forward(self, x: torch.Tensor, xq: Q8_1 | None, state: RecurrentState, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] (the normed input; xq its q8_1 copy where wants_q8_1) -> [T, hidden]."""
        cfg, T, hv, D = self.cfg, x.shape[0], self.cfg.v_heads, self.cfg.head_dim
        proj = self.in_proj(x, xq)
        mixed, z = proj[:, : cfg.conv_dim], proj[:, cfg.conv_dim : cfg.conv_dim + cfg.value_dim]
        conv, ssm = state.conv[self.state_layer], state.ssm[self.state_layer]
        snap = batch.snapshot
        if self.on_kernels(x, batch):
            o, k, v, g, beta = self._kernels(mixed, proj, conv, ssm, batch)
            out, oq = delta_io.output(o, z, self.norm_w, self.eps, x.dtype, self.out_proj.wants_q8_1(T))
        else:
            gates = proj[:, self.gate_cols]  # [T, 2, HV]: each value head's beta and alpha
            y = torch.empty_like(mixed)
            for s in batch.seqs:
                if s.state_slot < 0:  # -1 would index the last slot: another sequence's state
                    raise ValueError("a hybrid model's step needs every sequence's state slot (StepPlan.state_slots)")
                rows = slice(s.offset, s.offset + s.n)
                y[rows], conv[s.state_slot] = causal_conv1d_ref(mixed[rows], self.conv_w,
                                                                conv[s.state_slot] if s.start > 0 else None)
            q, k, g, beta = delta_io.reference_inputs(y, gates[:, 0], gates[:, 1], self.ssm_a, self.dt_bias,
                                                      cfg.k_heads, D, self.eps)
            v = y[:, 2 * cfg.key_dim :].float().reshape(T, hv, D)
            o = torch.empty(T, hv, D, dtype=torch.float32, device=x.device)
            verifying = {slot for slot, _, _ in snap.seqs} if snap is not None else set()
            for s in batch.seqs:
                rows = slice(s.offset, s.offset + s.n)
                qs, ks = (expand_heads(t[rows], hv, cfg.tiled) for t in (q, k))
                # decode, and a verify step's rows (as decode computes them): token by token; prompts in chunks
                one_by_one = s.n == 1 or s.state_slot in verifying
                rule = delta_rule_recurrent_ref if one_by_one else delta_rule_chunked_ref
                o[rows], ssm[s.state_slot] = rule(qs, ks, v[rows], g[rows], beta[rows],
                                                  ssm[s.state_slot] if s.start > 0 else None)
            out, oq = delta_io.reference_output(o, z, self.norm_w, self.eps).to(x.dtype), None
        if snap is not None:  # the snapshotted rows' inputs to the state, for a roll back after verification
            batch.saved[self.state_layer] = tuple(t[snap.rows] for t in (mixed, k, v, g, beta))
        return self.out_proj(out, oq)

    def _kernels(self, mixed: torch.Tensor, proj: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                 batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """The whole batch through the Triton kernels (a GPU, or a decode graph's static batch): (o, and the
        rows' k, v, g and beta, which a snapshot keeps)."""
        from vegaserve.triton_kernels.conv1d import conv1d_prefill, conv1d_update
        from vegaserve.triton_kernels.delta_rule import delta_rule_chunked, delta_rule_recurrent

        cfg, r = self.cfg, batch.recurrent
        decode = r.max_query_len == 1
        if decode:
            y = conv1d_update(mixed, self.conv_w, conv, r.slots, r.has_state)
        else:
            y = conv1d_prefill(mixed, self.conv_w, conv, r.slots, r.has_state, r.query_start)
        q, k, g, beta = delta_io.inputs(y, proj, self.gate_cols, self.ssm_a, self.dt_bias, cfg.k_heads, cfg.head_dim,
                                        self.eps)
        v = y[:, 2 * cfg.key_dim :].view(y.shape[0], cfg.v_heads, cfg.head_dim)
        if decode or batch.snapshot is not None:  # a verify step's rows as decode computes them: token by token
            o = delta_rule_recurrent(q, k, v, g, beta, ssm, r.slots, r.has_state, r.query_start, cfg.tiled)
        else:
            o = delta_rule_chunked(q, k, v, g, beta, ssm, r.slots, r.has_state, r.query_start, r.max_query_len,
                                   cfg.tiled)
        return o, k, v, g, beta
