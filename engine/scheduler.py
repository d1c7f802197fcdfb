"""Scheduler: one rule for every request. A request has tokens to compute (the rest of its prompt, or its
last sampled token); each step hands out a token budget across running requests, decodes first, then
prompt chunks, then new arrivals while KV blocks are free. Chunked prefill and decode share steps.

KV memory is the paged block pool (engine/kv_cache.py). A new request first takes the cached blocks of
its longest known prefix; one whose next block a running request's prompt is computing right now (copies of
one prompt, a burst sharing a system prompt) is held in the queue until that block is cached, and the
requests behind it go first. On a hybrid model, which resumes only where a state is saved, the running
request is asked to save its state where the two prompts part, and the held one resumes there. When a step cannot get blocks, the most recently admitted running request is
preempted (its blocks released, its tokens recomputed later: preemption by recompute) and put back at
the front of the queue, so arrival order is kept.

Hybrid models (`states`, engine/state_pool.py): a request is admitted only with a recurrent-state slot as
well as its first blocks, and gives both back when it is preempted, finished or aborted; its chunks carry the
state from step to step. With `snapshots`, prefix caching resumes them where a state was saved: a prompt's
chunk ends at the last block boundary before its final token and the step saves the state there; a request
whose prompt starts with a saved prefix adopts its blocks up to that boundary and gets the state copied into
its slot (the batch's `saves` and `restores`, state_pool.py). Without them a request starts at token 0.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from vegaserve.engine.grammar import Matcher
from vegaserve.engine.kv_cache import BlockPool, BlockTable, NoFreeBlocks, extend_chain
from vegaserve.engine.request import GenerateRequest, SamplingParams
from vegaserve.engine.state_pool import StatePool, StateSnapshots


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """The engine's live state of one request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose k/v are in the cache
    # hybrid models' prefix caching: block boundaries where its state is saved besides its prompt's last one:
    # where an earlier request's cached KV ends in its tokens (when no saved state let it resume there), and
    # where a waiting request's tokens part from its own (that request resumes there)
    saves_at: set[int] = field(default_factory=set)
    chain: list[bytes] = field(default_factory=list)  # chain hashes of its leading full blocks (kv_cache.extend_chain)
    table: BlockTable | None = None
    state_slot: int | None = None  # its recurrent-state slot while running (hybrid models)
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    state: object = None  # output-side state (detokenizer, stop matcher), owned by the engine core
    matcher: Matcher | None = None  # constrained decoding: its place in the grammar (engine/grammar.py)

    @classmethod
    def from_generate(cls, req: GenerateRequest, max_new_tokens: int) -> Request:
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator()
            gen.manual_seed(req.params.seed)
        return cls(req.request_id, list(req.prompt_token_ids), req.params, max_new_tokens, generator=gen)

    def token_slice(self, start: int, n: int) -> list[int]:
        """all_ids[start : start + n] without building all_ids (a decode step reads one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : start - p + n]
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        return self.prompt_ids[start:] + self.output_ids[: start + n - p]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next sample."""
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    start: int  # = request.num_computed at schedule time
    tokens: list[int]  # the tokens computed this step (schedule_next: a placeholder, the ids are on the device)
    block_ids: list[int]  # KV blocks of positions 0 .. start + len(tokens) - 1, in order
    samples: bool  # the step reaches the end of the request's known tokens: a new token is sampled
    drafts: tuple[int, ...] = ()  # guesses after the request's last token (engine/speculative.py), in `tokens`


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    # hybrid models' prefix caching: (snapshot, state slot) copied before the step, (state slot, snapshot) after
    restores: tuple[tuple[int, int], ...] = ()
    saves: tuple[tuple[int, int], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, token_budget: int, states: StatePool | None = None,
                 snapshots: StateSnapshots | None = None) -> None:
        self.pool = pool
        self.states = states
        self.snapshots = snapshots if states is not None else None
        self.prefix_caching = states is None or self.snapshots is not None
        self._restores: list[tuple[int, int]] = []  # the admissions' of the step being scheduled
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self._admit()
        budget = self.token_budget
        seqs: list[ScheduledSeq] = []
        saves: list[Request] = []
        # decodes (one pending token) first, so streams keep their pace while long prompts are chunked
        for req in sorted(self.running, key=lambda r: (r.num_pending > 1, r.arrival)):
            if budget <= 0:
                break
            if req not in self.running:  # preempted below to make room for an earlier request
                continue
            start = req.num_computed
            n = min(req.num_pending, budget)
            cut = self._save_point(req)
            if cut and cut <= start + n:  # the chunk ends where the state is saved
                n = cut - start
            if not self._grow(req, n):
                continue
            seqs.append(ScheduledSeq(req, start, req.token_slice(start, n), req.table.blocks_of(start + n),
                                     samples=start + n == req.num_tokens))
            if start + n == cut:
                saves.append((req, cut))
            budget -= n
        # a request preempted after its chunk was scheduled (to make room for an earlier one) computes nothing
        seqs = [s for s in seqs if s.request.status is Status.RUNNING]
        restores, self._restores = tuple(self._restores), []
        return ScheduledBatch(seqs, restores, self._reserve([(r, c) for r, c in saves if r.status is Status.RUNNING]))

    def _save_point(self, req: Request) -> int:
        """The next place past req's computed tokens where a hybrid model's prefix caching saves its state: the
        boundaries of req.saves_at, and the last block boundary before its final token. 0: none left, or a
        request that skips the prefix cache."""
        if self.snapshots is None or req.params.prompt_logprobs is not None:
            return 0
        last = (req.num_tokens - 1) // self.pool.block_size * self.pool.block_size
        return min((p for p in (*req.saves_at, last) if p > req.num_computed), default=0)

    def _reserve(self, saves: list[tuple[Request, int]]) -> tuple[tuple[int, int], ...]:
        """(state slot, snapshot) for each (request, its save point this step's chunk ends at), unless that
        prefix's state is saved already."""
        bs, out = self.pool.block_size, []
        for req, cut in saves:
            key = self._chain(req)[cut // bs - 1]  # the block that ends at the save point
            if key not in self.snapshots:
                out.append((req.state_slot, self.snapshots.reserve(key)))
        return tuple(out)

    def schedule_next(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch` while batch's sampled tokens are still on the device (async decode,
        engine_core.py): the same requests, one token each, one position further. None unless that is
        the step schedule() would give once batch is done: nobody waiting who could be admitted (every
        sequence slot taken, or nobody waiting), every running request in batch decoding one token, none
        reaching its token limit with batch's token, and a KV slot free for each next position (no
        preemption here). A request that ends on a stop string or EOS cannot be foreseen: its token of the
        next step is computed and dropped, and a request waiting for its slot is admitted a step later."""
        if (self.waiting and len(self.running) < self.max_num_seqs) or len(batch.seqs) != len(self.running):
            return None
        for s in batch.seqs:
            r = s.request
            if r.status is not Status.RUNNING or len(s.tokens) != 1 or not s.samples:
                return None
            if len(r.output_ids) + 1 >= r.max_new_tokens:  # batch's token is its last
                return None
        seqs = []
        for s in batch.seqs:
            r, start = s.request, s.start + 1
            try:
                if start + 1 > r.table.num_slots:
                    r.table.append_slots(start + 1 - r.table.num_slots)
            except NoFreeBlocks:
                return None  # slots already added stay in the tables; schedule() counts them
            seqs.append(ScheduledSeq(r, start, [0], r.table.blocks_of(start + 1), samples=True))
        return ScheduledBatch(seqs)

    def _admit(self) -> None:
        held: list[Request] = []  # waiting on a running request to compute (and cache) the blocks they share
        computing = self._computing()
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._held(req, computing):
                held.append(self.waiting.popleft())
                continue
            table = BlockTable(self.pool)
            req.saves_at = set()
            # prompt logprobs need every prompt position computed, so such requests skip the prefix cache
            if req.params.prompt_logprobs is None and self.prefix_caching:
                ends = None if self.snapshots is None else self.snapshots.__contains__
                req.num_computed = table.adopt(self.pool.match_prefix(req.all_ids, ends))
                if self.snapshots is not None and not req.num_computed:
                    req.saves_at.add(self.pool.count_cached(self._chain(req)) * self.pool.block_size)
            no_state = self.states is not None and self.states.num_free == 0
            if no_state or table.blocks_needed(min(req.num_pending, self.token_budget)) > self.pool.num_free:
                table.release()
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.table = table
            if self.states is not None:
                req.state_slot = self.states.allocate()
                if req.num_computed:  # resumed where a state was saved: it goes into the slot first
                    self._restores.append((self.snapshots.take(table.block_hashes[-1]), req.state_slot))
            req.status = Status.RUNNING
            self.running.append(req)
            if self.prefix_caching and self.states is None:  # the requests behind it may wait on its blocks too
                computing.update(self._pending_blocks(req))
        self.waiting.extendleft(reversed(held))

    def _chain(self, req: Request) -> list[bytes]:
        """req.chain grown over the full blocks of its tokens but the last one's."""
        return extend_chain(req.chain, req.all_ids, (req.num_tokens - 1) // self.pool.block_size, self.pool.block_size)

    def _computing(self) -> set[bytes]:
        """The chain hashes of the blocks running requests' prompts have yet to fill, each cached once full (a
        model without recurrent state)."""
        if not self.prefix_caching or self.states is not None or not self.waiting:
            return set()
        return {d for r in self.running for d in self._pending_blocks(r)}

    def _pending_blocks(self, req: Request) -> list[bytes]:
        """The chain hashes of the prompt blocks req has yet to fill (none once it decodes)."""
        return self._chain(req)[req.num_computed // self.pool.block_size :] if req.num_pending > 1 else []

    def _held(self, req: Request, computing: set[bytes]) -> bool:
        """Whether req waits for a prefix a running request's prompt is computing: admitted now, it would
        compute the same tokens beside it; a step or more later it adopts them from the cache instead."""
        if not self.prefix_caching or req.params.prompt_logprobs is not None:
            return False
        chain = self._chain(req)
        k = self.pool.count_cached(chain)
        if self.states is None:  # its first uncached block is being filled
            return bool(computing) and k < len(chain) and chain[k] in computing
        # a hybrid model resumes only where a state is saved: where a running prompt shares more of req's
        # tokens than req could resume now, that request is asked to save its state where the two part
        bs = self.pool.block_size
        resume = next((i for i in range(k, 0, -1) if chain[i - 1] in self.snapshots), 0)
        for r in self.running:
            if r.num_pending <= 1 or r.params.prompt_logprobs is not None:
                continue
            other = self._chain(r)
            common = next((i for i, (a, b) in enumerate(zip(chain, other)) if a != b), min(len(chain), len(other)))
            if common > resume and common * bs > r.num_computed:
                r.saves_at.add(common * bs)
                return True
        return False

    def _grow(self, req: Request, n: int) -> bool:
        """Slots for n more tokens of req, preempting later-admitted requests if blocks run out."""
        need = req.num_computed + n - req.table.num_slots
        while True:
            try:
                if need > 0:
                    req.table.append_slots(need)
                return True
            except NoFreeBlocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    return False

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.table.release()
        req.table = None
        self._free_state(req)
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _free_state(self, req: Request) -> None:
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None

    def computed(self, req: Request) -> None:
        """After a step: register the request's newly filled blocks for prefix caching."""
        if req.table is not None and self.prefix_caching:
            self.pool.cache_full_blocks(req.all_ids, req.table, req.num_computed)

    def finish(self, req: Request) -> None:
        """Release the request's blocks and state slot (finished, stopped or aborted); safe to call twice."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req.table is not None:
            req.table.release()
            req.table = None
        self._free_state(req)
        req.status = Status.FINISHED
