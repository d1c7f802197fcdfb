"""Scheduler: one rule for every request. A request has tokens to compute (the rest of its prompt, or its
last sampled token); each step hands out a token budget across running requests, decodes first, then
prompt chunks, then new arrivals while a KV slot is free. Chunked prefill and decode share steps.

The KV cache here is slot based (one slot of max_model_len per running request); the paged block pool
replaces slots without changing this rule.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from vegaserve.engine.request import GenerateRequest, SamplingParams


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
    slot: int = -1
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    state: object = None  # output-side state (detokenizer, stop matcher), owned by the engine core

    @classmethod
    def from_generate(cls, req: GenerateRequest, max_new_tokens: int) -> Request:
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator()
            gen.manual_seed(req.params.seed)
        return cls(req.request_id, list(req.prompt_token_ids), req.params, max_new_tokens, generator=gen)

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
    tokens: list[int]  # the tokens computed this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens: a new token is sampled."""
        return self.start + len(self.tokens) == self.request.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq]

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)


class Scheduler:
    def __init__(self, n_slots: int, token_budget: int) -> None:
        self.token_budget = token_budget
        self.free_slots = list(range(n_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.token_budget
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.status = Status.RUNNING
            self.running.append(req)
        seqs: list[ScheduledSeq] = []
        # decodes (one pending token) first, so streams keep their pace while long prompts are chunked
        for req in sorted(self.running, key=lambda r: (r.num_pending > 1, r.arrival)):
            if budget <= 0:
                break
            n = min(req.num_pending, budget)
            seqs.append(ScheduledSeq(req, req.num_computed, req.all_ids[req.num_computed : req.num_computed + n]))
            budget -= n
        return ScheduledBatch(seqs)

    def finish(self, req: Request) -> None:
        """Release the request's slot (finished, stopped or aborted); safe to call twice."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.slot = -1
