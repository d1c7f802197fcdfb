"""One rank's share of a step: `StageWorker.run(plan)` computes its stage's layers for every micro-batch of
the plan, passing activations down the pipeline and the logits back to rank 0.

    rank 0                      broadcast plan ──> every rank                         (engine/executor.py)
    stage 0 ... stage p-1       for each micro-batch: recv h (or embed), layers, send h (or head)
    last stage, lane 0          logits of each micro-batch ──> rank 0, which samples

Micro-batches: the step's sequences in up to `n_copies` contiguous groups of about equal tokens (default:
as many as there are stages; GGML_SCHED_N_COPIES overrides), so stage s works on group g while stage s + 1
works on group g - 1. Sends are asynchronous; the logits travel on a process group of their own so that
rank 0's receives never queue behind its own sends to stage 1.

On one device the same StageWorker runs every step in the server process (one stage, one micro-batch).
"""

from __future__ import annotations

import numpy as np
import torch

from vegaserve.engine.distributed.communicator import Communicator
from vegaserve.engine.forward_batch import ForwardBatch, HostStaging, MtpPlan, StepPlan
from vegaserve.engine.layers.attention import KVCache
from vegaserve.engine.layers.delta_net import SavedRows
from vegaserve.engine.models.llama import LlamaModel


def micro_batches(plan: StepPlan, n: int) -> list[StepPlan]:
    """Split into at most n contiguous groups of about equal token counts (each non-empty)."""
    n = max(1, min(n, len(plan.seqs)))
    if n == 1:
        return [plan]
    sizes = [len(t) for _, _, t in plan.seqs]
    total = sum(sizes)
    groups: list[StepPlan] = []
    start, acc = 0, 0
    for g in range(1, n):
        end = start + 1
        acc += sizes[start]
        # close group g once it holds g/n of the tokens, leaving a sequence for each group after it
        while end < len(sizes) - (n - g) and acc + sizes[end] <= total * g / n:
            acc += sizes[end]
            end += 1
        groups.append(StepPlan(plan.seqs[start:end], plan.all_logits[start:end], plan.block_size,
                               plan.state_slots[start:end]))
        start = end
    groups.append(StepPlan(plan.seqs[start:], plan.all_logits[start:], plan.block_size, plan.state_slots[start:]))
    return groups


def logits_rows(plan: StepPlan) -> int:
    return sum(len(t) if every else 1 for (_, _, t), every in zip(plan.seqs, plan.all_logits, strict=True))


class StageWorker:
    """The model share and KV cache of one rank (a hybrid model's: its attention layers' KV, and the
    recurrent state of its linear-attention layers for `state_slots` sequences, plus a spare slot where the
    KV cache has spare slots: a decode graph's padded rows)."""

    def __init__(self, model: LlamaModel, comm: Communicator, num_slots: int, device: torch.device,
                 n_copies: int | None = None, kv_dtype: torch.dtype = torch.float32, spare_slots: int = 0,
                 state_slots: int = 0, state_backups: bool = False, state_snapshots: int = 0) -> None:
        self.model = model
        self.comm = comm
        self.device = device
        cfg = model.cfg
        self.cache = KVCache(model.n_cache_layers, num_slots, model.kv_heads, cfg.head_dim, kv_dtype, device, spare_slots)
        self.cache.state = model.recurrent_state(state_slots, device, spare=int(spare_slots > 0), backups=state_backups,
                                                 snapshots=state_snapshots)
        self.graphs = None  # engine/cuda_graphs.py's DecodeGraphs, set by the executor (make_worker)
        self.verify_graphs = None  # the same for speculative decoding's verify steps (R rows a sequence)
        self.mtp_graphs: list = []  # draft-mtp's MTP block steps (cuda_graphs.MtpGraphs): 1 row, then R rows a sequence
        self.saved: SavedRows | None = None  # hybrid models: the last verify step's rows, for a roll back
        self.pending: list[tuple[int, int]] = []  # roll backs this rank owes the next step (a replayed verify step)
        self.staging = HostStaging(device)
        self.mtp_staging = HostStaging(device)  # draft-mtp's steps upload through buffers of their own
        self.n_copies = n_copies or comm.topo.pp
        self.hidden = cfg.hidden_size
        self.vocab = cfg.vocab_size

    @torch.inference_mode()
    def run(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [rows, vocab] f32 on rank 0 (rows as ForwardBatch.logits_rows orders them); None elsewhere.
        input_ids: the new tokens on the device, replacing the plan's (one process, one token a sequence)."""
        state = self.cache.state
        # the last verify step's rows past those kept out of the recurrent state: the rejected guesses (the
        # plan says), a replayed step's padding (this rank knows)
        back = [(slot, m) for slot, m in (*plan.rollback, *self.pending) if m < self.saved.rows_of(slot)]
        self.pending = []
        if back:
            state.roll_back(self.saved, back)
        if plan.restores:  # prefix caching: resumed sequences start from their saved states
            state.restore(plan.restores)
        out = self._forward(plan, input_ids)
        if plan.saves:
            state.save(plan.saves)
        return out

    def _forward(self, plan: StepPlan, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        state = self.cache.state
        if self.graphs is not None and self.graphs.fits(plan.seqs, plan.all_logits):
            out = self.graphs.run(plan.seqs, input_ids, plan.state_slots)
            return out if self.comm.rank == 0 else None
        # (a hybrid model's: only a step with guesses, whose states are backed up and rolled back, since every
        # sequence's state goes through all R rows, padding included)
        # (and not where a state is saved after the step: a replayed step leaves its sequences' padding rows in
        # their states until the next step rolls them back)
        if (self.verify_graphs is not None and input_ids is None and (state is None or plan.snapshot)
                and not plan.saves and self.verify_graphs.fits(plan.seqs, plan.all_logits)):
            if state is not None:  # every sequence goes through R rows: all backed up (a new one's as zeros)
                state.back_up(list(plan.state_slots), [start == 0 for _, start, _ in plan.seqs])
            out = self.verify_graphs.run(plan.seqs, all_logits=plan.all_logits, state_slots=plan.state_slots)
            if state is not None:
                self.saved = self.verify_graphs.saved_rows
                # the others' rows are all kept: back to them before the next step
                self.pending = [(plan.state_slots[i], len(t)) for i, (_, _, t) in enumerate(plan.seqs)
                                if i not in plan.snapshot]
            return out if self.comm.rank == 0 else None
        if plan.snapshot:
            state.back_up([plan.state_slots[i] for i in plan.snapshot])
        comm, model = self.comm, self.model
        # (a step with a snapshot keeps its rows' inputs in one piece: one micro-batch)
        groups = micro_batches(plan, self.n_copies) if comm.topo.pp > 1 and not plan.snapshot else [plan]
        pending = []
        logits: list[torch.Tensor] = []
        for g in groups:
            fb = ForwardBatch.build(self.slots_of(g), g.all_logits, self.device, g.block_size, self.staging,
                                    g.state_slots, g.snapshot)
            if input_ids is not None:
                fb.input_ids = input_ids
            if comm.is_first_stage:
                h = model.embed_tokens(fb)
            else:
                h = comm.recv_prev((fb.input_ids.numel(), self.hidden), torch.float32, self.device)
            h = model.run_layers(h, self.cache, fb)
            if fb.snapshot is not None:
                self.saved = SavedRows.of_layers(fb.snapshot.seqs, fb.saved)
            if not comm.is_last_stage:
                pending.append(comm.send_next(h))
                continue
            out = model.head(h, fb)
            if comm.rank == 0:
                logits.append(out)
            elif comm.lane == 0:
                pending.append(comm.send_to_rank0(out))
        if comm.rank == 0 and not comm.is_last_stage:
            logits = [comm.recv_from_last((logits_rows(g), self.vocab), torch.float32, self.device) for g in groups]
        for p in pending:
            p.wait()
        if comm.rank != 0:
            return None
        return logits[0] if len(logits) == 1 else torch.cat(logits)


    @torch.inference_mode()
    def run_mtp(self, plan: MtpPlan, h_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's MTP block over plan (every rank of a tensor-parallel group alike): (its output hidden
        states [rows, hidden], the logits of each sequence's last row, the whole vocabulary)."""
        step = plan.step
        for graphs in self.mtp_graphs:
            if graphs.fits(step.seqs, step.all_logits):
                return graphs.run_block(step.seqs, h_in)
        fb = ForwardBatch.build(self.slots_of(step), step.all_logits, self.device, step.block_size, self.mtp_staging)
        return self.model.nextn[0](self.model, h_in, self.cache, fb)

    def slots_of(self, plan: StepPlan) -> list[tuple[np.ndarray, int, list[int]]]:
        """(slots of positions 0 .. start + n - 1, start, tokens): the slots expanded from the block ids on
        this rank (the plan carries one id per block, not one slot per token)."""
        bs = plan.block_size
        offsets = np.arange(bs, dtype=np.int64)
        out = []
        for blocks, start, tokens in plan.seqs:
            slots = (np.asarray(blocks, dtype=np.int64)[:, None] * bs + offsets).reshape(-1)
            out.append((slots[: start + len(tokens)], start, tokens))
        return out
