"""llama-perplexity's method: chunks of n_ctx, second half scored, ± as the standard error through exp()."""

from __future__ import annotations

import math

import torch

from vegaserve.engine.perplexity import perplexity


def test_perplexity_scores_second_half_of_each_chunk_like_a_direct_computation():
    gen = torch.Generator().manual_seed(0)
    vocab, n_ctx = 11, 8
    table = torch.randn(vocab, vocab, generator=gen)  # a bigram "model": logits depend on the current token
    tokens = torch.randint(0, vocab, (3 * n_ctx + 5,), generator=gen).tolist()  # the 5 extra are dropped

    def logits_of(chunk):
        return table[torch.tensor(chunk)]

    r = perplexity(logits_of, tokens, n_ctx, bos_id=None)
    nll = []
    for c in range(3):
        chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
        for j in range(n_ctx // 2, n_ctx - 1):
            logp = torch.log_softmax(table[chunk[j]].double(), -1)
            nll.append(-float(logp[chunk[j + 1]]))
    mean = sum(nll) / len(nll)
    var = sum(x * x for x in nll) / len(nll) - mean * mean
    assert r.n_chunks == 3 and r.n_scored == len(nll) == 9
    assert math.isclose(r.ppl, math.exp(mean), rel_tol=1e-6)
    assert math.isclose(r.ppl_err, math.exp(mean) * math.sqrt(var / (len(nll) - 1)), rel_tol=1e-6)


def test_perplexity_replaces_first_token_of_each_chunk_with_bos():
    seen = []

    def logits_of(chunk):
        seen.append(chunk[0])
        return torch.zeros(len(chunk), 5)

    r = perplexity(logits_of, [3, 4, 3, 4, 3, 4, 3, 4], 4, bos_id=1)
    assert seen == [1, 1]
    assert math.isclose(r.ppl, 5.0, rel_tol=1e-6)  # uniform logits over 5 tokens (log_softmax in f32)
