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
sized for max_model_len at capture, so one graph serves every context length (each sequence shares
its own keys among the splits; those it leaves without keys exit at once).

Without a GPU (tests) nothing is captured and `run` computes the same static, padded batch eagerly.
One process, or each rank of tensor parallelism alone where the peer-write AllReduce takes the bucket's
AllReduces (graph_buckets): the graph ends at the lane's logits and the vocabulary's gather follows the
replay. Pipelines and NCCL / RCCL collectives run eagerly (docs/ARCHITECTURE.md). Verify graphs (rows > 1)
hold speculative decoding's verify steps. GGML_META_TOKEN_GRAPH=0 turns graphs off.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from vegaserve.engine.forward_batch import AttentionInputs, ForwardBatch, RecurrentInputs, Snapshot
from vegaserve.engine.layers.attention import KVCache
from vegaserve.engine.layers.delta_net import SavedRows
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


def graph_buckets(model: LlamaModel, max_seqs: int, rows: int = 1, max_rows: int = 0) -> tuple[int, ...]:
    """The buckets to capture for steps of `rows` rows a sequence: buckets_for(max_seqs), those past
    max_rows rows dropped (0: none; the first bucket is kept), and under tensor parallelism those whose
    AllReduces the peer-write kernels do not take (a vendor collective is not captured): maybe none."""
    buckets = buckets_for(max_seqs)
    if max_rows:
        buckets = tuple(b for b in buckets if b * rows <= max_rows) or buckets[:1]
    return tuple(b for b in buckets if model.comm.captures_all_reduce(b * rows * model.cfg.hidden_size))


class DecodeGraphs:
    """rows == 1: decode steps (one token a sequence, its logits). rows == R > 1: verify steps, R rows a
    sequence (speculative decoding: a drafted sequence's last token and up to R - 1 guesses, every row's
    logits; plain decoding sequences sharing the step bring one row): each sequence owns R rows of the
    static batch, its rows past its tokens are padding that writes to the spare block, and the logits rows
    each sequence wants are gathered inside the graph. Buckets then stop where b * R would pass max_rows."""

    runs_state = True  # the steps go through the recurrent state (a hybrid model's trunk): its slots are staged
    what = "decode"

    def __init__(self, model: LlamaModel, cache: KVCache, max_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, rows: int = 1, max_rows: int = 0) -> None:
        if cache.k.shape[1] < cache.num_slots + block_size:
            raise ValueError("decode graphs need a spare KV block past the pool's slots")
        state = cache.state if self.runs_state else None
        if state is not None and state.conv.shape[1] <= state.spare_slot:
            raise ValueError("decode graphs need a spare recurrent-state slot past the pool's")
        self.model, self.cache, self.device = model, cache, device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.rows_per_seq = R = rows
        self.buckets = graph_buckets(model, max_seqs, R, max_rows)
        if not self.buckets:
            raise ValueError(f"no graph of {R} rows a sequence: its AllReduce cannot be captured")
        B = self.max_batch = self.buckets[-1]
        N = B * R
        # a verify row's keys run up to start + R: the tables reach R - 1 positions past max_model_len
        self.max_blocks = -(-(max_model_len + R - 1) // block_size)
        self.spare_block = cache.num_slots // block_size
        self.spare_state = state.spare_slot if state is not None else -1
        # staging layout, int32: ids [N] | positions [N] | new slots [N] | (verify: logits rows [N], each
        # token's row [N]) | key counts [B] | (hybrid models: state slots [B]) | tables [B, blocks]
        sizes = [("ids", N), ("pos", N), ("slots", N), ("logit_rows", N if R > 1 else 0), ("packed", N if R > 1 else 0),
                 ("lens", B), ("states", B if state is not None else 0), ("tables", B * self.max_blocks)]
        self.at: dict[str, int] = {}
        at = 0
        for name, n in sizes:
            self.at[name] = at
            at += n
        self.n_staged = at
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(self.n_staged, dtype=torch.int32, pin_memory=on_gpu)
        self.host_np = self.host.numpy()
        self.staged = torch.zeros(self.n_staged, dtype=torch.int32, device=device)
        self.ids = torch.zeros(N, dtype=torch.int64, device=device)
        self.positions = torch.zeros(N, dtype=torch.int64, device=device)
        self.new_slots = torch.zeros(N, dtype=torch.int64, device=device)
        self.logit_rows = torch.zeros(N, dtype=torch.int64, device=device)
        self.query_start = torch.arange(0, N + 1, R, dtype=torch.int32, device=device)
        self.rows = torch.arange(B, dtype=torch.int64, device=device)
        self.all_rows = torch.arange(N, dtype=torch.int64, device=device)
        # a hybrid model's verify step: every row's inputs to the state, kept for the roll back (SavedRows)
        self.saved_rows: SavedRows | None = None
        self.has_state = torch.zeros(B, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if on_gpu else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None, dict]] = {}
        # a padded sequence's rows: positions 0 .. R - 1, writing to the spare block's slots (in turn)
        self._pad_pos = np.tile(np.arange(R, dtype=np.int32), B)
        self._pad_slots = self.spare_block * block_size + self._pad_pos % block_size
        self._pad(0, B)
        self.staged.copy_(self.host)

    # ------------------------------------------------------------------------------------------ views

    def _host(self, name: str, n: int):
        """numpy view of the pinned staging's first n entries of `name` (numpy: element writes from Python
        cost ~100 ns, not ~5 us)."""
        return self.host_np[self.at[name] : self.at[name] + n]

    def _staged(self, name: str, n: int) -> torch.Tensor:
        return self.staged[self.at[name] : self.at[name] + n]

    def _tables(self, staging, b: int):
        return staging[self.at["tables"] :].reshape(self.max_batch, self.max_blocks)[:b]

    def _batch(self, b: int) -> ForwardBatch:
        """The static batch of bucket b: views of the device buffers the graph reads."""
        n, R = b * self.rows_per_seq, self.rows_per_seq
        logits_rows = self.rows[:b] if R == 1 else self.logit_rows[:n]
        fb = ForwardBatch(self.ids[:n], self.positions[:n], [], logits_rows, self.block_size)
        if self.spare_state >= 0:
            fb.__dict__["recurrent"] = RecurrentInputs(  # the cached_property, set to the static tensors
                slots=self._staged("states", b), has_state=self.has_state[:b], query_start=self.query_start[: b + 1],
                max_query_len=R)
            if R > 1:  # every row's inputs to the state kept (static outputs of the graph)
                fb.snapshot = Snapshot([], self.all_rows[:n])
        fb.__dict__["attention"] = AttentionInputs(  # the cached_property, set to the static tensors
            block_tables=self._tables(self.staged, b), seq_lens=self._staged("lens", b),
            query_start=self.query_start[: b + 1], new_slots=self.new_slots[:n], page_size=self.block_size,
            max_seq_len=self.max_model_len + R - 1, max_query_len=R,
        )
        return fb

    def _widen(self, b: int) -> None:
        """Inside the graph: the int32 staging into the int64 inputs."""
        n = b * self.rows_per_seq
        self.ids[:n].copy_(self._staged("ids", n))
        self.positions[:n].copy_(self._staged("pos", n))
        self.new_slots[:n].copy_(self._staged("slots", n))
        if self.rows_per_seq > 1:
            self.logit_rows[:n].copy_(self._staged("logit_rows", n))
        if self.spare_state >= 0:  # keys start + R: a sequence at its first token has no state before it
            self.has_state[:b].copy_(self._staged("lens", b) > self.rows_per_seq)

    def _pad(self, start: int, stop: int) -> None:
        """Host sequences start .. stop - 1: token 0 at positions 0 .. R - 1, R keys, the spare block."""
        R = self.rows_per_seq
        rows = slice(start * R, stop * R)
        self._host("ids", stop * R)[rows] = 0
        self._host("pos", stop * R)[rows] = self._pad_pos[rows]
        self._host("slots", stop * R)[rows] = self._pad_slots[rows]
        self._host("lens", stop)[start:] = R
        if self.spare_state >= 0:
            self._host("states", stop)[start:] = self.spare_state
        self._tables(self.host_np, stop)[start:] = self.spare_block

    # ---------------------------------------------------------------------------------------- capture

    def capture(self, show_progress: bool = False, pool=None) -> None:
        """Capture every bucket, largest first, into one memory pool (each is run eagerly twice before,
        which compiles its kernels: on a first start, with no Triton cache, most of the time; a bar shows
        it with show_progress). pool: another DecodeGraphs' (graph_pool_handle), to share its memory."""
        t0 = time.monotonic()
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        what = self.what if self.rows_per_seq == 1 else f"{self.what} ({self.rows_per_seq} rows a sequence)"
        buckets = tqdm(list(reversed(self.buckets)), desc=f"compiling and capturing {what} graphs", unit="graph",
                       disable=not show_progress, leave=False)
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in buckets:
                fb = self._batch(b)
                for _ in range(2):
                    self._widen(b)
                    self._forward(fb)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self._widen(b)
                    logits, hidden = self._forward(fb)
                self.graphs[b] = (graph, logits, hidden, fb.saved)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %s graphs for batch sizes %s in %.1f s", what, ",".join(map(str, self.buckets)),
                 time.monotonic() - t0)

    # ------------------------------------------------------------------------------------------- step

    def fits(self, seqs: list[tuple[list[int], int, list[int]]], all_logits: list[bool]) -> bool:
        """A step this can replay, within the largest bucket: decode graphs take one token a sequence and
        its logits; verify graphs 1 .. R tokens a sequence, the logits of its last or of every one."""
        if not 0 < len(seqs) <= self.max_batch:
            return False
        if self.rows_per_seq == 1:
            return not any(all_logits) and all(len(t) == 1 and start < self.max_model_len for _, start, t in seqs)
        return all(0 < len(t) <= self.rows_per_seq and start + len(t) <= self.max_model_len for _, start, t in seqs)

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph captures (and a CPU runs in its place): (the lane's logits, the hidden states a step
        keeps (draft-mtp: the trunk's output-normed ones, a static buffer of the graph's too) or None)."""
        return self.model.forward_lane(fb, self.cache), self.model.hidden if self.model.keep_hidden else None

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The lane's logits -> the whole vocabulary's, after the replay."""
        return self.model.gather_logits(logits)

    def run(self, seqs: list[tuple[list[int], int, list[int]]], input_ids: torch.Tensor | None = None,
            state_slots: tuple[int, ...] = (), all_logits: list[bool] | None = None) -> torch.Tensor:
        """Logits f32 of a step (seqs as StepPlan.seqs), one row a sequence (decode) or the rows
        all_logits asks for (verify: every row of a sequence where it is True, else its last). The tensor is
        the graph's output buffer: read it before the next step. input_ids [len(seqs)] on the device: the
        tokens, copied into the staging on the device after the host's part (async decode, decode graphs).
        state_slots: each sequence's recurrent-state slot (hybrid models)."""
        if self.spare_state >= 0 and len(state_slots) != len(seqs):
            raise ValueError(f"a hybrid model's decode step needs a state slot per sequence, got {len(state_slots)}")
        if self.rows_per_seq > 1 and input_ids is not None:
            raise ValueError("verify graphs take the step's tokens from the plan")
        b, wanted = self._stage(seqs, input_ids, state_slots, all_logits)
        logits, hidden, saved = self._replay(b, wanted, sum(len(t) for _, _, t in seqs))
        self.model.hidden = hidden
        if saved:  # a hybrid model's verify step: every sequence's state went through all R rows (the worker
            # rolls each back to the rows it keeps)
            R = self.rows_per_seq
            self.saved_rows = SavedRows.of_layers([(slot, i * R, R) for i, slot in enumerate(state_slots)], saved)
        return logits

    def _stage(self, seqs: list[tuple[list[int], int, list[int]]], input_ids: torch.Tensor | None,
               state_slots: tuple[int, ...], all_logits: list[bool] | None) -> tuple[int, int]:
        """The step's inputs through the pinned staging to the device: (its bucket, the logits rows wanted)."""
        R, B = self.rows_per_seq, self.max_batch
        S = len(seqs)
        b = next(x for x in self.buckets if x >= S)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        ids, pos, slots = (self._host(k, B * R) for k in ("ids", "pos", "slots"))
        lens = self._host("lens", B)
        tables = self._tables(self.host_np, B)
        if self.spare_state >= 0:
            self._host("states", S)[:] = state_slots
        bs = self.block_size
        if R == 1:
            for i, (blocks, start, tokens) in enumerate(seqs):
                ids[i] = tokens[0]
                pos[i] = start
                lens[i] = start + 1
                slots[i] = blocks[start // bs] * bs + start % bs
                tables[i, : len(blocks)] = blocks  # entries past a row's blocks are never read
            wanted = S
        else:
            out_rows, packed = self._host("logit_rows", B * R), self._host("packed", B * R)
            wanted = done = 0
            last = self.max_model_len - 1
            for i, ((blocks, start, tokens), every) in enumerate(zip(seqs, all_logits or [False] * S, strict=True)):
                n, r0 = len(tokens), i * R
                ids[r0 : r0 + n] = tokens
                ids[r0 + n : r0 + R] = 0
                # padded rows: positions past the tokens (held inside the rotary tables), the spare block's slots
                pos[r0 : r0 + R] = np.minimum(np.arange(start, start + R), last)
                p = np.arange(start, start + n)
                slots[r0 : r0 + n] = np.asarray(blocks)[p // bs] * bs + p % bs
                slots[r0 + n : r0 + R] = self._pad_slots[n:R]
                lens[i] = start + R  # the padded rows sit after the real ones: causal masking hides them
                tables[i, : len(blocks)] = blocks
                tables[i, len(blocks) : -(-(start + R) // bs)] = self.spare_block
                k = n if every else 1
                out_rows[wanted : wanted + k] = range(r0 + n - k, r0 + n)
                wanted += k
                packed[done : done + n] = range(r0, r0 + n)
                done += n
            out_rows[wanted:] = 0  # the graph gathers the whole bucket's entries: the unused ones a row it has
        self._pad(S, B)
        # the vectors whole, then the bucket's rows of the tables
        n = self.at["tables"] + b * self.max_blocks
        self.staged[:n].copy_(self.host[:n], non_blocking=True)
        if input_ids is not None:
            self.staged[:S].copy_(input_ids)
        return b, wanted

    def _packed(self, rows: int) -> torch.Tensor:
        """rows > 1 a sequence: the static batch's row of each of the step's tokens, in order (device, int64)."""
        return self._staged("packed", rows).long()

    def _replay(self, b: int, wanted: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """Bucket b's graph (without one: the same static batch, run eagerly): (the logits rows wanted, the
        hidden states kept (a verify step's: one a token, in order), the recurrent state's inputs saved)."""
        if self.copied is None:  # not captured (a CPU, in tests)
            self._widen(b)
            fb = self._batch(b)
            logits, hidden = self._forward(fb)
            saved = fb.saved
        else:
            self.copied.record()
            graph, logits, hidden, saved = self.graphs[b]
            graph.replay()
        if hidden is not None and self.rows_per_seq > 1:
            hidden = hidden.index_select(0, self._packed(tokens))
        return self._gather(logits[:wanted]), hidden, saved


class MtpGraphs(DecodeGraphs):
    """draft-mtp's steps of the model's MTP block (models/hybrid.py NextNHead) replayed as the trunk's are:
    rows == 1 for each further guess (one token a sequence), rows == R for a sequence's catch-up (its newest
    token after the guesses its last step kept, the last row's logits). The hidden state each row pairs with
    is one more static input, the block's output hidden states one more output. The block is full
    attention: no recurrent state."""

    runs_state = False
    what = "MTP block"

    def __init__(self, model: LlamaModel, head, cache: KVCache, max_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, rows: int = 1, max_rows: int = 0) -> None:
        super().__init__(model, cache, max_seqs, max_model_len, block_size, device, rows, max_rows)
        self.head = head
        self.h_in = torch.zeros(self.max_batch * rows, model.cfg.hidden_size, dtype=torch.float32, device=device)

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = self.head.forward_lane(self.model, self.h_in[: fb.input_ids.numel()], self.cache, fb)
        return logits, out

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.gather(self.model, logits)

    def run_block(self, seqs: list[tuple[list[int], int, list[int]]],
                  h_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NextNHead.forward over seqs (each sequence's last row's logits), h_in [tokens, hidden] f32: (its
        output hidden states, one a token in order (rows == 1: views of a graph's buffer), the logits)."""
        b, wanted = self._stage(seqs, None, (), None)
        if self.rows_per_seq == 1:
            self.h_in[: len(seqs)].copy_(h_in)
        else:
            self.h_in.index_copy_(0, self._packed(len(h_in)), h_in.to(self.h_in.dtype))
        logits, out, _ = self._replay(b, wanted, len(h_in))
        return out[: len(h_in)], logits
