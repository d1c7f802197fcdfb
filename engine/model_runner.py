"""ModelRunner: a ScheduledBatch in, a StepOutput out. Runs on rank 0 and owns the sampler; the model and
its KV cache live behind the executor (one process, or one per device).

ScheduledBatch -> StepPlan -> executor (every rank: ForwardBatch, its layers) -> logits -> sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vegaserve.engine.distributed.worker import StepPlan
from vegaserve.engine.executor import Executor
from vegaserve.engine.request import TokenLogprob
from vegaserve.engine.sampling import Sampler
from vegaserve.engine.scheduler import ScheduledBatch


@dataclass
class SeqResult:
    token_id: int | None  # None: mid-prompt chunk, nothing sampled
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # for the prompt positions this chunk scored


@dataclass
class StepOutput:
    results: list[SeqResult]  # one per ScheduledSeq, same order


class ModelRunner:
    def __init__(self, executor: Executor, block_size: int) -> None:
        self.executor = executor
        self.block_size = block_size
        self.sampler = Sampler()

    @property
    def cache(self):
        """Rank 0's KV cache (with several devices: its share)."""
        return self.executor.cache

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        # a request that wants prompt logprobs needs logits for every prompt row it computes
        wants_prompt = [s.request.params.prompt_logprobs is not None and s.start < len(s.request.prompt_ids) for s in batch.seqs]
        plan = StepPlan([(s.block_ids, s.start, s.tokens) for s in batch.seqs], wants_prompt, self.block_size)
        logits = self.executor.forward(plan)
        results: list[SeqResult] = []
        last_rows: list[int] = []
        row = 0
        for s, every in zip(batch.seqs, wants_prompt, strict=True):
            n_rows = len(s.tokens) if every else 1
            res = SeqResult(token_id=None)
            if every:
                res.prompt_logprobs = self._prompt_logprobs(s, logits[row : row + n_rows])
            results.append(res)
            last_rows.append(row + n_rows - 1)
            row += n_rows
        sampling = [i for i, s in enumerate(batch.seqs) if s.samples]
        if sampling:
            reqs = [batch.seqs[i].request for i in sampling]
            out = self.sampler.sample(
                logits[[last_rows[i] for i in sampling]],
                [r.params for r in reqs],
                [r.prompt_ids for r in reqs],
                [r.output_ids for r in reqs],
                [r.generator for r in reqs],
            )
            for i, tok, lp in zip(sampling, out.token_ids, out.logprobs, strict=True):
                results[i].token_id = tok
                results[i].logprob = lp
        return StepOutput(results)

    def _prompt_logprobs(self, s, logits: torch.Tensor) -> list[TokenLogprob | None]:
        prompt = s.request.prompt_ids
        end = min(s.start + len(s.tokens), len(prompt))
        # logits row j predicts position start + j + 1; the sampler scores ids[1:] under rows [:-1]
        records = self.sampler.prompt_logprobs(logits, prompt[s.start : end + 1], s.request.params.prompt_logprobs or 0)
        return records if s.start == 0 else records[1:]
