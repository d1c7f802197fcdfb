"""Decode steps replayed from CUDA / HIP graphs: one graph per batch-size bucket, captured at start-up.

A decode step (every sequence brings one token) launches a few hundred small kernels; eager, the CPU's
launch rate bounds it. Captured once per bucket (1, 2, 4, ... 256 sequences, up to max_num_seqs rounded
up), a step is one host-to-device copy and one replay:

    host     the plan -> one pinned int32 staging buffer (token ids, positions, new slots, key counts,
             block tables), allocated once at the largest bucket
    device   copy_ into the device staging buffer, then replay: the graph itself widens the ids, positions
             and slots to int64 into the static inputs the model reads, and runs the model to the logits

The graph's tensors keep their addresses between replays, so everything it reads is a static buffer
filled before the replay, and everything it allocates comes from one memory pool shared by the buckets.
A batch smaller than its bucket is padded: padded rows read token 0 at position 0 with one key, and write
their k/v to the cache's spare block, which no sequence owns (KVCache spare slots). A hybrid model's step also
stages each row's recurrent-state slot (padded rows: the state's spare slot); a row with one key (a
sequence's first token) starts from a zero state, as ForwardBatch.recurrent says. The attention grid is
sized for max_model_len at capture, so one graph serves every context length (partitions past a
sequence's end do no work).

Without a GPU (tests) nothing is captured and `run` computes the same static, padded batch eagerly.
Single-process only: with several ranks the step crosses collectives and point-to-point transfers that
run eagerly (docs/ARCHITECTURE.md). GGML_META_TOKEN_GRAPH=0 turns graphs off.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from vegaserve.engine.forward_batch import AttentionInputs, ForwardBatch, RecurrentInputs
from vegaserve.engine.layers.attention import KVCache
from vegaserve.engine.models.llama import LlamaModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_seqs: int) -> tuple[int, ...]:
    """The buckets up to the first one holding max_seqs sequences (at most 256)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_seqs:
            break
    return tuple(out)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, cache: KVCache, max_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        if cache.k.shape[1] < cache.num_slots + block_size:
            raise ValueError("decode graphs need a spare KV block past the pool's slots")
        self.model, self.cache, self.device = model, cache, device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = buckets_for(max_seqs)
        B = self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.spare_block = cache.num_slots // block_size
        state = cache.state
        if state is not None and state.conv.shape[1] <= state.slots:
            raise ValueError("decode graphs need a spare recurrent-state slot past the pool's")
        self.spare_state = state.slots if state is not None else -1
        # staging layout, int32: ids [B] | positions [B] | new slots [B] | key counts [B] | (hybrid models:
        # state slots [B]) | tables [B, blocks]
        self.n_vec = 4 + (state is not None)
        self.n_staged = self.n_vec * B + B * self.max_blocks
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(self.n_staged, dtype=torch.int32, pin_memory=on_gpu)
        self.host_np = self.host.numpy()
        self.staged = torch.zeros(self.n_staged, dtype=torch.int32, device=device)
        self.ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)
        self.new_slots = torch.zeros(B, dtype=torch.int64, device=device)
        self.query_start = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(B, dtype=torch.int64, device=device)
        self.has_state = torch.zeros(B, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if on_gpu else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pad(B)
        self.staged.copy_(self.host)

    # ------------------------------------------------------------------------------------------ views

    def _host_views(self, b: int):
        """numpy views of the pinned staging (numpy: element writes from Python cost ~100 ns, not ~5 us)."""
        B, v = self.max_batch, self.n_vec
        h = self.host_np
        return (h[:b], h[B : B + b], h[2 * B : 2 * B + b], h[3 * B : 3 * B + b], h[4 * B : 4 * B + b],
                h[v * B :].reshape(B, self.max_blocks)[:b])

    def _batch(self, b: int) -> ForwardBatch:
        """The static batch of bucket b: views of the device buffers the graph reads."""
        B = self.max_batch
        tables = self.staged[self.n_vec * B :].view(B, self.max_blocks)
        fb = ForwardBatch(self.ids[:b], self.positions[:b], [], self.rows[:b], self.block_size)
        if self.spare_state >= 0:
            fb.__dict__["recurrent"] = RecurrentInputs(  # the cached_property, set to the static tensors
                slots=self.staged[4 * B : 4 * B + b], has_state=self.has_state[:b], query_start=self.query_start[: b + 1],
                max_query_len=1)
        fb.__dict__["attention"] = AttentionInputs(  # the cached_property, set to the static tensors
            block_tables=tables[:b], seq_lens=self.staged[3 * B : 3 * B + b], query_start=self.query_start[: b + 1],
            new_slots=self.new_slots[:b], page_size=self.block_size, max_seq_len=self.max_model_len,
            max_query_len=1,
        )
        return fb

    def _widen(self, b: int) -> None:
        """Inside the graph: the int32 staging into the int64 inputs."""
        B = self.max_batch
        self.ids[:b].copy_(self.staged[:b])
        self.positions[:b].copy_(self.staged[B : B + b])
        self.new_slots[:b].copy_(self.staged[2 * B : 2 * B + b])
        if self.spare_state >= 0:  # a row with one key is a sequence's first token: no state before it
            self.has_state[:b].copy_(self.staged[3 * B : 3 * B + b] > 1)

    def _pad(self, start: int) -> None:
        """Host rows start .. B - 1: token 0 at position 0, one key, the spare block."""
        ids, pos, slots, lens, states, tables = self._host_views(self.max_batch)
        ids[start:] = 0
        pos[start:] = 0
        slots[start:] = self.spare_block * self.block_size
        lens[start:] = 1
        if self.spare_state >= 0:
            states[start:] = self.spare_state
        tables[start:] = self.spare_block

    # ---------------------------------------------------------------------------------------- capture

    def capture(self, show_progress: bool = False) -> None:
        """Capture every bucket, largest first, into one memory pool (each is run eagerly twice before,
        which compiles its kernels: on a first start, with no Triton cache, most of the time; a bar shows
        it with show_progress)."""
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        buckets = tqdm(list(reversed(self.buckets)), desc="compiling and capturing decode graphs", unit="graph",
                       disable=not show_progress, leave=False)
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in buckets:
                fb = self._batch(b)
                for _ in range(2):
                    self._widen(b)
                    self.model.forward(fb, self.cache)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._widen(b)
                    logits = self.model.forward(fb, self.cache)
                self.graphs[b] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured decode graphs for batch sizes %s in %.1f s", ",".join(map(str, self.buckets)),
                 time.monotonic() - t0)

    # ------------------------------------------------------------------------------------------- step

    def fits(self, seqs: list[tuple[list[int], int, list[int]]], all_logits: list[bool]) -> bool:
        """A decode step this can replay: one token each, last-token logits, within the largest bucket."""
        return (0 < len(seqs) <= self.max_batch and not any(all_logits)
                and all(len(t) == 1 and start < self.max_model_len for _, start, t in seqs))

    def run(self, seqs: list[tuple[list[int], int, list[int]]], input_ids: torch.Tensor | None = None,
            state_slots: tuple[int, ...] = ()) -> torch.Tensor:
        """Logits [len(seqs), vocab] f32 of a decode step (seqs as StepPlan.seqs). The tensor is the
        graph's output buffer: read it before the next step. input_ids [len(seqs)] on the device: the
        tokens, copied into the staging on the device after the host's part (async decode). state_slots:
        each sequence's recurrent-state slot (hybrid models)."""
        if self.spare_state >= 0 and len(state_slots) != len(seqs):
            raise ValueError(f"a hybrid model's decode step needs a state slot per sequence, got {len(state_slots)}")
        S = len(seqs)
        b = next(x for x in self.buckets if x >= S)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        ids, pos, slots, lens, states, tables = self._host_views(self.max_batch)
        if self.spare_state >= 0:
            states[:S] = state_slots
        bs = self.block_size
        for i, (blocks, start, tokens) in enumerate(seqs):
            ids[i] = tokens[0]
            pos[i] = start
            lens[i] = start + 1
            slots[i] = blocks[start // bs] * bs + start % bs
            tables[i, : len(blocks)] = blocks  # entries past a row's blocks are never read
        self._pad(S)
        # the vectors whole, then the bucket's rows of the tables
        n = self.n_vec * self.max_batch + b * self.max_blocks
        self.staged[:n].copy_(self.host[:n], non_blocking=True)
        if input_ids is not None:
            self.staged[:S].copy_(input_ids)
        if self.copied is None:  # not captured (a CPU, in tests): the same static batch, run eagerly
            self._widen(b)
            return self.model.forward(self._batch(b), self.cache)[:S]
        self.copied.record()
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:S]
