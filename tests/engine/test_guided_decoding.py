"""Guided requests in the engine (model_runner.py, output_processor.py) on the embedded model: the output matches
its grammar and ends with it, beside unguided requests that generate exactly what they do without a guided
neighbour, with no mask work in steps that have no guided row; async decode gives the same outputs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vegaserve.engine.request import FinishReason, GenerateRequest, GuideSpec, SamplingParams

SCHEMA = {  # short outputs: a CPU step of the 135M model is the cost of this file
    "type": "object",
    "properties": {
        "country": {"enum": ["France", "Germany", "Italy"]},
        "rank": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["old", "big"]}, "maxItems": 2},
    },
    "required": ["country", "rank", "tags"],
}


@pytest.fixture
def core(smollm2_core):
    saved = smollm2_core.async_decode
    yield smollm2_core
    smollm2_core.async_decode = saved


def _chat(core, text: str) -> list[int]:
    return core.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def _run(core, reqs: list[GenerateRequest], async_decode: bool = False) -> dict[int, tuple[list[int], str, FinishReason]]:
    core.async_decode = async_decode
    ids = {}
    for i, r in enumerate(reqs):
        copy = GenerateRequest(list(r.prompt_token_ids), r.params)
        ids[copy.request_id] = i
        core.add_request(copy)
    got: dict[int, tuple[list[int], str, FinishReason]] = {}
    while core.has_work:
        for out in core.step():
            toks, text, _ = got.get(ids[out.request_id], ([], "", None))
            got[ids[out.request_id]] = (toks + out.token_ids, text + out.text, out.finish_reason)
    return got


def _plain(core, text: str, n: int) -> GenerateRequest:
    return GenerateRequest(core.tokenizer.encode(text, add_special_tokens=False),
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def test_guided_output_matches_its_schema_and_unguided_neighbours_are_unchanged(core):
    guided = GenerateRequest(_chat(core, "Describe Paris as JSON."),
                             SamplingParams(max_tokens=60, temperature=0, guide=GuideSpec.json_schema(SCHEMA)))
    plain = [_plain(core, "The capital of France is", 12), _plain(core, "def add(a, b):", 8)]
    starts = []
    fill = core.runner.masks.start
    core.runner.masks.start = lambda m, rows, batch: starts.append(list(rows)) or fill(m, rows, batch)
    try:
        alone = _run(core, plain)
        assert starts == []  # no guided row: no mask work at all
        mixed = _run(core, [guided, *plain])
    finally:
        core.runner.masks.start = fill
    assert starts and all(rows == [0] for rows in starts)  # only the guided row's mask is filled
    assert mixed[1] == alone[0] and mixed[2] == alone[1]
    tokens, text, reason = mixed[0]
    assert reason is FinishReason.STOP and tokens[-1] in core.tokenizer.stop_token_ids
    jsonschema.validate(json.loads(text), SCHEMA)
    assert core.pool.num_free == core.pool.num_blocks and not core.requests


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(core):
    req = GenerateRequest(_chat(core, "Pick a colour."),
                          SamplingParams(max_tokens=50, temperature=0.8, seed=3, ignore_eos=True,
                                         guide=GuideSpec.choice(["red", "green", "blue"])))
    tokens, text, reason = _run(core, [req])[0]
    assert text in ("red", "green", "blue") and reason is FinishReason.STOP and len(tokens) < 50


def test_async_decode_gives_guided_requests_the_same_outputs(core):
    reqs = [
        GenerateRequest(_chat(core, "Describe Rome as JSON."),
                        SamplingParams(max_tokens=60, temperature=0.7, seed=11, guide=GuideSpec.json_schema(SCHEMA))),
        GenerateRequest(_chat(core, "Give a date."), SamplingParams(max_tokens=30, temperature=0,
                                                                    guide=GuideSpec("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))),
        _plain(core, "Once upon a time", 10),
    ]
    sync = _run(core, reqs, async_decode=False)
    assert _run(core, reqs, async_decode=True) == sync
    jsonschema.validate(json.loads(sync[0][1]), SCHEMA)
    assert len(sync[1][1]) == 10 and sync[1][2] is FinishReason.STOP


def test_guided_requests_run_after_the_core_was_closed_once(core):
    """An AsyncEngine's loop closes its core when it stops; the same core driven again still fills masks."""
    core.runner.masks.close()
    req = GenerateRequest(_chat(core, "Yes or no?"), SamplingParams(max_tokens=8, temperature=0,
                                                                     guide=GuideSpec.choice(["yes", "no"])))
    assert _run(core, [req])[0][1] in ("yes", "no")
