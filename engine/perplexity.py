"""Perplexity the way llama-perplexity measures it, so figures compare across the two.

The text is cut into chunks of n_ctx tokens (a trailing partial chunk is dropped); each chunk is evaluated
from an empty cache, and only the second half of each chunk is scored (every scored token has at least
n_ctx/2 tokens of context): nll of token j+1 under the logits at j, for j in [n_ctx/2, n_ctx-1). When the
model adds BOS, the first token of each chunk is replaced by BOS. The ± figure is the standard error of the
mean nll, carried through exp().
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    ppl_err: float
    n_chunks: int
    n_scored: int
    nll: float  # mean negative log-likelihood per scored token


class PerplexityAccumulator:
    def __init__(self) -> None:
        self.sum = 0.0
        self.sum2 = 0.0
        self.count = 0

    def add(self, nll: torch.Tensor) -> None:
        nll = nll.double()
        self.sum += float(nll.sum())
        self.sum2 += float((nll * nll).sum())
        self.count += nll.numel()

    def result(self, n_chunks: int) -> PerplexityResult:
        mean = self.sum / self.count
        var = self.sum2 / self.count - mean * mean
        ppl = math.exp(mean)
        err = ppl * math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0
        return PerplexityResult(ppl, err, n_chunks, self.count, mean)


def perplexity(
    logits_of: Callable[[list[int]], torch.Tensor],
    tokens: list[int],
    n_ctx: int,
    bos_id: int | None,
    on_chunk: Callable[[int, int, PerplexityResult], None] | None = None,
) -> PerplexityResult:
    """`logits_of(chunk)` returns the logits [len(chunk), vocab] of a chunk evaluated from an empty cache
    (EngineCore.forward_logits)."""
    if n_ctx < 4:
        raise ValueError(f"context must be at least 4 tokens, got {n_ctx}")
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 1:
        raise ValueError(f"the text has {len(tokens)} tokens; at least one chunk of {n_ctx} is needed (use a smaller -c)")
    first = n_ctx // 2
    acc = PerplexityAccumulator()
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
        if bos_id is not None:
            chunk = [bos_id] + chunk[1:]
        logits = logits_of(chunk)
        logp = torch.log_softmax(logits[first : n_ctx - 1].float(), dim=-1)
        target = torch.tensor(chunk[first + 1 :], device=logp.device)
        acc.add(-logp.gather(1, target[:, None]).squeeze(1))
        if on_chunk is not None:
            on_chunk(c + 1, n_chunks, acc.result(c + 1))
    return acc.result(n_chunks)
