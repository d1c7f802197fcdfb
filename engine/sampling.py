"""Pick the next token of every request in a batch, on the logits' device.

One call serves the whole batch. Per-request knobs become small per-row tensors, so every pass over the
vocabulary is one vectorized op; Python loops only run over the batch, to build those small tensors.
The order is the one llama.cpp's and vLLM's users expect:

    logit_bias -> repetition penalty -> presence / frequency penalty -> grammar masks (constrained rows)
      -> greedy rows (temperature 0 or top_k 1): argmax, lowest id on ties
      -> other rows: / temperature -> top-k -> top-p -> min-p -> draw

Logprobs are read from the RAW logits (before all of the above), as OpenAI and vLLM report them.

The draw is an inverse-CDF draw: one uniform per row, taken from that request's own generator, located in
the cumulative sum of the surviving weights. A seeded request therefore consumes exactly one number from its
generator per sampled token, and its token depends only on its seed, its logits and its parameters, never
on which other requests share the batch or at which row it sits. (Cumulative sums are computed prefix by
prefix, so they do not change with how many candidates the batch as a whole needed; full reductions such as
`sum` may regroup with the batch shape, which is why the code avoids them on the random path.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vegaserve.engine.grammar import apply_masks
from vegaserve.engine.request import SamplingParams, TokenLogprob

# How many top tokens to try when a row has filters but no top-k that bounds them, widest last. On one CPU
# thread at V=49152, topk(256) takes ~0.25 ms, topk(4096) ~0.9 ms and a full sort ~3 ms; min-p and top-p
# of a peaked distribution keep far fewer than 256 tokens, a flat one may need the full sort.
_CANDIDATE_WIDTHS = (256, 4096)

# Rows of prompt logprobs computed at once: log_softmax over T x V for a long prompt would hold T*V floats.
_PROMPT_CHUNK = 256


@dataclass
class TokenMasks:
    """The grammar masks of a step (engine/grammar.py): `bitmask` [batch, words] int32 on the logits' device,
    read only at `rows`, the constrained rows; the other rows sample from every token."""

    bitmask: Tensor
    rows: list[int]


@dataclass
class SampleResult:
    """One step's choice: a token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Batched sampling; an object so that per-step staging buffers can live here later."""

    def sample(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        masks: TokenMasks | None = None,
    ) -> SampleResult:
        """Choose one token per row of `logits` [B, V] (float32).

        A generator must live on `logits.device`; None draws from torch's default generator.
        `logits` itself is never modified.
        """
        tokens = self.draw(logits, params, prompt_ids, output_ids, generators, masks)
        return self.collect(logits, tokens, params)

    def draw(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        masks: TokenMasks | None = None,
    ) -> Tensor:
        """The chosen token of every row, int64 [B] on the logits' device, without waiting for it (a top-p
        or min-p row may still wait once, to see whether its candidates suffice). `masks`: the grammar's
        allowed tokens of the constrained rows."""
        batch = logits.shape[0]
        if not len(params) == len(prompt_ids) == len(output_ids) == len(generators) == batch:
            raise ValueError(
                f"batch of {batch} logits rows needs as many params, prompt_ids, output_ids and generators; got "
                f"{len(params)}, {len(prompt_ids)}, {len(output_ids)}, {len(generators)}"
            )
        adjusted = adjust_logits(logits, params, prompt_ids, output_ids)
        if masks is not None and masks.rows:
            if adjusted is logits:
                adjusted = logits.clone()
            apply_masks(adjusted, masks.bitmask, _to_device(masks.rows, torch.int32, logits.device))

        greedy = [i for i, p in enumerate(params) if p.greedy]
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if not drawn:  # the common decode case: no index juggling at all
            tokens = greedy_argmax(adjusted)
        else:
            tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
            if greedy:
                rows = _index(greedy, logits.device)
                tokens[rows] = greedy_argmax(adjusted[rows])
            rows = _index(drawn, logits.device)
            tokens[rows] = _sample_rows(
                adjusted[rows], [params[i] for i in drawn], [generators[i] for i in drawn]
            )

        return tokens

    def collect(self, logits: Tensor, tokens: Tensor, params: list[SamplingParams],
                token_ids: list[int] | None = None) -> SampleResult:
        """The drawn tokens on the host, with the logprobs of the rows that asked (read from `logits`).
        `token_ids`: the tokens already read back (TokenReadback), else read here."""
        batch = logits.shape[0]
        if token_ids is None:
            token_ids = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * batch
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asked:
            rows = _index(asked, logits.device)
            records = logprob_records(logits[rows], tokens[rows], [params[i].logprobs or 0 for i in asked])
            for i, record in zip(asked, records):
                logprobs[i] = record
        return SampleResult(token_ids=token_ids, logprobs=logprobs)

    def prompt_logprobs(self, logits: Tensor, prompt_ids: list[int], n: int) -> list[TokenLogprob | None]:
        """Logprobs of the prompt's own tokens (completions with echo).

        `logits[i]` is the model's prediction after prompt position i, so position i > 0 is scored under
        `logits[i - 1]`; position 0 has no prediction and gets None. Top-n alternatives, best first.
        """
        if not prompt_ids:
            return []
        scored = len(prompt_ids) - 1
        if logits.shape[0] < scored:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens need at least {scored} logits rows, got {logits.shape[0]}"
            )
        targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logits.device)
        result: list[TokenLogprob | None] = [None]
        for start in range(0, scored, _PROMPT_CHUNK):
            stop = min(start + _PROMPT_CHUNK, scored)
            result.extend(logprob_records(logits[start:stop], targets[start:stop], [n] * (stop - start)))
        return result


def greedy_argmax(logits: Tensor) -> Tensor:
    """argmax of every row [B, V], the lowest id on ties, in two passes where rows are long: the maximum of
    each run of `chunk` ids, then the first run holding the row's maximum. torch's argmax gives each row to
    one block of threads (an H200 took 37 us for one row of 128,256 logits, the whole decode step's sampling)."""
    batch, vocab = logits.shape
    chunk = min(1024, vocab & -vocab)  # the largest power of two dividing V, up to 1024
    if chunk < 64 or vocab // chunk < 8:
        return logits.argmax(dim=-1)
    values, ids = logits.reshape(batch, vocab // chunk, chunk).max(dim=-1)  # first maximum of each run
    best = values.argmax(dim=-1, keepdim=True)  # first run holding the row's maximum
    return (best * chunk + ids.gather(1, best)).squeeze(1)


def _index(rows: list[int], device: torch.device) -> Tensor:
    return _to_device(rows, torch.long, device)


def _to_device(values, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small per-row tensor built on the host (a list, or a host tensor), on `device` without waiting: on a
    GPU through pinned memory and a non-blocking copy. A plain copy from pageable memory synchronizes the
    stream: the host would wait for the step's forward before the sampler could queue its work, and async
    decode could not queue the next step behind it."""
    t = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def adjust_logits(
    logits: Tensor, params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]]
) -> Tensor:
    """logit_bias, then the repetition penalty, then presence / frequency; a new tensor only if any applies.

    Public because speculative verification needs the same adjusted distribution the sampler draws from.
    """
    vocab = logits.shape[1]
    device = logits.device
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    counted = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not (biased or repeated or counted):
        return logits
    out = logits.clone()

    if biased:
        rows, ids, values = [], [], []
        for i in biased:
            for token, bias in params[i].logit_bias.items():
                if 0 <= token < vocab:  # a client may name ids the model lacks; those change nothing
                    rows.append(i)
                    ids.append(token)
                    values.append(bias)
        if rows:
            bias_t = _to_device(values, out.dtype, device)
            out.index_put_((_index(rows, device), _index(ids, device)), bias_t, accumulate=True)

    # Both penalties touch only the tokens that occurred, so they work on (row, id, count) triples rather
    # than on [B, V] masks: a few hundred elements instead of several full passes over the vocabulary.
    if repeated:
        rows_t, ids_t, _ = _occurrences([prompt_ids[i] + output_ids[i] for i in repeated], repeated, vocab, device)
        penalty = _to_device([p.repetition_penalty for p in params], out.dtype, device)[rows_t]
        seen = out[rows_t, ids_t]
        # llama.cpp / HF rule: shrink a seen token's logit toward zero from either side.
        out[rows_t, ids_t] = torch.where(seen > 0, seen / penalty, seen * penalty)

    if counted:
        rows_t, ids_t, counts = _occurrences([output_ids[i] for i in counted], counted, vocab, device)
        presence = _to_device([p.presence_penalty for p in params], out.dtype, device)[rows_t]
        frequency = _to_device([p.frequency_penalty for p in params], out.dtype, device)[rows_t]
        # OpenAI rule, over generated tokens only.
        out[rows_t, ids_t] -= presence + frequency * counts.to(out.dtype)
    return out


def _occurrences(
    sequences: list[list[int]], batch_rows: list[int], vocab: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Distinct (batch row, token id) pairs of `sequences[j]` (belonging to row `batch_rows[j]`) with counts.

    Ids outside [0, vocab) are skipped: a tokenizer may know ids the model's head lacks.
    """
    flat = [t for seq in sequences for t in seq]
    rows = [r for r, seq in zip(batch_rows, sequences) for _ in seq]
    ids_t = _index(flat, device)
    rows_t = _index(rows, device)
    valid = (ids_t >= 0) & (ids_t < vocab)
    keys, counts = torch.unique(rows_t[valid] * vocab + ids_t[valid], return_counts=True)
    return keys // vocab, keys % vocab, counts


def _effective_top_k(p: SamplingParams, vocab: int) -> int:
    return min(p.top_k, vocab) if p.top_k > 0 else vocab


def _has_filter(p: SamplingParams, vocab: int) -> bool:
    return _effective_top_k(p, vocab) < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _sample_rows(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Tensor:
    """Temperature, filters and the draw for rows that are not greedy; returns token ids [n]."""
    n, vocab = logits.shape
    device = logits.device
    temperature = _to_device([p.temperature for p in params], logits.dtype, device)
    scaled = logits / temperature[:, None]
    uniforms = draw_uniforms(generators, device)

    filtered = [i for i, p in enumerate(params) if _has_filter(p, vocab)]
    plain = [i for i, p in enumerate(params) if not _has_filter(p, vocab)]
    tokens = torch.empty(n, dtype=torch.long, device=device)
    if plain:
        # Nothing to cut: draw straight from the vocabulary order, no sort needed.
        rows = _index(plain, device)
        tokens[rows] = _draw(scaled[rows], None, uniforms[rows])
    if filtered:
        rows = _index(filtered, device)
        tokens[rows] = _sample_filtered(scaled[rows], [params[i] for i in filtered], uniforms[rows])
    return tokens


def probabilities(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """The distribution [n, V] the sampler draws a non-greedy row from: / temperature, then top-k, top-p and
    min-p, exactly as _sample_rows cuts them (over a full sort, where the sampler may stop at the best
    candidates: the kept set is the same). Speculative verification weighs guesses with it."""
    n, vocab = logits.shape
    device = logits.device
    temperature = _to_device([p.temperature for p in params], logits.dtype, device)
    scaled = logits / temperature[:, None]
    probs = torch.softmax(scaled, dim=-1)
    filtered = [i for i, p in enumerate(params) if _has_filter(p, vocab)]
    if filtered:
        rows = _index(filtered, device)
        sub = scaled[rows]
        fparams = [params[i] for i in filtered]
        top_k = _to_device([_effective_top_k(p, vocab) for p in fparams], torch.long, device)
        top_p = _to_device([p.top_p for p in fparams], sub.dtype, device)
        min_p = _to_device([p.min_p for p in fparams], sub.dtype, device)
        full_totals = torch.exp(sub - sub.max(dim=-1, keepdim=True).values).cumsum(dim=-1)[:, -1]
        values, ids = sub.sort(dim=-1, descending=True)
        keep = _keep_mask(values, top_k, top_p, min_p, top_k < vocab, full_totals)
        weights = torch.exp(values - values[:, :1]).masked_fill(~keep, 0.0)
        probs[rows] = torch.zeros_like(sub).scatter_(1, ids, weights / weights.sum(dim=-1, keepdim=True))
    return probs


def draw_uniforms(generators: list[torch.Generator | None], device: torch.device) -> Tensor:
    """One U[0, 1) per row: seeded rows from their own generator, the rest in one call. The requests'
    generators live on the host (scheduler.Request): their numbers are drawn there, one per row, and reach
    the device in one copy (a copy and a write per row were most of a 64-stream sampled step's host time);
    a generator on another device draws there."""
    n = len(generators)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    on_host = [i for i, g in enumerate(generators) if g is not None and g.device.type == "cpu"]
    drawn = torch.cat([torch.rand(1, generator=generators[i]) for i in on_host]) if on_host else None
    if len(unseeded) == n:
        return torch.rand(n, device=device)
    if len(on_host) == n:
        return _to_device(drawn, torch.float32, device)
    values = torch.empty(n, dtype=torch.float32, device=device)
    if unseeded:
        values[_index(unseeded, device)] = torch.rand(len(unseeded), device=device)
    if on_host:
        values[_index(on_host, device)] = _to_device(drawn, torch.float32, device)
    for i, g in enumerate(generators):
        if g is not None and g.device.type != "cpu":
            values[i] = torch.rand(1, generator=g, device=g.device).to(device)[0]
    return values


def _sample_filtered(scaled: Tensor, params: list[SamplingParams], uniforms: Tensor) -> Tensor:
    """top-k, top-p and min-p over the best candidates, sorted best first, then the draw."""
    n, vocab = scaled.shape
    device = scaled.device
    top_k_list = [_effective_top_k(p, vocab) for p in params]
    top_k = _to_device(top_k_list, torch.long, device)
    top_p = _to_device([p.top_p for p in params], scaled.dtype, device)
    min_p = _to_device([p.min_p for p in params], scaled.dtype, device)
    # Top-k rows are bounded by their k; the others start from a guess and widen up to the full sort.
    bounded_k = [k for k in top_k_list if k < vocab]
    unbounded = len(bounded_k) < n
    widest_k = max(bounded_k, default=0)
    if unbounded:
        widths = sorted({min(vocab, max(widest_k, w)) for w in _CANDIDATE_WIDTHS} | {vocab})
    else:
        widths = [widest_k]

    full_totals = None
    if unbounded:
        # The mass of the whole row, which top-p of a row without top-k is measured against. A cumulative
        # sum (not `sum`) so that the value is the same whatever the batch around this row looks like.
        full_totals = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values).cumsum(dim=-1)[:, -1]

    for width in widths:
        if width < vocab:
            values, ids = scaled.topk(width, dim=-1)
        else:
            values, ids = scaled.sort(dim=-1, descending=True)
        keep = _keep_mask(values, top_k, top_p, min_p, top_k < vocab, full_totals)
        # A row keeps every token it needs iff its last candidate is cut (all lower ones then are too) or
        # its top-k already lies within the candidates.
        if width == vocab or not bool((keep[:, -1] & (top_k > width)).any()):
            break
    positions = _draw(values, keep, uniforms)
    return ids.gather(1, positions[:, None]).squeeze(1)


def _keep_mask(
    values: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, bounded: Tensor, full_totals: Tensor | None
) -> Tensor:
    """Which of the sorted candidates [n, W] survive top-k, then top-p, then min-p; always a prefix."""
    width = values.shape[1]
    positions = torch.arange(width, device=values.device)
    keep = positions[None, :] < top_k[:, None]

    # Weights relative to the best token; the mass top-p measures against is what top-k left, or the whole
    # row where top-k is off (the candidates may then be only the head of the row).
    weights = torch.exp(values - values[:, :1]).masked_fill(~keep, 0.0)
    cumulative = weights.cumsum(dim=-1)
    total = cumulative.gather(1, (top_k.clamp(max=width) - 1)[:, None]).squeeze(1)  # bounded rows: k <= width
    if full_totals is not None:
        # Rows without top-k always measure against the vocabulary-order total, even when the candidates
        # span the whole row, so their cut never depends on how wide the batch made the candidate set.
        total = torch.where(bounded, total, full_totals)
    # Nucleus: keep a token while the mass before it is still short of top_p; the best token always stays.
    # top_p == 1 is off outright, so rounding in the sums can never cut the tail.
    mass_before = cumulative - weights
    keep &= (mass_before < top_p[:, None] * total[:, None]) | (top_p[:, None] >= 1.0)
    keep[:, 0] = True
    # min-p in log space: p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps all.
    keep &= values >= values[:, :1] + torch.log(min_p)[:, None]
    return keep


def _draw(values: Tensor, keep: Tensor | None, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draw of one position per row from exp(values) restricted to `keep`."""
    weights = torch.exp(values - values.max(dim=-1, keepdim=True).values)
    if keep is not None:
        weights = weights.masked_fill(~keep, 0.0)
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1:]
    # u < total strictly (u * total can round up to total), so the search lands on a token of positive weight:
    # the first position whose cumulative sum exceeds u has weight > 0 by construction.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1)


def logprob_records(logits: Tensor, chosen: Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """Per row: log_softmax(logits)[chosen] and the row's top-n (id, logprob), best first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp: list[float] = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    chosen_ids: list[int] = chosen.tolist()
    n_max = min(max(top_n, default=0), logits.shape[1])
    top_values: list[list[float]] = [[] for _ in top_n]
    top_ids: list[list[int]] = [[] for _ in top_n]
    if n_max > 0:
        values, ids = logprobs.topk(n_max, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(token_id=t, logprob=lp, top=list(zip(ids_row[:n], values_row[:n])))
        for t, lp, n, ids_row, values_row in zip(chosen_ids, chosen_lp, top_n, top_ids, top_values)
    ]
