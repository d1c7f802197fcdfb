"""Async decode (engine_core.py): the next decode step launched on the device-side tokens of the step before
changes nothing a client sees. The same requests run with it on and off on the embedded model (CPU, where
it is off by default: forced here) must give the same tokens, texts and finish reasons, through staggered
lengths, a stop string, EOS, penalties and a seeded draw, while steps really are launched ahead; an abort
while a step runs ahead frees every block."""

from __future__ import annotations

import pytest

from vegaserve.engine.request import GenerateRequest, SamplingParams


@pytest.fixture
def core(smollm2_core):
    saved = smollm2_core.async_decode
    yield smollm2_core
    smollm2_core.async_decode = saved


def _prompt(core, text):
    return core.tokenizer.encode(text, add_special_tokens=False)


def _requests(core):
    chat = _prompt(core, "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
    return [
        GenerateRequest(_prompt(core, "The capital of France is"), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
        GenerateRequest(_prompt(core, "One, two, three,"), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)),
        GenerateRequest(_prompt(core, "def fibonacci(n):"), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                                           stop=("\n\n", "return"))),
        GenerateRequest(chat, SamplingParams(max_tokens=40, temperature=0)),  # ends on EOS
    ]


def _run(core, reqs, async_decode: bool):
    """Every request to its end in one batch; per request: (token ids, text, finish reason), and how many
    steps were launched on device-side tokens."""
    core.async_decode = async_decode
    ahead = 0
    launch = core.runner.launch

    def counting(batch, input_ids=None):
        nonlocal ahead
        ahead += input_ids is not None
        return launch(batch, input_ids)

    core.runner.launch = counting
    try:
        for r in reqs:
            core.add_request(GenerateRequest(list(r.prompt_token_ids), r.params))
        ids = [f"r{i}" for i in range(len(reqs))]
        got = {}
        order = list(core.requests)[-len(reqs):]
        names = dict(zip(order, ids, strict=True))
        while core.has_work:
            for out in core.step():
                toks, text, reason = got.get(names[out.request_id], ([], "", None))
                got[names[out.request_id]] = (toks + list(out.token_ids), text + out.text, out.finish_reason)
    finally:
        core.runner.launch = launch
    return got, ahead


def test_async_decode_gives_the_same_outputs_as_waiting_for_each_step(core):
    reqs = _requests(core)
    sync, ahead_sync = _run(core, reqs, False)
    async_, ahead = _run(core, reqs, True)
    assert ahead_sync == 0 and ahead > 20  # steps really ran ahead (the longest request alone has 24)
    assert async_ == sync
    assert all(reason is not None for _, _, reason in sync.values())
    assert core.pool.num_free == core.pool.num_blocks and not core.requests and core.in_flight is None


def test_steps_run_ahead_while_a_request_waits_for_a_sequence_slot(core):
    """Five requests on four slots: the fifth waits until the shortest ends; meanwhile the running four
    still run ahead (the queue cannot be admitted anyway), and every output is the one without."""
    reqs = _requests(core) + [GenerateRequest(_prompt(core, "Water boils at"),
                                              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    assert len(reqs) > core.scheduler.max_num_seqs
    sync, _ = _run(core, reqs, False)
    waiting_ahead = []
    launch = core.runner.launch

    def watching(batch, input_ids=None):
        if input_ids is not None and core.scheduler.waiting:
            waiting_ahead.append(len(batch.seqs))
        return launch(batch, input_ids)

    core.runner.launch = watching
    try:
        async_, ahead = _run(core, reqs, True)
    finally:
        core.runner.launch = launch
    assert async_ == sync and ahead > 20 and len(waiting_ahead) >= 5


def test_penalties_and_seeded_draws_see_every_earlier_token(core):
    """A step launched ahead is sampled only after the step before was processed: penalties count its
    token, and a seeded request draws the same numbers in the same order."""
    p = _prompt(core, "Once upon a time")
    reqs = [
        GenerateRequest(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                                          frequency_penalty=0.8, presence_penalty=0.5)),
        GenerateRequest(p, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
    ]
    sync, _ = _run(core, reqs, False)
    async_, ahead = _run(core, reqs, True)
    assert ahead > 10 and async_ == sync


def test_abort_while_a_step_runs_ahead_frees_every_block(core):
    core.async_decode = True
    p = _prompt(core, "The capital of France is")
    a = GenerateRequest(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    b = GenerateRequest(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    core.add_request(a)
    core.add_request(b)
    seen = {a.request_id: 0, b.request_id: 0}
    for _ in range(6):
        for out in core.step():
            seen[out.request_id] += len(out.token_ids)
    assert core.in_flight is not None  # a step is out with both requests in it
    core.abort(a.request_id)
    before = seen[a.request_id]
    while core.has_work:
        for out in core.step():
            seen[out.request_id] += len(out.token_ids)
    assert seen[a.request_id] == before and seen[b.request_id] == 50
    assert core.pool.num_free == core.pool.num_blocks and core.in_flight is None
