"""Speculative decoding (engine/speculative.py): what the proposers guess, that verification keeps exactly
what plain decoding would give (greedy: token for token on the embedded model; sampling: the same
distribution by a chi-square test), and that the KV blocks of rejected guesses go back."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vegaserve.engine import speculative
from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.kv_cache import BlockPool, BlockTable
from vegaserve.engine.request import GenerateRequest, SamplingParams
from vegaserve.engine.sampling import Sampler, probabilities
from vegaserve.engine.scheduler import Request
from vegaserve.engine.speculative import NgramProposer, check_same_vocabulary, verify


def _request(ids: list[int], prompt_len: int | None = None, rid: str = "r") -> Request:
    p = len(ids) if prompt_len is None else prompt_len
    r = Request(rid, ids[:p], SamplingParams(), max_new_tokens=100)
    r.output_ids = ids[p:]
    return r


# -- proposers ------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_last_earlier_occurrence_of_the_longest_matching_suffix():
    prop = NgramProposer(3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    ids = [5, 1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 8, 1, 2, 3]
    # suffix (1, 2, 3) last ended at 9 before the end: what followed is 4, 8, 1, ...
    assert prop.propose([_request(ids)], [3]) == [[4, 8, 1]]
    # the proposal never runs past the request's own last token
    assert prop.propose([_request(ids, rid="s")], [20]) == [[4, 8, 1, 2, 3]]


def test_ngram_falls_back_to_shorter_suffixes_and_proposes_nothing_without_a_match():
    prop = NgramProposer(4)
    assert prop.propose([_request([1, 2, 7, 6, 5, 2, 7])], [2]) == [[6, 5]]  # only (2, 7) matches
    assert prop.propose([_request([1, 2, 3, 4, 5, 6], rid="b")], [4]) == [[]]
    assert prop.propose([_request([4], rid="c")], [4]) == [[]]


def test_ngram_index_follows_the_request_as_it_grows_across_prompt_and_output():
    prop = NgramProposer(3)
    r = _request([10, 11, 12, 13, 10, 11], prompt_len=3)
    assert prop.propose([r], [2]) == [[12, 13]]
    r.output_ids += [12, 99, 10, 11, 12]  # (10, 11, 12) now last ended at position 8: then came 99
    assert prop.propose([r], [2]) == [[99, 10]]
    prop.forget("r")
    assert "r" not in prop.index


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes():
    with pytest.raises(ConfigError, match="has 3 tokens, the target's 4"):
        check_same_vocabulary(["a", "b", "c"], ["a", "b", "c", "d"], "draft.gguf")
    with pytest.raises(ConfigError, match="token 1 is 'x', the target's 'b'"):
        check_same_vocabulary(["a", "x"], ["a", "b"], "draft.gguf")
    check_same_vocabulary(["a", "b"], ["a", "b"], "draft.gguf")


# -- configuration --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tree", "says"),
    [
        ({"type": "ngram", "draft_max": 0}, "--draft-max must be at least 1, got 0"),
        ({"type": "draft"}, "--spec-type draft needs a draft model"),
        ({"type": "ngram", "draft_model": "d.gguf"}, "-md (a draft model) needs --spec-type draft"),
        ({"type": "ngram", "draft_max": 2, "draft_min": 3}, "--draft-min 3 exceeds --draft-max 2"),
        ({"type": "medusa"}, "--spec-type must be none, ngram, draft or draft-mtp"),
        ({"type": "ngram", "ngram_size": 1}, "--spec-ngram-size-n must be at least 2"),
    ],
)
def test_speculative_settings_that_cannot_work_are_refused(tree, says):
    with pytest.raises(ConfigError, match=rf"^{__import__('re').escape(says)}"):
        EngineConfig.from_dict({"speculative": tree})


def test_each_type_has_its_documented_default_draft_length():
    assert {t: EngineConfig.from_dict({"speculative": {"type": t, **({"draft_model": "d"} if t == "draft" else {})}})
            .speculative.max_draft for t in ("ngram", "draft", "draft-mtp")} == {"ngram": 8, "draft": 16, "draft-mtp": 2}


# -- KV rollback ----------------------------------------------------------------------------------------
def test_truncate_gives_back_the_blocks_wholly_past_the_kept_positions():
    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    table.append_slots(13)  # 4 blocks
    assert pool.num_free == 4
    table.truncate(6)  # positions 0..5: blocks 0 and 1
    assert (table.num_slots, len(table.block_ids), pool.num_free) == (6, 2, 6)
    table.truncate(9)  # never grows
    assert table.num_slots == 6
    table.append_slots(3)
    assert len(table.block_ids) == 3


# -- verification ---------------------------------------------------------------------------------------
def _logits_for(best: list[int], vocab: int = 10) -> torch.Tensor:
    rows = torch.randn(len(best), vocab)
    for r, b in enumerate(best):
        rows[r, b] = 10.0
    return rows


def test_greedy_verification_keeps_the_guesses_up_to_the_first_miss_then_the_targets_own_token():
    torch.manual_seed(0)
    # rows: seq A (3 guesses) rows 0..3, a plain row 4 nobody verifies, seq B (2 guesses) rows 5..7
    logits = torch.cat([_logits_for([4, 5, 6, 7]), _logits_for([0]), _logits_for([1, 2, 3])])
    greedy = SamplingParams(temperature=0, logprobs=1)
    out = verify(logits, [0, 5], [[4, 5, 9], [1, 2]], [greedy, SamplingParams(temperature=0)],
                 [[0], [0]], [[], []], [None, None])
    assert out[0].token_ids == [4, 5, 6] and out[0].accepted == 2
    assert out[1].token_ids == [1, 2, 3] and out[1].accepted == 2
    # logprobs of every emitted token, from its own row's raw logits
    lp = [e.logprob for e in out[0].logprobs]
    ref = torch.log_softmax(logits[0:3], dim=-1)[[0, 1, 2], [4, 5, 6]].tolist()
    assert lp == pytest.approx(ref, abs=1e-6)
    assert out[1].logprobs == [None, None, None]


def test_greedy_verification_sees_earlier_guesses_in_the_penalties():
    # guess 0 is token 3; the repetition penalty on row 1 then pushes token 3 below token 2
    logits = torch.zeros(3, 5)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 2] = 2.0, 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = verify(logits, [0], [[3, 3]], [params], [[0]], [[]], [None])
    assert out[0].token_ids == [3, 2]


def test_probabilities_match_what_the_sampler_draws():
    torch.manual_seed(1)
    logits = torch.randn(3, 12) * 2
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4, top_p=0.8),
              SamplingParams(temperature=0.9, min_p=0.2)]
    probs = probabilities(logits, params)
    n = 20000
    draws = Sampler().draw(logits.repeat_interleave(n, 0), [p for p in params for _ in range(n)],
                           [[0]] * (3 * n), [[]] * (3 * n), [None] * (3 * n)).view(3, n)
    for r in range(3):
        freq = torch.bincount(draws[r], minlength=12).float() / n
        assert torch.allclose(freq, probs[r], atol=0.015), (r, freq, probs[r])
        assert bool(((probs[r] == 0) == (freq == 0)).all())


# The tiny model of the distribution test: a bigram table over 6 tokens. The drafts are the argmax chain
# of another table, so some guesses are kept and some are not.
_V = 6
_DRAWS = 20000
_STEPS = 3


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(_V, _V, generator=g) * 1.5, torch.randn(_V, _V, generator=g)


def _plain_draws(target: torch.Tensor, params: SamplingParams) -> list[tuple[int, ...]]:
    last = torch.zeros(_DRAWS, dtype=torch.long)
    seqs = []
    sampler = Sampler()
    for _ in range(_STEPS):
        last = sampler.draw(target[last], [params] * _DRAWS, [[0]] * _DRAWS, [[]] * _DRAWS, [None] * _DRAWS)
        seqs.append(last)
    return [tuple(t) for t in torch.stack(seqs, 1).tolist()]


def _speculative_draws(target: torch.Tensor, guide: torch.Tensor, params: SamplingParams) -> list[tuple[int, ...]]:
    out: list[list[int]] = [[] for _ in range(_DRAWS)]
    while True:
        todo = [i for i in range(_DRAWS) if len(out[i]) < _STEPS]
        if not todo:
            return [tuple(o[:_STEPS]) for o in out]
        rows, firsts, drafts = [], [], []
        for i in todo:
            last = out[i][-1] if out[i] else 0
            d = []
            for _ in range(_STEPS - len(out[i])):
                d.append(int(guide[d[-1] if d else last].argmax()))
            firsts.append(len(rows))
            rows.extend([last, *d])
            drafts.append(d)
        res = verify(target[torch.tensor(rows)], firsts, drafts, [params] * len(todo), [[0]] * len(todo),
                     [out[i] for i in todo], [None] * len(todo))
        for i, v in zip(todo, res, strict=True):
            out[i].extend(v.token_ids)


def _chi_square_p(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """p-value of the two-sample chi-square test that a and b come from one distribution; outcomes seen
    fewer than 10 times in both together share one bin."""
    ca, cb = Counter(a), Counter(b)
    keys = set(ca) | set(cb)
    big = [k for k in keys if ca[k] + cb[k] >= 10]
    bins = [(ca[k], cb[k]) for k in big]
    small = [k for k in keys if k not in big]
    if small:
        bins.append((sum(ca[k] for k in small), sum(cb[k] for k in small)))
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in bins:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05)],
                         ids=["t0.8", "t0.8-top_p-min_p"])
def test_speculative_sampling_draws_the_next_tokens_from_the_targets_distribution(params):
    torch.manual_seed(1234)
    target, guide = _tables()
    plain = _plain_draws(target, params)
    spec = _speculative_draws(target, guide, params)
    p = _chi_square_p(plain, spec)
    assert p > 0.01, f"chi-square p = {p:.2e}: speculative draws differ from plain sampling"
    # the test has power: a wrong acceptance rule (keep x with probability sqrt p(x)) is caught
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative, "_keep", lambda u, p_guess: u < p_guess.sqrt())
        torch.manual_seed(1234)
        wrong = _speculative_draws(target, guide, params)
    assert _chi_square_p(plain, wrong) < 0.01


def test_seeded_speculative_sampling_is_reproducible():
    target, guide = _tables()
    params = SamplingParams(temperature=0.8, seed=5)

    def run() -> list[int]:
        g = torch.Generator().manual_seed(5)
        return verify(target[torch.tensor([0, 1, 2])], [0], [[1, 2]], [params], [[0]], [[]], [g])[0].token_ids

    assert run() == run()


# -- the engine: exact under continuous batching ---------------------------------------------------------
_PROMPTS = [
    ("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.", 40, ()),
    ("Count from one to twenty in words.", 48, ()),
    ("Write the alphabet in capital letters separated by commas.", 40, ()),
    ("Say 'hello world' five times.", 30, ("world!",)),
    ("What is the capital of France?", 20, ()),
    ("List the days of the week.", 7, ()),  # max_tokens cuts a draft short
    ("Repeat after me: red green blue red green blue red green blue", 33, ("blue red",)),
    ("Write a haiku about the sea.", 24, ()),
    ("def fib(n):", 40, ("return",)),
    ("1, 2, 3, 4, 5, 6,", 30, ()),
    ("Translate 'good morning' to French.", 16, ()),
    ("The quick brown fox jumps over the lazy dog. The quick brown fox", 25, ()),
    ("Name three primary colors.", 5, ()),
    ("Spell the word banana letter by letter.", 30, ("n",)),
    ("Write the numbers from 10 down to 1.", 36, ()),
    ("Copy this line twice: to be or not to be", 32, ()),
    ("What is 2 + 2?", 12, ()),
    ("Give me a list of five fruits.", 40, ("Banana",)),
    ("a b c d e f g a b c d e f g a b c", 19, ()),
    ("Tell me a short joke.", 28, ()),
]


def _run_all(core) -> dict[int, list[int]]:
    reqs = []
    for i, (text, max_tokens, stop) in enumerate(_PROMPTS):
        ids = core.tokenizer.encode(core.chat_template.render([{"role": "user", "content": text}]))
        r = GenerateRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop), request_id=f"p{i}")
        reqs.append(r)
        core.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    text: dict[str, str] = {r.request_id: "" for r in reqs}
    while core.has_work:
        for out in core.step():
            got[out.request_id].extend(out.token_ids)
            text[out.request_id] += out.text
    return {i: (got[f"p{i}"], text[f"p{i}"]) for i in range(len(_PROMPTS))}


@pytest.fixture(scope="module")
def plain_outputs():
    from vegaserve.engine.engine_core import EngineCore

    core = EngineCore(EngineConfig.from_dict(_CORE), show_progress=False)
    return _run_all(core)


_CORE = {"cache": {"context_size": 512}, "scheduler": {"max_num_seqs": 20}, "device": "cpu"}


@pytest.mark.parametrize("spec", [{"type": "ngram"}, {"type": "draft", "draft_max": 6}], ids=["ngram", "draft"])
def test_greedy_outputs_with_speculation_equal_those_without_token_for_token(plain_outputs, spec):
    from vegaserve.engine.engine_core import EngineCore
    from vegaserve.engine.gguf_file import default_model_path

    if spec["type"] == "draft":  # the embedded model drafting for itself
        spec = {**spec, "draft_model": str(default_model_path())}
    core = EngineCore(EngineConfig.from_dict({**_CORE, "speculative": spec}), show_progress=False)
    outputs = _run_all(core)
    for i, (text, max_tokens, stop) in enumerate(_PROMPTS):
        assert outputs[i] == plain_outputs[i], f"prompt {i} ({text!r}) differs with {spec['type']} speculation"
    st = core.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens > 0
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    if spec["type"] == "draft":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens  # a model agrees with itself
    # every rejected guess's blocks went back: nothing held once all requests are done
    assert core.pool.num_referenced == 0
    # max_tokens and stop strings held exactly where they cut
    assert any(len(outputs[i][0]) == _PROMPTS[i][1] for i in range(len(_PROMPTS)))
    core.close()


@pytest.fixture
def no_model_loads(monkeypatch):
    """EngineCore fails the test if it gets as far as loading the model's weights."""
    import vegaserve.engine.engine_core as engine_core

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the speculative setup was refused")

    monkeypatch.setattr(engine_core, "start_executor", refuse)


def test_draft_mtp_on_a_model_without_an_mtp_head_is_one_line_before_the_model_loads(no_model_loads):
    from vegaserve.engine.engine_core import EngineCore

    with pytest.raises(ConfigError, match=r"needs an MTP \(NextN\) head, and this model has none"):
        EngineCore(EngineConfig.from_dict({**_CORE, "speculative": {"type": "draft-mtp"}}), show_progress=False)


def test_a_draft_of_another_vocabulary_is_one_line_naming_both_sizes_before_the_model_loads(no_model_loads):
    from vegaserve.engine.engine_core import EngineCore

    draft = Path(__file__).parents[1] / "data" / "moe" / "qwen3moe-q8_0.gguf"  # a tiny model of its own vocabulary
    spec = {"type": "draft", "draft_model": str(draft)}
    with pytest.raises(ConfigError, match=r"qwen3moe-q8_0\.gguf: the draft model's vocabulary has \d+ tokens, the "
                                          r"target's 49152: a draft model must share the target's vocabulary"):
        EngineCore(EngineConfig.from_dict({**_CORE, "speculative": spec}), show_progress=False)


def test_chi_square_helper_separates_equal_and_different_samples():
    g = torch.Generator().manual_seed(3)
    a = [tuple(x) for x in torch.randint(0, 4, (4000, 1), generator=g).tolist()]
    b = [tuple(x) for x in torch.randint(0, 4, (4000, 1), generator=g).tolist()]
    c = [tuple(x) for x in torch.randint(0, 3, (4000, 1), generator=g).tolist()]
    assert _chi_square_p(a, b) > 0.01
    assert _chi_square_p(a, c) < 1e-6
    assert math.isfinite(_chi_square_p(a, a))


# -- the draft model's bookkeeping, on a fake executor ----------------------------------------------------
class _BigramExecutor:
    """Logits of each sequence's last fed token from a table; records what every step fed."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.fed: list[list[tuple[int, list[int]]]] = []

    def forward(self, plan):
        self.fed.append([(start, list(tokens)) for _, start, tokens in plan.seqs])
        return self.table[torch.tensor([tokens[-1] for _, _, tokens in plan.seqs])]


def _draft_proposer(table: torch.Tensor, p_min: float = 0.0) -> speculative.DraftModelProposer:
    prop = speculative.DraftModelProposer.__new__(speculative.DraftModelProposer)
    prop.executor = _BigramExecutor(table)
    prop.pool = BlockPool(64, 4)
    prop.p_min = p_min
    prop.non_finite = 0
    prop.states = {}
    return prop


def test_the_draft_model_catches_up_drafts_greedily_and_rolls_back_what_was_rejected():
    table = torch.full((6, 6), -5.0)
    for a in range(6):
        table[a, (a + 1) % 6] = 5.0  # the draft counts up: after a comes a + 1
    prop = _draft_proposer(table)
    r = _request([3, 1, 2])
    assert prop.propose([r], [3]) == [[3, 4, 5]]
    # one catch-up step of the whole prompt, then the guesses but the last fed one by one
    assert prop.executor.fed == [[(0, [3, 1, 2])], [(3, [3])], [(4, [4])]]
    assert prop.states["r"].computed == 5
    # the target kept guess 3 only, then said 0: positions 4.. of the draft's cache are stale
    r.output_ids += [3, 0]
    prop.executor.fed.clear()
    assert prop.propose([r], [2]) == [[1, 2]]
    assert prop.executor.fed == [[(4, [0])], [(5, [1])]]
    prop.forget("r")
    assert prop.pool.num_referenced == 0


def test_the_draft_model_stops_below_p_min_and_drops_a_draft_with_non_finite_logits():
    table = torch.zeros(4, 4)
    table[0, 1] = 10.0  # confident after 0, flat after 1
    prop = _draft_proposer(table, p_min=0.75)
    assert prop.propose([_request([2, 0])], [4]) == [[1]]
    bad = table.clone()
    bad[0, 3] = float("nan")
    prop = _draft_proposer(bad)
    assert prop.propose([_request([2, 0], rid="n")], [4]) == [[]]
    assert prop.non_finite == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="verify graphs are captured on a GPU only")
def test_replayed_verify_graphs_equal_eager_verify_steps_on_gpu(gguf_factory, tmp_path):
    """One stream on a tiny random model, 4 guesses a step from a proposer that knows the plain run's tokens
    and gets one of them wrong at a position moving from step to step (a random model's output gives n-grams
    nothing to find): every verify step (5 rows at most, the mat-vec path either way) replayed from the verify
    graphs gives the same greedy tokens as the same engine verifying eagerly, and the graphs were replayed."""
    from vegaserve.engine.engine_core import EngineCore

    path = gguf_factory.write_tiny_gguf(tmp_path / "tiny.gguf", gguf_factory.TinySpec())
    cfg = {"model": {"path": str(path)}, "cache": {"context_size": 512}, "scheduler": {"max_num_seqs": 1},
           "device": "cuda", "speculative": {"type": "ngram", "draft_max": 4}}
    core = EngineCore(EngineConfig.from_dict(cfg), show_progress=False)
    worker = core.runner.executor.worker
    graphs = worker.verify_graphs
    assert graphs is not None and graphs.rows_per_seq == 5 and set(graphs.graphs) == {1}
    replays = []
    run = graphs.run
    graphs.run = lambda *a, **kw: replays.append(1) or run(*a, **kw)

    def greedy(ids: list[int]) -> list[int]:
        r = GenerateRequest(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
        core.add_request(r)
        out = []
        while core.has_work:
            for o in core.step():
                out.extend(o.token_ids)
        return out

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, core.arch.vocab_size, (n,), generator=gen).tolist() for n in (3, 5, 8, 13, 4)]
    plain: dict[tuple[int, ...], list[int]] = {}
    vocab = core.arch.vocab_size

    class Oracle:
        turn = 0

        def propose(self, reqs, ks):
            out = []
            for r, k in zip(reqs, ks, strict=True):
                truth = plain.get(tuple(r.prompt_ids), [])[len(r.output_ids) : len(r.output_ids) + k]
                Oracle.turn += 1
                out.append([(t + 1) % vocab if j == Oracle.turn % (k + 1) else t for j, t in enumerate(truth)])
            return out

        def forget(self, request_id):
            pass

        def close(self):
            pass

    proposer, core.spec.proposer = core.spec.proposer, Oracle()
    plain.update({tuple(p): greedy(p) for p in prompts})  # no guesses while plain is empty
    assert core.stats().spec_num_drafts == 0
    replayed = [greedy(p) for p in prompts]
    assert replays and core.stats().spec_num_accepted_tokens > 0
    worker.verify_graphs = None
    Oracle.turn = 0
    assert [greedy(p) for p in prompts] == replayed
    proposer.close()
    assert core.pool.num_referenced == 0
    core.close()


# -- the MTP proposer's bookkeeping, on a fake block -------------------------------------------------------
class _MtpBlock:
    """A fake MTP block: each row's output hidden state is its input + 1, a sequence's logits the table's
    row of its last token; records each step's (start, tokens) per sequence."""

    def __init__(self, table: torch.Tensor, hidden: int) -> None:
        self.table = table
        model = SimpleNamespace(cfg=SimpleNamespace(hidden_size=hidden), hidden=None)
        self.worker = SimpleNamespace(model=model, device=torch.device("cpu"))
        self.fed: list[list[tuple[int, list[int]]]] = []

    def forward_mtp(self, plan, h):
        self.fed.append([(start, list(tokens)) for _, start, tokens in plan.step.seqs])
        return h + 1, self.table[torch.tensor([tokens[-1] for _, _, tokens in plan.step.seqs])]


def test_the_mtp_proposer_drafts_each_request_greedily_and_drops_one_whose_logits_are_not_finite():
    """Two requests whose newest tokens are 1 and 0; row 0 of the block's logits holds a NaN: the first
    request drafts 2 guesses (the table's argmax chain 1 -> 3 -> 2), the second none, in the same steps; the
    catch-up pairs each position with the hidden state before it (zeros at position 0)."""
    table = torch.zeros(4, 4)
    table[1, 3] = table[3, 2] = 5.0
    table[0, 1] = float("nan")
    block = _MtpBlock(table, hidden=2)
    prop = speculative.MtpProposer(block, block_size=4)
    pool = BlockPool(8, 4)
    reqs = [_request([2, 1], rid="a"), _request([2, 0], rid="b")]
    for r in reqs:
        r.table = BlockTable(pool)
        r.table.append_slots(4)
        r.num_computed = 1  # position 0 computed by the target, its hidden state seen; position 1 the newest
        prop.states[r.request_id] = speculative._MtpState(0, 0, [torch.full((2,), 7.0)])
    assert prop.propose(reqs, [2, 2]) == [[3, 2], []]
    # one catch-up of positions 0..1 for both, then request a's second guess alone
    assert block.fed == [[(0, [2, 1]), (0, [2, 0])], [(2, [3])]]
    assert prop.states["a"].done == 2 and prop.states["a"].h == []
