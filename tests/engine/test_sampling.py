"""Sampler: every knob against an independent float64 / pure-Python reference written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vegaserve.engine.request import SamplingParams
from vegaserve.engine.sampling import Sampler, adjust_logits, greedy_argmax

# ---------------------------------------------------------------------------------------------- helpers


def run(logits: torch.Tensor, params: list[SamplingParams], prompt=None, output=None, generators=None):
    batch = logits.shape[0]
    return Sampler().sample(
        logits,
        params,
        prompt if prompt is not None else [[] for _ in range(batch)],
        output if output is not None else [[] for _ in range(batch)],
        generators if generators is not None else [None] * batch,
    )


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> np.ndarray:
    """n independent draws from one distribution, as one batch of n identical unseeded rows."""
    torch.manual_seed(seed)
    batch = logits_row[None, :].expand(n, -1).contiguous()
    return np.array(run(batch, [params] * n).token_ids)


def softmax64(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def logits_for(probs: list[float], permutation_seed: int = 3) -> tuple[torch.Tensor, np.ndarray]:
    """Logits whose softmax is `probs`, placed at shuffled ids so order in the vocabulary means nothing."""
    perm = np.random.default_rng(permutation_seed).permutation(len(probs))
    logits = np.empty(len(probs))
    logits[perm] = np.log(probs)
    return torch.tensor(logits, dtype=torch.float32), perm  # perm[j] = id of the j-th listed prob


def nucleus_ref(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    n = int(np.searchsorted(cumulative, top_p)) + 1  # first position whose running mass reaches top_p
    return set(order[:n].tolist())


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Upper 0.1% points of chi-square: a correct sampler fails a check about once in a thousand seeds, and with
# fixed seeds the outcome is deterministic.
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_is_argmax_with_lowest_id_on_ties():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g)
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1.0  # a tie: the lower id must win
    result = run(logits, [SamplingParams(temperature=0.0)] * 5)
    rows = logits.tolist()
    expected = [max(range(300), key=lambda i, r=r: (r[i], -i)) for r in rows]
    assert result.token_ids == expected
    assert result.token_ids[2] == 17


@pytest.mark.parametrize("vocab", [128256, 49152, 8192 * 3, 1000])
def test_two_pass_argmax_matches_argmax_with_lowest_id_on_ties(vocab: int):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    top = logits.max() + 1.0
    logits[0, 5] = logits[0, vocab - 3] = top  # a tie across the first and last runs
    logits[1, 100] = logits[1, 101] = top  # a tie inside one run (100 and 101 share every run of 128 or more)
    logits[2, vocab - 1] = top  # the maximum at the very end
    logits[3] = 0.0  # all equal: id 0
    assert greedy_argmax(logits).tolist() == [5, 100, vocab - 1, 0]
    assert greedy_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_whatever_the_temperature():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 500, generator=g)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.3, 0.7, 1.0, 1.3, 2.0, 5.0, 10.0, 0.01)]
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    assert run(logits, params, generators=gens).token_ids == logits.argmax(dim=-1).tolist()


# ------------------------------------------------------------------------------------ bias and penalties


def test_logit_bias_forces_one_token_and_forbids_another():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0.5, -1.0]])
    vocab = logits.shape[1]
    # +100 on the worst token makes it the greedy choice; out-of-range ids are ignored, not a crash.
    forced = SamplingParams(temperature=0.0, logit_bias={5: 100.0, vocab: 50.0, vocab + 1000: -5.0})
    assert run(logits, [forced]).token_ids == [5]
    # -100 on the best token removes it even when sampling.
    forbidden = SamplingParams(temperature=1.0, logit_bias={1: -100.0})
    draws = draw_many(logits[0], forbidden, 4000)
    assert 1 not in set(draws.tolist())
    assert {0, 2, 3, 4, 5} <= set(draws.tolist())


def reference_adjust(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The brief's rules one token at a time, in order: bias, repetition, presence/frequency."""
    out = list(row)
    for token, bias in p.logit_bias.items():
        if 0 <= token < len(out):
            out[token] += bias
    in_vocab = set(range(len(out)))  # ids the model's head lacks change nothing
    for token in (set(prompt) | set(output)) & in_vocab:
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(output) & in_vocab:
        count = output.count(token)
        out[token] -= p.presence_penalty + p.frequency_penalty * count
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(presence_penalty=-1.5, frequency_penalty=1.9),
        SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias={3: 2.5, 7: -4.0, 11: 0.5}),
    ],
    ids=["rep>1", "rep<1", "pres+freq", "signs", "all-in-order"],
)
def test_penalties_match_per_token_reference(params: SamplingParams):
    g = torch.Generator().manual_seed(4)
    vocab = 40
    logits = torch.randn(3, vocab, generator=g) * 3  # both signs of logit among the seen tokens
    prompts = [[1, 3, 3, 7, 20, vocab + 3], [], [5, 5, 5, 11, 39]]
    outputs = [[3, 7, 7, 7, 9], [2, 2, 11, 0, vocab], []]
    adjusted = adjust_logits(logits, [params] * 3, prompts, outputs)
    for r in range(3):
        expected = reference_adjust(logits[r].tolist(), params, prompts[r], outputs[r])
        np.testing.assert_allclose(adjusted[r].numpy(), np.array(expected), rtol=1e-6, atol=1e-6)
    signs = {bool(logits[r, t] > 0) for r in range(3) for t in prompts[r] + outputs[r] if t < vocab}
    assert signs == {True, False}  # the case really covers positive and negative logits
    # The sampler acts on the adjusted logits: greedy follows the reference's argmax.
    greedy = SamplingParams(**{**params.__dict__, "temperature": 0.0})
    expected_tokens = [int(np.argmax(reference_adjust(logits[r].tolist(), params, prompts[r], outputs[r])))
                       for r in range(3)]
    assert run(logits, [greedy] * 3, prompts, outputs).token_ids == expected_tokens


def test_penalties_leave_the_callers_logits_untouched():
    logits = torch.randn(2, 30)
    before = logits.clone()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, logit_bias={2: 9.0})
    run(logits, [params] * 2, [[1, 2], [3]], [[4], [5, 5]])
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------------------------ filters


def test_top_k_samples_exactly_the_k_best():
    probs = [0.3, 0.25, 0.2, 0.1, 0.08, 0.07]
    logits, ids = logits_for(probs)
    draws = set(draw_many(logits, SamplingParams(top_k=3), 3000).tolist())
    assert draws == set(ids[:3].tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_top_p_samples_exactly_the_nucleus(temperature: float):
    probs = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    logits, _ = logits_for(probs)
    top_p = 0.75  # T=1: 0.40, 0.65, 0.80 -> three tokens; T=0.5 sharpens the head -> two tokens
    nucleus = nucleus_ref(softmax64(logits.numpy() / temperature), top_p)
    draws = set(draw_many(logits, SamplingParams(temperature=temperature, top_p=top_p), 4000).tolist())
    assert draws == nucleus
    assert len(nucleus) == (3 if temperature == 1.0 else 2)


def test_top_p_nucleus_wider_than_the_first_candidates():
    # ~350 of 600 tokens in the nucleus: more than the first topk guess, so the full sort path runs.
    vocab = 600
    logits = torch.linspace(2.0, 0.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))]
    top_p = 0.8
    probs = softmax64(logits.numpy())
    nucleus = nucleus_ref(probs, top_p)
    running = np.cumsum(np.sort(probs)[::-1])
    assert np.abs(running - top_p).min() > 1e-5  # no token sits on the boundary within float32 rounding
    assert len(nucleus) > 300
    draws = set(draw_many(logits, SamplingParams(top_p=top_p), 12000).tolist())
    assert draws == nucleus


@pytest.mark.parametrize("top_p", [0.2, 0.8], ids=["nucleus-760", "nucleus-4707"])
def test_top_p_reaches_the_whole_nucleus_at_every_candidate_width(top_p: float):
    # V=8000: a nucleus of 760 needs the middle candidate width, one of 4707 the full sort.
    vocab = 8000
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(14))
    logits = torch.empty(vocab)
    logits[order] = torch.linspace(2.0, 0.0, vocab)  # order[r] is the id of rank r
    probs = softmax64(logits.numpy())
    nucleus = nucleus_ref(probs, top_p)
    running = np.cumsum(np.sort(probs)[::-1])
    assert np.abs(running - top_p).min() > 5e-6
    draws = draw_many(logits, SamplingParams(top_p=top_p), 800, seed=15)
    assert set(draws.tolist()) <= nucleus
    rank_of = torch.empty(vocab, dtype=torch.long)
    rank_of[order] = torch.arange(vocab)
    # Draws reach the far end of the nucleus, so the candidates were not cut short.
    assert int(rank_of[torch.from_numpy(draws)].max()) >= 0.95 * len(nucleus)


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    probs = [0.5, 0.2, 0.12, 0.1, 0.05, 0.03]
    logits, ids = logits_for(probs)
    min_p = 0.22  # threshold 0.11: keeps 0.5, 0.2, 0.12
    kept = {int(ids[j]) for j, p in enumerate(probs) if p >= min_p * max(probs)}
    draws = set(draw_many(logits, SamplingParams(min_p=min_p), 4000).tolist())
    assert draws == kept and len(kept) == 3


# ----------------------------------------------------------------------------------------- distributions


def test_temperature_sampling_matches_softmax_over_temperature():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    temperature = 0.7
    draws = draw_many(logits, SamplingParams(temperature=temperature), 20000, seed=11)
    counts = np.bincount(draws, minlength=6)
    assert chi_square(counts, softmax64(logits.numpy() / temperature)) < CHI2_999[5]


def test_seeded_draws_follow_the_distribution_too():
    logits = torch.tensor([[0.5, 1.5, -0.3, 0.9, 0.0]])
    gen = torch.Generator().manual_seed(12)
    sampler = Sampler()
    draws = [sampler.sample(logits, [SamplingParams()], [[]], [[]], [gen]).token_ids[0] for _ in range(3000)]
    counts = np.bincount(draws, minlength=5)
    assert chi_square(counts, softmax64(logits[0].numpy())) < CHI2_999[4]


def test_filtered_draws_follow_the_renormalized_distribution():
    probs = [0.3, 0.25, 0.2, 0.1, 0.08, 0.07]
    logits, ids = logits_for(probs)
    draws = draw_many(logits, SamplingParams(top_k=4, top_p=0.99), 20000, seed=13)
    counts = np.bincount(draws, minlength=6)[ids[:4]]
    head = np.array(probs[:4])
    assert chi_square(counts, head / head.sum()) < CHI2_999[3]


# ------------------------------------------------------------------------------------------------- seeds


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    vocab = 2000
    rows = torch.randn(30, vocab, generator=torch.Generator().manual_seed(6)) * 2.5
    mine = SamplingParams(temperature=0.9, top_p=0.9)
    neighbours = [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(top_k=900, presence_penalty=1.0), None),  # widens the shared candidate set
        (SamplingParams(top_p=0.999), torch.Generator().manual_seed(99)),  # forces the full sort
        (SamplingParams(), None),  # an unfiltered row
    ]
    alone_tokens, batched_tokens = [], []
    for seed, row in enumerate(rows):
        alone = run(row[None, :], [mine], generators=[torch.Generator().manual_seed(seed)]).token_ids[0]
        other = torch.randn(len(neighbours), vocab)
        for position in (0, len(neighbours)):
            batch = torch.cat([other[:position], row[None, :], other[position:]])
            params = [p for p, _ in neighbours]
            gens = [g for _, g in neighbours]
            params.insert(position, mine)
            gens.insert(position, torch.Generator().manual_seed(seed))
            outputs = [[1, 2, 3]] * (len(neighbours) + 1)
            batched_tokens.append(run(batch, params, output=outputs, generators=gens).token_ids[position])
            alone_tokens.append(alone)
    assert batched_tokens == alone_tokens
    assert len(set(alone_tokens)) > 10  # the seeds really drive different draws


def test_same_seed_gives_the_same_sequence():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=1.2, top_k=50, min_p=0.01)]

    def sequence(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [run(logits, params, generators=[gen]).token_ids[0] for _ in range(20)]

    assert sequence(3) == sequence(3)
    assert sequence(3) != sequence(4)


# --------------------------------------------------------------------------------------------- logprobs


def log_softmax64(row) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def test_logprobs_come_from_the_raw_logits_with_top_n_best_first():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(8)) * 2
    params = [
        # Everything that reshapes the distribution is on; the reported logprobs must ignore all of it.
        SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.7, logit_bias={9: 30.0}, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    result = run(logits, params, prompt=[[9, 1], [], []], output=[[2], [], []],
                 generators=[torch.Generator().manual_seed(1), None, None])
    assert result.logprobs[2] is None
    for r, n in ((0, 4), (1, 0)):
        reference = log_softmax64(logits[r].numpy())
        record = result.logprobs[r]
        assert record is not None and record.token_id == result.token_ids[r]
        assert record.logprob == pytest.approx(reference[record.token_id], abs=1e-5)
        best = np.argsort(-reference, kind="stable")[:n]
        assert [i for i, _ in record.top] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in record.top], reference[best], atol=1e-5)
    assert result.token_ids[0] == 9  # the bias did steer the choice while logprobs stayed raw


def test_prompt_logprobs_score_each_token_under_the_previous_position():
    length, vocab, n = 300, 50, 3  # longer than one chunk of rows
    logits = torch.randn(length, vocab, generator=torch.Generator().manual_seed(9))
    prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(10)).tolist()
    records = Sampler().prompt_logprobs(logits, prompt, n)
    assert len(records) == length and records[0] is None
    for i in (1, 2, 255, 256, 257, length - 1):
        reference = log_softmax64(logits[i - 1].numpy())
        record = records[i]
        assert record is not None and record.token_id == prompt[i]
        assert record.logprob == pytest.approx(reference[prompt[i]], abs=1e-5)
        assert [t for t, _ in record.top] == np.argsort(-reference, kind="stable")[:n].tolist()


def test_mismatched_batch_lists_are_rejected():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [[]], [[]], [None])


def test_draw_uniforms_takes_one_number_from_each_seeded_generator_in_one_copy():
    """Each seeded row gets its own generator's next number (what torch.rand(1, generator=g) gives), the
    generator advanced by exactly one; unseeded rows share the default generator; all-seeded and
    all-unseeded batches take the shortcuts with the same numbers."""
    from vegaserve.engine.sampling import draw_uniforms

    seeds = [3, None, 7, None, 11, 3]
    gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    want = {i: float(torch.rand(1, generator=torch.Generator().manual_seed(s))[0]) for i, s in enumerate(seeds) if s}
    got = draw_uniforms(gens, torch.device("cpu"))
    assert got.shape == (6,) and bool(((got >= 0) & (got < 1)).all())
    assert all(float(got[i]) == v for i, v in want.items())
    second = {i: float(torch.rand(2, generator=torch.Generator().manual_seed(s))[1]) for i, s in enumerate(seeds) if s}
    again = draw_uniforms(gens, torch.device("cpu"))
    assert all(float(again[i]) == v for i, v in second.items())  # one number each, no more
    every = [torch.Generator().manual_seed(s) for s in (5, 6)]
    assert draw_uniforms(every, torch.device("cpu")).tolist() == [
        float(torch.rand(1, generator=torch.Generator().manual_seed(s))[0]) for s in (5, 6)]
    torch.manual_seed(0)
    a = draw_uniforms([None, None], torch.device("cpu"))
    torch.manual_seed(0)
    assert torch.equal(a, torch.rand(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream synchronization is a GPU matter")
def test_a_sampled_batch_is_queued_without_waiting_for_the_device():
    """Greedy, temperature, seeded, logit-biased and grammar-masked rows side by side: the draw queues its
    work behind the step's without one synchronizing call (torch's sync debug mode raises on any), so async
    decode can queue the next step at once; and it draws what the same batch draws on the CPU with the same
    seeds."""
    from vegaserve.engine.sampling import TokenMasks

    torch.manual_seed(0)
    logits = torch.randn(5, 3000) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=0.6, seed=4, logit_bias={17: 5.0}), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.0, logit_bias={2: 100.0})]
    bitmask = torch.zeros(5, 90, dtype=torch.int32)  # 2,880 ids: a vocabulary wider than the mask (padded rows)
    bitmask[3, :4] = -1  # row 3 may only take ids 0-127
    sampler = Sampler()

    # the inputs are where a step has them before the draw: the logits and the mask on the device (the mask's
    # copy from its pinned buffer is the filler's, grammar.PendingMasks.wait)
    inputs = {d: (logits.to(d), bitmask.to(d)) for d in ("cpu", "cuda")}

    def draw(device: str) -> list[int]:
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        device_logits, device_mask = inputs[device]
        return sampler.draw(device_logits.clone(), params, [[]] * 5, [[]] * 5, gens, TokenMasks(device_mask, [3]))

    want = draw("cpu").tolist()
    draw("cuda")  # the pinned host blocks the copies come from, allocated once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = draw("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tokens.tolist() == want and want[3] < 128
