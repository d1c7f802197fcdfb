"""ModelRunner: a ScheduledBatch in, a StepOutput out. Runs on rank 0 and owns the sampler; the model and
its KV cache live behind the executor (one process, or one per device).

ScheduledBatch -> StepPlan -> executor (every rank: ForwardBatch, its layers) -> logits -> sampled tokens.

Guided requests (constrained decoding, engine/grammar.py): their rows' masks are filled on a worker thread
from the moment the step is launched (before the forward, so on a CPU too the fill runs beside it) and
applied in the sampler; a step without guided rows starts nothing and passes no masks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from vegaserve.engine.executor import Executor
from vegaserve.engine.forward_batch import StepPlan
from vegaserve.engine.grammar import MaskFiller, PendingMasks
from vegaserve.engine.request import TokenLogprob
from vegaserve.engine.sampling import Sampler, TokenMasks
from vegaserve.engine.speculative import Verified, verify
from vegaserve.engine.scheduler import ScheduledBatch


@dataclass
class SeqResult:
    token_ids: list[int] = field(default_factory=list)  # empty: mid-prompt chunk; more than one: guesses kept
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per token, None where not asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # for the prompt positions this chunk scored


@dataclass
class StepOutput:
    results: list[SeqResult]  # one per ScheduledSeq, same order


class TokenReadback:
    """The drawn tokens' copy to the host, queued on the stream right behind the draw into a pinned buffer,
    with an event after it: result() waits for that event. A plain read (tokens.tolist()) would be queued
    behind everything launched since, and with async decode that is the whole next step: the host would get
    step N's tokens only when step N+1 had finished, and launch step N+2 while the device sat idle (an
    eighth of an 8B decode step on an H200). Two buffers and their events, used in
    turn; the buffers grow in powers of two and are kept, so a steady state allocates nothing."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event] = []
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        n = tokens.numel()
        if not self.buffers or self.buffers[0].numel() < n:
            size = 1 << max(6, (n - 1).bit_length())
            self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
        self.turn ^= 1
        host, done = self.buffers[self.turn][:n], self.events[self.turn]
        host.copy_(tokens, non_blocking=True)
        done.record()
        return host, done


class ModelRunner:
    """execute(batch) = launch(batch).result(); the engine core may launch the next decode step between a
    step's draw() and its result() (async decode)."""

    def __init__(self, executor: Executor, block_size: int, masks: MaskFiller | None = None) -> None:
        self.executor = executor
        self.block_size = block_size
        self.sampler = Sampler()
        self.readback = TokenReadback()
        self.masks = masks  # fills guided requests' masks; None: the engine serves no grammars
        # hybrid models: (state slot, rows kept) of the last verify step's drafted sequences, for the next step's
        # plan (StepPlan.rollback; each rank rolls back those it computed more rows of)
        self.rollback: list[tuple[int, int]] = []

    @property
    def cache(self):
        """Rank 0's KV cache (with several devices: its share)."""
        return self.executor.cache

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> StepInFlight:
        """Start the batch's forward pass; `input_ids` [seqs] on the device replace the batch's placeholder
        tokens (async decode: the tokens the step before drew, not yet read by the host)."""
        # a request that wants prompt logprobs needs logits for every prompt row it computes, a drafted one for
        # its last token and every guess
        wants_prompt = [s.request.params.prompt_logprobs is not None and s.start < len(s.request.prompt_ids) for s in batch.seqs]
        every = [w or bool(s.drafts) for s, w in zip(batch.seqs, wants_prompt, strict=True)]
        states = tuple(s.request.state_slot for s in batch.seqs)  # hybrid models: each one's recurrent-state slot
        states = () if None in states else states
        # hybrid models: a drafted sequence's state is backed up and its rows' inputs kept, for a roll back
        snapshot = tuple(i for i, s in enumerate(batch.seqs) if s.drafts) if states else ()
        plan = StepPlan([(s.block_ids, s.start, s.tokens) for s in batch.seqs], every, self.block_size,
                        states, snapshot, tuple(self.rollback), tuple(s.request.table.serial for s in batch.seqs),
                        batch.restores, batch.saves)
        self.rollback = []
        step = StepInFlight(self, batch, wants_prompt)
        if input_ids is None:  # the guided requests' matchers have seen every token: fill beside the forward
            step.start_masks()
        step.logits = self.executor.forward(plan, input_ids)
        return step


class StepInFlight:
    """A launched step: `draw()` queues the sampling on the device, reading the requests' penalties and
    generators as they are at that moment; `tokens` is then the drawn ids [sampling seqs] on the device;
    `result()` waits for them. The logits are the executor's buffer, valid until the next launch: draw()
    keeps what result() reads for logprobs, but prompt logprobs are read in result(), so a batch with prompt
    rows gets its result() before anything else is launched (it is no decode step: nothing follows it early)."""

    def __init__(self, runner: ModelRunner, batch: ScheduledBatch, wants_prompt: list[bool]) -> None:
        self.runner, self.batch, self.wants_prompt = runner, batch, wants_prompt
        self.logits: torch.Tensor | None = None  # set by launch once the forward is queued
        self.tokens: torch.Tensor | None = None
        # sampling sequences: plain ones draw a token from their last row, drafted ones verify their guesses
        self.sampling = [i for i, s in enumerate(batch.seqs) if s.samples and not s.drafts]
        self.guided = [k for k, i in enumerate(self.sampling) if batch.seqs[i].request.matcher is not None]
        self._masks: PendingMasks | None = None
        self.drafted = [i for i, s in enumerate(batch.seqs) if s.drafts]
        self.verified: list[Verified] | None = None
        self._rows: torch.Tensor | None = None  # the sampling rows' logits, kept by draw() for result()
        self._host: tuple[torch.Tensor, torch.cuda.Event] | None = None  # the tokens on their way to the host
        # each sequence's logits rows end here: all its rows where it wants prompt logprobs or has guesses,
        # else its last
        self.row_ends = list(itertools.accumulate(len(s.tokens) if every or s.drafts else 1
                                                  for s, every in zip(batch.seqs, wants_prompt, strict=True)))

    def start_masks(self) -> None:
        """Start filling the guided rows' masks; their matchers must have taken every token sampled so far
        (async decode: the step before has not been read yet when this step is launched, so draw() starts
        the fill, after that step's update)."""
        if self._masks is not None:
            return
        # a grammar that finished meanwhile (its request's extra async-decode token is dropped) has no mask
        matcher = {k: self.batch.seqs[self.sampling[k]].request.matcher for k in self.guided}
        self.guided = [k for k in self.guided if not matcher[k].finished]
        if self.guided:
            self._masks = self.runner.masks.start([matcher[k] for k in self.guided], self.guided, len(self.sampling))

    @torch.inference_mode()
    def draw(self) -> None:
        if self.drafted and self.verified is None:
            seqs = [self.batch.seqs[i] for i in self.drafted]
            reqs = [s.request for s in seqs]
            self.verified = verify(self.logits, [self.row_ends[i] - len(self.batch.seqs[i].tokens) for i in self.drafted],
                                   [list(s.drafts) for s in seqs], [r.params for r in reqs], [r.prompt_ids for r in reqs],
                                   [r.output_ids for r in reqs], [r.generator for r in reqs])
        if self.tokens is not None or not self.sampling:
            return
        reqs = [self.batch.seqs[i].request for i in self.sampling]
        rows = [self.row_ends[i] - 1 for i in self.sampling]  # a sampling sequence's last row
        if rows == list(range(self.logits.shape[0])):  # a decode step: every row, no index upload (no wait)
            # logprobs are read in result(), maybe after the next launch has overwritten the buffer
            asked = any(r.params.logprobs is not None for r in reqs)
            self._rows = self.logits.clone() if asked else self.logits
        else:
            self._rows = self.logits[rows]
        masks = None
        if self.guided:
            self.start_masks()
        if self._masks is not None:
            masks = TokenMasks(self._masks.wait(self._rows.device), self.guided)
        self.tokens = self.runner.sampler.draw(self._rows, [r.params for r in reqs], [r.prompt_ids for r in reqs],
                                               [r.output_ids for r in reqs], [r.generator for r in reqs], masks)
        if self.tokens.is_cuda:
            self._host = self.runner.readback.start(self.tokens)

    @torch.inference_mode()
    def result(self) -> StepOutput:
        self.draw()
        results: list[SeqResult] = []
        for s, every, end in zip(self.batch.seqs, self.wants_prompt, self.row_ends, strict=True):
            res = SeqResult()
            if every:
                res.prompt_logprobs = self._prompt_logprobs(s, self.logits[end - len(s.tokens) : end])
            results.append(res)
        if self.sampling:
            token_ids = None
            if self._host is not None:
                host, done = self._host
                done.synchronize()
                token_ids = host.tolist()
            out = self.runner.sampler.collect(self._rows, self.tokens,
                                              [self.batch.seqs[i].request.params for i in self.sampling], token_ids)
            for i, tok, lp in zip(self.sampling, out.token_ids, out.logprobs, strict=True):
                results[i].token_ids = [tok]
                results[i].logprobs = [lp]
        for i, v in zip(self.drafted, self.verified or (), strict=True):
            results[i].token_ids = v.token_ids
            results[i].logprobs = v.logprobs
            s = self.batch.seqs[i]
            # rows kept: the last token and the guesses accepted (the target's own token comes next step); each
            # rank rolls back what its step computed past them (a replayed step's padding too)
            if s.request.state_slot is not None:
                self.runner.rollback.append((s.request.state_slot, len(v.token_ids)))
        return StepOutput(results)

    def _prompt_logprobs(self, s, logits: torch.Tensor) -> list[TokenLogprob | None]:
        prompt = s.request.prompt_ids
        end = min(s.start + len(s.tokens), len(prompt))
        # logits row j predicts position start + j + 1; the sampler scores ids[1:] under rows [:-1]
        records = self.runner.sampler.prompt_logprobs(logits, prompt[s.start : end + 1],
                                                      s.request.params.prompt_logprobs or 0)
        return records if s.start == 0 else records[1:]
