"""EngineCore on the embedded model: stop rules, limits, logprobs, aborts, and batching that changes nothing."""

from __future__ import annotations

import torch

from vegaserve.engine.request import FinishReason, GenerateRequest, SamplingParams


def run(core, ids, **kw):
    outs = core.generate_sync(GenerateRequest(list(ids), SamplingParams(**kw)))
    return outs, "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]


def prompt(core, text="The capital of France is"):
    return core.tokenizer.encode(text, add_special_tokens=False)


def test_max_tokens_stops_with_length(smollm2_core):
    outs, _, toks = run(smollm2_core, prompt(smollm2_core), max_tokens=5, temperature=0, ignore_eos=True)
    assert len(toks) == 5 and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_generated_tokens == 5 and outs[-1].num_prompt_tokens == len(prompt(smollm2_core))


def test_stop_string_truncates_text_and_finishes_with_stop(smollm2_core):
    _, full, _ = run(smollm2_core, prompt(smollm2_core), max_tokens=20, temperature=0, ignore_eos=True)
    stop = full[8:12]
    outs, text, _ = run(smollm2_core, prompt(smollm2_core), max_tokens=20, temperature=0, ignore_eos=True, stop=(stop,))
    assert text == full[: full.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_stop_token_id_finishes_without_its_text(smollm2_core):
    _, full, toks = run(smollm2_core, prompt(smollm2_core), max_tokens=10, temperature=0, ignore_eos=True)
    stop = toks[3]
    first = toks.index(stop)
    outs, text, got = run(smollm2_core, prompt(smollm2_core), max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
    assert got == toks[: first + 1] and outs[-1].finish_reason is FinishReason.STOP
    assert text == smollm2_core.tokenizer.decode(toks[:first])


def test_eos_ends_generation_unless_ignored(smollm2_core):
    ids = smollm2_core.tokenizer.encode("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    outs, _, toks = run(smollm2_core, ids, max_tokens=200, temperature=0)
    assert outs[-1].finish_reason is FinishReason.STOP and toks[-1] in smollm2_core.tokenizer.stop_token_ids
    assert len(toks) < 200


def test_logprobs_match_log_softmax_of_the_model(smollm2_core):
    ids = prompt(smollm2_core)
    outs, _, toks = run(smollm2_core, ids, max_tokens=1, temperature=0, logprobs=3)
    lp = outs[0].logprobs[0]
    ref = torch.log_softmax(smollm2_core.forward_logits(ids, all_rows=False)[0], -1)
    assert lp.token_id == toks[0] == int(ref.argmax())
    assert abs(lp.logprob - float(ref[toks[0]])) < 1e-5
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_prompt_logprobs_cover_every_prompt_token_across_chunks(smollm2_core):
    ids = prompt(smollm2_core, "one two three four five six seven eight nine ten eleven twelve")
    outs, _, _ = run(smollm2_core, ids, max_tokens=1, temperature=0, prompt_logprobs=2)
    plp = outs[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    assert [p.token_id for p in plp[1:]] == ids[1:]
    assert all(p.logprob <= 0 for p in plp[1:])


def test_batched_requests_generate_what_they_generate_alone(smollm2_core):
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    alone = [run(smollm2_core, prompt(smollm2_core, t), max_tokens=12, temperature=0, ignore_eos=True)[2] for t in texts]
    reqs = [GenerateRequest(prompt(smollm2_core, t), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for t in texts]
    for r in reqs:
        smollm2_core.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while smollm2_core.has_work:
        for o in smollm2_core.step():
            got[o.request_id].extend(o.token_ids)
    assert [got[r.request_id] for r in reqs] == alone


def test_abort_frees_every_block(smollm2_core):
    pool = smollm2_core.pool
    assert pool.num_referenced == 0
    req = GenerateRequest(prompt(smollm2_core), SamplingParams(max_tokens=50, temperature=0))
    smollm2_core.add_request(req)
    smollm2_core.step()
    assert pool.num_referenced > 0
    out = smollm2_core.abort(req.request_id)
    assert out.finish_reason is FinishReason.ABORT
    assert pool.num_referenced == 0 and pool.num_free == pool.num_blocks and not smollm2_core.has_work


def test_a_repeated_prompt_hits_the_prefix_cache_and_generates_the_same_tokens(smollm2_core):
    ids = smollm2_core.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False)
    first = run(smollm2_core, ids, max_tokens=8, temperature=0, ignore_eos=True)[2]
    hits = smollm2_core.pool.hits
    second = run(smollm2_core, ids, max_tokens=8, temperature=0, ignore_eos=True)[2]
    bs = smollm2_core.pool.block_size
    assert smollm2_core.pool.hits - hits == (len(ids) - 1) // bs * bs  # every full block before the last token
    assert second == first


def test_preemption_by_recompute_gives_the_same_tokens():
    from vegaserve.engine.config import EngineConfig
    from vegaserve.engine.engine_core import EngineCore

    # 2 sequences but blocks for only ~1.3 of them: the later one is preempted and recomputed
    core = EngineCore(
        EngineConfig.from_dict({"cache": {"context_size": 128, "block_size": 16, "num_blocks": 5},
                                "scheduler": {"max_num_seqs": 2}, "device": "cpu"}),
        show_progress=False,
    )
    texts = ["The capital of France is", "Once upon a time, in a land far away,"]
    alone = [run(core, prompt(core, t), max_tokens=30, temperature=0, ignore_eos=True)[2] for t in texts]
    reqs = [GenerateRequest(prompt(core, t), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for t in texts]
    for r in reqs:
        core.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while core.has_work:
        for o in core.step():
            got[o.request_id].extend(o.token_ids)
    assert core.scheduler.num_preemptions > 0
    assert [got[r.request_id] for r in reqs] == alone
    assert core.pool.num_referenced == 0


def test_seeded_sampling_repeats(smollm2_core):
    a = run(smollm2_core, prompt(smollm2_core), max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)[2]
    b = run(smollm2_core, prompt(smollm2_core), max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)[2]
    assert a == b


def test_a_split_the_model_cannot_take_is_refused_before_any_worker_starts():
    import pytest

    from vegaserve.engine.config import ConfigError, EngineConfig
    from vegaserve.engine.engine_core import EngineCore

    # SmolLM2-135M has 9 attention heads
    with pytest.raises(ConfigError, match="9 attention heads do not divide over 2 tensor-parallel devices"):
        EngineCore(EngineConfig.from_dict({"parallel": {"split_mode": "tensor", "n_devices": 2}, "device": "cpu"}),
                   show_progress=False)



def test_logits_in_a_mixed_batch_of_8_equal_each_sequence_alone(smollm2_core):
    """4 sequences decoding beside 4 whose prompts are computed in the same step."""
    import torch

    from vegaserve.engine.forward_batch import StepPlan
    from vegaserve.engine.kv_cache import BlockTable

    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,",
             "Les chats sont", "import numpy as np", "Dear Sir or Madam,", "The sky is"]
    seqs = [prompt(smollm2_core, t) for t in texts]
    alone = [smollm2_core.forward_logits(ids) for ids in seqs]
    tables = [BlockTable(smollm2_core.pool) for _ in seqs]
    try:
        # step 1: the first four prompts but their last token; step 2: those last tokens (decode) beside
        # the other four whole prompts (prefill)
        first = []
        for table, ids in zip(tables[:4], seqs[:4]):
            table.append_slots(len(ids) - 1)
            first.append((table.blocks_of(len(ids) - 1), 0, ids[:-1]))
        smollm2_core.executor.forward(StepPlan(first, [False] * 4, smollm2_core.pool.block_size))
        mixed = []
        for table, ids in zip(tables[:4], seqs[:4]):
            table.append_slots(1)
            mixed.append((table.blocks_of(len(ids)), len(ids) - 1, ids[-1:]))
        for table, ids in zip(tables[4:], seqs[4:]):
            table.append_slots(len(ids))
            mixed.append((table.blocks_of(len(ids)), 0, ids))
        logits = smollm2_core.executor.forward(StepPlan(mixed, [False] * 8, smollm2_core.pool.block_size))
    finally:
        for table in tables:
            table.release()
    for row, ref in zip(logits, alone, strict=True):
        assert float((row - ref[-1]).norm() / ref[-1].norm()) < 1e-4


def _warm_up_recorded(core, monkeypatch):
    """core.warm_up() with each step's plan recorded: [(start, new tokens) a sequence] a step."""
    steps = []
    real = core.executor.forward
    monkeypatch.setattr(core.executor, "forward", lambda plan, *a: steps.append(
        [(start, len(tokens)) for _, start, tokens in plan.seqs]) or real(plan, *a))
    assert core.warm_up() == len(steps)
    return steps


def test_the_warm_up_runs_the_prompt_shapes_and_leaves_nothing_behind(smollm2_core, monkeypatch):
    """EngineCore.warm_up (a GPU engine runs it at start): a step of one prompt as long as a step holds
    (2048 tokens), one of 4 prompts of 128 (the 4 sequences), one of a 100-token chunk beside 3 single tokens,
    and that chunk's next 37 after it. Afterwards every block and no prefix-cache query is the pool's as
    before, and a greedy request generates what it generated before the warm-up."""
    core = smollm2_core
    ids = prompt(core)
    before = run(core, ids, max_tokens=8, temperature=0, ignore_eos=True)[2]
    free, queries, hits = core.pool.num_free, core.pool.queries, core.pool.hits
    steps = _warm_up_recorded(core, monkeypatch)
    assert steps == [[(0, 1023)], [(0, 128)] * 4, [(0, 100)] + [(0, 1)] * 3, [(100, 37)]]
    assert (core.pool.num_free, core.pool.queries, core.pool.hits) == (free, queries, hits)
    assert core.pool.num_referenced == 0
    assert run(core, ids, max_tokens=8, temperature=0, ignore_eos=True)[2] == before


def test_the_warm_up_of_a_hybrid_model_gives_back_its_state_slots(converted, monkeypatch):
    """The same on qwen35 (linear attention): each warm-up sequence holds a recurrent-state slot while it
    runs (the chunk's across its two steps) and every slot is free after; a greedy request is unchanged."""
    from pathlib import Path

    core = converted.core(Path(__file__).resolve().parents[1] / "data" / "hybrid", "qwen35")
    ids = [5, 17, 3, 99, 42, 8]
    before = run(core, ids, max_tokens=6, temperature=0, ignore_eos=True)[2]
    slots, free = core.states.num_free, core.pool.num_free
    steps = _warm_up_recorded(core, monkeypatch)
    assert steps == [[(0, 255)], [(0, 128)], [(0, 100)] + [(0, 1)] * 3, [(100, 37)]]
    assert (core.states.num_free, core.pool.num_free) == (slots, free)
    assert run(core, ids, max_tokens=6, temperature=0, ignore_eos=True)[2] == before


def test_copies_of_a_prompt_added_together_compute_it_once_and_each_give_its_tokens(smollm2_core):
    """Four requests of one prompt at once (OpenAI's n): the first computes it, the others wait a step for
    its blocks and adopt them (scheduler.py's hold), and each generates what the prompt alone does."""
    core = smollm2_core
    ids = prompt(core, "A long prompt, so that it fills a few blocks of sixteen tokens: " * 3)
    _, _, alone = run(core, ids, max_tokens=6, temperature=0, ignore_eos=True)
    core.pool.reset_prefix_cache()
    hits = core.pool.hits
    reqs = [GenerateRequest(list(ids), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for _ in range(4)]
    got = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_work:
        for out in core.step():
            got[out.request_id].extend(out.token_ids)
    assert all(toks == alone for toks in got.values()) and len(alone) == 6
    assert core.pool.hits - hits == 3 * ((len(ids) - 1) // 16 * 16) > 0
